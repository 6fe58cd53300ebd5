// The rendezvous store's network side: one thread polls the listener and every connection,
// runs the handshake, and hands authenticated requests to the state machine (rdzv_store.cpp).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "hmac_sha256.h"
#include "posix_util.h"
#include "rdzv.h"
#include "rdzv_store.h"
#include "rdzv_wire.h"

namespace ddprun {

using namespace rdzv_wire;

std::unique_ptr<RdzvServer> RdzvServer::try_bind(const std::string& host, int port, const RdzvConfig& config,
                                                 std::string* why, int* error_number) {
  in_addr address = resolve_ipv4(host);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw_errno("socket");
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in bind_address{};
  bind_address.sin_family = AF_INET;
  bind_address.sin_addr = address;
  bind_address.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&bind_address), sizeof bind_address) != 0 || ::listen(fd, 128) != 0) {
    *error_number = errno;
    *why = std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<RdzvServer>(new RdzvServer(fd, config));
}

RdzvServer::RdzvServer(int listen_fd, const RdzvConfig& config)
    : listen_fd_(listen_fd), state_(std::make_unique<State>(config)) {
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
  BlockSignalsForNewThreads block;
  thread_ = std::thread([this] { loop(); });
}

RdzvServer::~RdzvServer() {
  char byte = 1;
  ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
  (void)ignored;
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

void RdzvServer::wait_until_everyone_knows(double seconds) {
  const Clock::time_point deadline = after(seconds);
  while (Clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      bool all = state_->phase == State::Phase::kFinished;
      for (auto& [id, agent] : state_->agents) all = all && (agent.gone || agent.informed);
      if (all) return;
    }
    ::usleep(20 * 1000);
  }
}

