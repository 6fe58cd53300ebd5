// An agent's side of the rendezvous: its connection to the store, re-established (and
// re-bound with RESUME) when it breaks, and the heartbeat thread that polls the store.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>

#include "hmac_sha256.h"
#include "posix_util.h"
#include "rdzv.h"
#include "rdzv_wire.h"

namespace ddprun {

using namespace rdzv_wire;

RdzvClient::RdzvClient(std::string host, int port, std::string local_addr, double monitor_interval,
                       double heartbeat_timeout, std::string secret)
    : host_(std::move(host)),
      port_(port),
      local_addr_(std::move(local_addr)),
      endpoint_text_(host_ + ":" + std::to_string(port_)),
      monitor_interval_(monitor_interval),
      heartbeat_timeout_(heartbeat_timeout),
      secret_(std::move(secret)),
      last_answer_(Clock::now()) {
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
}

RdzvClient::~RdzvClient() {
  {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

bool RdzvClient::connect_once(double timeout_seconds) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  auto fail = [&] {
    ::close(fd);
    return false;
  };
  if (!local_addr_.empty()) {
    sockaddr_in local{};
    local.sin_family = AF_INET;
    if (::inet_pton(AF_INET, local_addr_.c_str(), &local.sin_addr) == 1) {
      // Leave the connection from --local-addr (a host name is only advertised, not bound).
      if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) return fail();
    }
  }
  sockaddr_in remote{};
  remote.sin_family = AF_INET;
  try {
    remote.sin_addr = resolve_ipv4(host_);
  } catch (const std::exception&) {
    return fail();
  }
  remote.sin_port = htons(static_cast<uint16_t>(port_));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof remote) != 0) {
    if (errno != EINPROGRESS) return fail();
    pollfd p{fd, POLLOUT, 0};
    const Clock::time_point deadline = after(timeout_seconds);
    int ready;
    while ((ready = ::poll(&p, 1, ms_until(deadline))) < 0 && errno == EINTR) {
    }
    if (ready <= 0) return fail();
    int error = 0;
    socklen_t length = sizeof error;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != 0) return fail();
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (!authenticate(fd, after(timeout_seconds))) return fail();
  if (local_addr_.empty()) {
    sockaddr_in mine{};
    socklen_t length = sizeof mine;
    // The address this host reaches the store from is one the other nodes can reach too.
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &length) == 0) local_addr_ = address_text(mine.sin_addr);
  }
  fd_ = fd;
  return true;
}

// Both sides prove that they know the secret without sending it (rdzv_wire.h).
bool RdzvClient::authenticate(int fd, Clock::time_point deadline) {
  const std::string client_nonce = random_hex(16);
  Message reply;
  if (!exchange(fd, {"HELLO", kProtocol, client_nonce}, &reply, deadline)) return false;
  if (reply.size() >= 2 && reply[0] == "refused") {
    refusal_ = reply[1];
    return false;
  }
  if (reply.size() < 4 || reply[0] != "challenge" || reply[1] != kProtocol) {
    refusal_ = "the process on " + endpoint_text_ + " is not a ddprun rendezvous store of this version";
    return false;
  }
  const std::string& server_nonce = reply[2];
  const std::string expected = server_proof(secret_, client_nonce, server_nonce);
  if (!equal_in_constant_time(reply[3], expected)) {
    refusal_ = "the rendezvous store at " + endpoint_text_ +
               " does not know this node's secret (every node needs the same --rdzv-secret-file or "
               "DDP_RDZV_SECRET_FILE, or none)";
    return false;
  }
  const std::string proof = client_proof(secret_, server_nonce, client_nonce);
  if (!exchange(fd, {"AUTH", proof}, &reply, deadline)) return false;
  if (reply.size() >= 2 && reply[0] == "refused") {
    refusal_ = reply[1];
    return false;
  }
  if (reply.empty() || reply[0] != "ok") return false;
  if (agent_id_.empty()) return true;
  // A new connection of a node that joined already speaks for it from now on.
  return exchange(fd, {"RESUME", agent_id_}, &reply, deadline);
}

bool RdzvClient::request(const Message& message, Message* reply, double timeout_seconds) {
  std::lock_guard<std::mutex> lock(connection_mutex_);
  const Clock::time_point deadline = after(timeout_seconds);
  if (fd_ < 0 && !connect_once(std::min(timeout_seconds, 1.0))) return false;
  if (exchange(fd_, message, reply, deadline)) return true;
  ::close(fd_);
  fd_ = -1;
  return false;
}


void RdzvClient::join(const std::string& run_id, const std::string& host_name, int nproc, bool hosts_store,
                      double connect_deadline_seconds) {
  const Clock::time_point deadline = after(connect_deadline_seconds);
  bool answered_garbage = false;
  while (true) {
    Message reply;
    const Message join_request = {"JOIN", kProtocol, run_id, host_name, local_addr_.empty() ? "?" : local_addr_,
                                  std::to_string(nproc), std::to_string(pick_free_tcp_port()),
                                  hosts_store ? "1" : "0"};
    bool connected;
    {
      std::lock_guard<std::mutex> lock(connection_mutex_);
      refusal_.clear();
      connected = fd_ >= 0 || connect_once(1.0);
      if (!connected && !refusal_.empty()) {
        throw std::runtime_error("cannot join the rendezvous store at " + endpoint_text_ + ": " + refusal_);
      }
    }
    if (connected) {
      Message request_with_addr = join_request;
      request_with_addr[4] = local_addr_;  // known once connected
      const double remaining = std::chrono::duration<double>(deadline - Clock::now()).count();
      if (request(request_with_addr, &reply, std::clamp(remaining, 1.0, 5.0))) {
        if (reply.size() >= 3 && reply[0] == "ok" && reply[1] == kProtocol) {
          agent_id_ = reply[2];
          last_answer_ = Clock::now();
          return;
        }
        if (reply.size() >= 2 && reply[0] == "refused") {
          throw std::runtime_error("the rendezvous store at " + endpoint_text_ + " refused this node (run id '" +
                                   run_id + "'): " + reply[1]);
        }
        answered_garbage = true;
      }
    }
    if (Clock::now() >= deadline) {
      throw std::runtime_error(
          answered_garbage ? "the process on " + endpoint_text_ + " is not a ddprun rendezvous store"
                           : "cannot reach the rendezvous store at " + endpoint_text_ + " within " +
                                 fmt(connect_deadline_seconds) +
                                 " s (is the first ddprun running? --rdzv-conf join_timeout=SECONDS)");
    }
    ::usleep(200 * 1000);
  }
}

RdzvView RdzvClient::parse_view(const Message& reply) {
  RdzvView view;
  if (reply.empty()) return view;
  const std::string& kind = reply[0];
  if (kind == "wait") {
    view.kind = RdzvView::kWait;
    if (reply.size() > 1) view.text = reply[1];
  } else if (kind == "round" && reply.size() >= 10) {
    view.kind = RdzvView::kRound;
    view.round = to_int(reply[1]);
    view.node_rank = to_int(reply[2]);
    view.nnodes = to_int(reply[3]);
    view.world_size = to_int(reply[4]);
    view.base_rank = to_int(reply[5]);
    view.master_addr = reply[6];
    view.master_port = to_int(reply[7]);
    view.restart_count = to_int(reply[8]);
    view.text = reply[9];
  } else if (kind == "stop" && reply.size() >= 3) {
    view.kind = RdzvView::kStop;
    view.round = to_int(reply[1]);
    view.text = reply[2];
  } else if (kind == "done") {
    view.kind = RdzvView::kDone;
  } else if (kind == "fail") {
    view.kind = RdzvView::kFail;
    if (reply.size() > 1) view.text = reply[1];
  } else if (kind == "lost") {
    view.kind = RdzvView::kLost;
    if (reply.size() > 1) view.text = reply[1];
  }
  return view;
}

void RdzvClient::mark_supervisor_alive() {
  supervisor_alive_at_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

void RdzvClient::start_heartbeat() {
  mark_supervisor_alive();
  BlockSignalsForNewThreads block;
  thread_ = std::thread([this] { heartbeat_loop(); });
}

void RdzvClient::heartbeat_loop() {
  const double request_timeout = std::clamp(heartbeat_timeout_ / 3, 0.3, 2.0);
  while (true) {
    Message reply;
    const Clock::time_point supervisor_alive_at{Clock::duration(supervisor_alive_at_.load(std::memory_order_relaxed))};
    if (seconds_between(supervisor_alive_at, Clock::now()) > heartbeat_timeout_) {
      // Skipped, not failed: the store's silence is for a loop that cannot act on its answers.
    } else if (request({"POLL", agent_id_}, &reply, request_timeout)) {
      RdzvView fresh = parse_view(reply);
      std::lock_guard<std::mutex> lock(view_mutex_);
      last_answer_ = Clock::now();
      if (fresh.kind != view_.kind || fresh.round != view_.round || fresh.text != view_.text) {
        view_ = fresh;
        char byte = 1;
        ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
        (void)ignored;
      }
    } else {
      char byte = 1;  // the main loop re-checks how long the store has been silent
      ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
      (void)ignored;
    }
    std::unique_lock<std::mutex> lock(stop_mutex_);
    if (stop_cv_.wait_for(lock, std::chrono::duration<double>(monitor_interval_), [this] { return stopping_; })) return;
  }
}

RdzvView RdzvClient::view() {
  std::lock_guard<std::mutex> lock(view_mutex_);
  return view_;
}

double RdzvClient::seconds_since_answer() {
  std::lock_guard<std::mutex> lock(view_mutex_);
  return seconds_between(last_answer_, Clock::now());
}

bool RdzvClient::store_lost() { return seconds_since_answer() > heartbeat_timeout_; }

void RdzvClient::drain_wake() {
  char buffer[64];
  while (::read(wake_pipe_[0], buffer, sizeof buffer) > 0) {
  }
}

void RdzvClient::notify_failing(int round, int rank, const std::string& how) {
  Message reply;
  request({"FAILING", agent_id_, std::to_string(round), std::to_string(rank), how}, &reply, 2.0);
}

void RdzvClient::report(int round, const std::string& kind, const Message& failure) {
  Message message = {"REPORT", agent_id_, std::to_string(round), kind, std::to_string(pick_free_tcp_port())};
  message.insert(message.end(), failure.begin(), failure.end());
  Message reply;
  // The report ends this node's round; without it the store would wait for our heartbeat to
  // stop. Retried until the heartbeat timeout: a store that is gone by then is lost anyway.
  const Clock::time_point deadline = after(heartbeat_timeout_);
  while (!request(message, &reply, 2.0) && Clock::now() < deadline) {
    mark_supervisor_alive();  // retrying here is the supervisor at work
    ::usleep(100 * 1000);
  }
}

void RdzvClient::leave() {
  Message reply;
  request({"LEAVE", agent_id_}, &reply, 2.0);
}

}  // namespace ddprun