void RdzvServer::loop() {
  // Until a connection has proven the secret it may hold only a small buffer and a slot for a
  // few seconds: strangers must not be able to fill the table or the memory.
  enum class Stage { kNew, kChallenged, kAuthenticated };
  struct Connection {
    int fd = -1;
    std::string in, out;
    Clock::time_point opened, last_activity;
    Stage stage = Stage::kNew;
    std::string client_nonce, server_nonce;
    State::Peer peer;
    bool peer_closed = false;  // it shut down its side: send what is left, then close
    bool closing = false;      // refused: send the refusal, then close
  };
  std::vector<Connection> connections;
  long next_serial = 0;
  // A connection silent for this long belongs to an agent that is gone (or a stray client).
  const double idle_limit = std::max(30.0, 4 * state_->config.heartbeat_timeout);
  const double handshake_limit = 5.0;
  constexpr size_t kMaxUnauthenticatedInput = 4096;
  // Half the descriptors this process may open, at most 1024: the agent needs the rest for its
  // workers' pipes.
  size_t max_connections = 1024;
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    max_connections = std::clamp<size_t>(files.rlim_cur / 2, 16, 1024);
  }
  Clock::time_point accept_paused_until{};

  auto evict_oldest_unauthenticated = [&] {
    Connection* oldest = nullptr;
    for (Connection& c : connections) {
      if (c.fd >= 0 && c.stage != Stage::kAuthenticated && (oldest == nullptr || c.opened < oldest->opened)) oldest = &c;
    }
    if (oldest == nullptr) return false;
    ::close(oldest->fd);
    oldest->fd = -1;
    return true;
  };

  // The challenge and response; only an authenticated connection reaches the state machine.
  auto respond = [&](Connection& c, const Message& request, Clock::time_point now) -> Message {
    const std::string op = request.empty() ? std::string() : request[0];
    if (c.stage == Stage::kNew) {
      if (op != "HELLO" || request.size() < 3 || request[1] != kProtocol || request[2].size() > 128) {
        c.closing = true;
        return {"refused", "protocol mismatch: a ddprun rendezvous store expects its own handshake first"};
      }
      c.client_nonce = request[2];
      c.server_nonce = random_hex(16);
      c.stage = Stage::kChallenged;
      return {"challenge", kProtocol, c.server_nonce,
              server_proof(state_->config.secret, c.client_nonce, c.server_nonce)};
    }
    if (c.stage == Stage::kChallenged) {
      const std::string expected = client_proof(state_->config.secret, c.server_nonce, c.client_nonce);
      if (op != "AUTH" || request.size() < 2 || !equal_in_constant_time(request[1], expected)) {
        c.closing = true;
        return {"refused", "authentication failed: this node's rendezvous secret is not the store's (every node "
                           "needs the same secret: --rdzv-secret-file or DDP_RDZV_SECRET_FILE)"};
      }
      c.stage = Stage::kAuthenticated;
      return {"ok"};
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->handle(request, now, &c.peer);
  };

  auto serve = [&](Connection& c, short revents, Clock::time_point now) {
    if (revents & (POLLERR | POLLNVAL)) return false;
    if (!c.peer_closed && (revents & (POLLIN | POLLHUP))) {
      const size_t input_limit = c.stage == Stage::kAuthenticated ? kMaxFrame + 8 : kMaxUnauthenticatedInput;
      // Everything that is there now, so that a burst of requests is answered in one pass.
      for (size_t taken = 0; taken < 4 * kMaxFrame;) {
        char buffer[16384];
        const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
        if (n > 0) {
          c.in.append(buffer, static_cast<size_t>(n));
          taken += static_cast<size_t>(n);
          c.last_activity = now;
          Message request;
          int got;
          while (!c.closing && (got = take_frame(c.in, &request)) == 1) c.out += encode(respond(c, request, now));
          if (c.closing) break;
          if (got < 0 || c.in.size() > input_limit) return false;
          continue;
        }
        if (n == 0) {
          c.peer_closed = true;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return false;
        }
        break;
      }
    }
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        break;
      } else {
        return false;
      }
    }
    if ((c.peer_closed || c.closing) && c.out.empty()) return false;
    if (c.stage != Stage::kAuthenticated && seconds_between(c.opened, now) > handshake_limit) return false;
    if (seconds_between(c.last_activity, now) > idle_limit) return false;
    return c.out.size() <= kMaxFrame * 4;  // a peer that never reads its replies
  };

  while (true) {
    Clock::time_point now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    std::vector<pollfd> fds = {{wake_pipe_[0], POLLIN, 0}, {listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0}};
    for (const Connection& c : connections) {
      short events = c.out.empty() ? 0 : POLLOUT;
      if (!c.peer_closed) events |= POLLIN;
      fds.push_back({c.fd, events, 0});
    }
    const int ready = ::poll(fds.data(), fds.size(), 100);
    if (ready < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;  // shutting down
    now = Clock::now();
    // Only the connections that were polled: fds holds nothing for the ones accepted below.
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      if (!serve(c, ready > 0 ? fds[i + 2].revents : 0, now)) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    connections.erase(std::remove_if(connections.begin(), connections.end(),
                                     [](const Connection& c) { return c.fd < 0; }),
                      connections.end());
    if (ready > 0 && (fds[1].revents & POLLIN)) {
      while (true) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if ((errno == EMFILE || errno == ENFILE) && evict_oldest_unauthenticated()) continue;
          // Out of descriptors with no stranger to evict: stop polling the listener for a
          // while rather than spin on a backlog we cannot take.
          if (errno != EAGAIN && errno != EWOULDBLOCK) accept_paused_until = now + std::chrono::milliseconds(200);
          break;
        }
        size_t open = 0;
        for (const Connection& c : connections) open += c.fd >= 0 ? 1 : 0;
        if (open >= max_connections && !evict_oldest_unauthenticated()) {
          ::close(fd);  // every slot is an agent's
          continue;
        }
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        Connection c;
        c.fd = fd;
        c.opened = c.last_activity = now;
        c.peer.serial = next_serial++;
        connections.push_back(std::move(c));
      }
      connections.erase(std::remove_if(connections.begin(), connections.end(),
                                       [](const Connection& c) { return c.fd < 0; }),
                        connections.end());
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->tick(now);
  }
  for (Connection& c : connections) ::close(c.fd);
}

}  // namespace ddprun
