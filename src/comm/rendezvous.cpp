#include "comm/rendezvous.h"

#include "common/duration_text.h"
#include "launch/env_impl.h"

#include <ddp/error.h>
#include <ddp/launch_env.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

namespace ddp::detail {
namespace {

using Clock = StoreDeadline::Clock;

// Binds rank 0's listening socket ourselves rather than letting the store do
// it: a busy port then fails at once with the address in the message, and the
// store listens only on MASTER_ADDR's interface instead of on all of them.
int listen_on(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &result);
  DDP_CHECK(rc == 0 && result != nullptr, "ddp: cannot resolve MASTER_ADDR=", host, ": ",
              gai_strerror(rc));
  int last_errno = 0;
  int fd = -1;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 2048) == 0) break;
    last_errno = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(result);
  DDP_CHECK(last_errno != EADDRINUSE || fd >= 0, "ddp: rank 0 cannot listen on ", host, ":",
              port, ": the address is already in use (another job or program holds port ", port,
              "). Pick another MASTER_PORT, or launch with 'ddprun --standalone' to get a free one.");
  DDP_CHECK(fd >= 0, "ddp: rank 0 cannot listen on ", host, ":", port, ": ",
              std::strerror(last_errno),
              ". MASTER_ADDR must be an address of rank 0's own host.");
  return fd;
}

// How long after the rendezvous deadline StoreDeadline cuts the store's
// connection: our own waits end at the deadline and report what they
// waited for; StoreDeadline only catches reads that c10d makes without a limit.
constexpr std::chrono::milliseconds kGuardGrace{1000};

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "?";
  return name;
}

bool env_true(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return false;
  std::string v(value);
  return v == "1" || v == "true" || v == "True" || v == "TRUE" || v == "yes";
}

}  // namespace

int restart_count() {
  const char* text = std::getenv(launch_env::kRestartCount);
  if (text == nullptr || *text == '\0') return 0;
  return parse_int_env(launch_env::kRestartCount, text);
}

namespace {

std::string address_of(const World& world) { return world.master_addr + ":" + std::to_string(world.master_port); }

// One connection attempt with a deadline of its own: a non-blocking connect
// and a poll, so a master whose packets are dropped cannot hold us for the
// kernel's SYN retries (about two minutes). Empty on success, else why not.
std::string try_connect(const addrinfo* ai, std::chrono::milliseconds limit) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return std::strerror(errno);
  std::string problem;
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      problem = std::strerror(errno);
    } else {
      pollfd p{fd, POLLOUT, 0};
      int ready = poll(&p, 1, static_cast<int>(limit.count()));
      if (ready == 0) {
        problem = "no answer to the connection request (are packets to the master dropped by a firewall?)";
      } else if (ready < 0) {
        problem = std::strerror(errno);
      } else {
        int error = 0;
        socklen_t length = sizeof(error);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
        if (error != 0) problem = std::strerror(error);
      }
    }
  }
  close(fd);
  return problem;
}

// Waits until the master accepts connections, retrying every 10 ms until
// `deadline`; each attempt has its own time limit. The store's client
// retries on its own too, but only once a second: ranks started a moment
// before rank 0 listens would each lose up to a second. Returns why the last
// attempt failed, or an empty string once one succeeded.
std::string wait_for_master(const World& world, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(world.master_port);
  int rc = getaddrinfo(world.master_addr.c_str(), port_text.c_str(), &hints, &result);
  if (rc != 0 || result == nullptr) return std::string("cannot resolve MASTER_ADDR: ") + gai_strerror(rc);
  std::string problem = "no attempt was made";
  while (Clock::now() < deadline) {
    for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
      auto limit = std::min(remaining(deadline), std::chrono::milliseconds(2000));
      problem = try_connect(ai, limit);
      if (problem.empty()) break;
    }
    if (problem.empty()) break;
    std::this_thread::sleep_for(std::min(remaining(deadline), std::chrono::milliseconds(10)));
  }
  freeaddrinfo(result);
  return problem;
}

}  // namespace

StoreDeadline::~StoreDeadline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StoreDeadline::arm(Clock::time_point deadline, std::string awaited) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    deadline_ = deadline;
    awaited_ = std::move(awaited);
    armed_ = true;
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  changed_.notify_all();
}

void StoreDeadline::disarm() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
  changed_.notify_all();
}

bool StoreDeadline::expired() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return expired_;
}

std::string StoreDeadline::awaited() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return awaited_;
}

void StoreDeadline::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (!armed_ || expired_) {
      changed_.wait(lock);
      continue;
    }
    if (Clock::now() < deadline_) {
      changed_.wait_until(lock, deadline_);
      continue;
    }
    expired_ = true;
    cut_store_connections();
  }
}

namespace {
int port_of(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
  return -1;
}
}  // namespace

// Every TCP connection of this process to the master's port (the store's
// clients; rank 0's server side has the master's port as its own).
void StoreDeadline::cut_store_connections() {
  DIR* directory = opendir("/proc/self/fd");
  if (directory == nullptr) return;
  while (dirent* entry = readdir(directory)) {
    char* end = nullptr;
    long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(directory)) continue;
    struct stat info {};
    if (fstat(static_cast<int>(fd), &info) != 0 || !S_ISSOCK(info.st_mode)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_length = sizeof(peer), local_length = sizeof(local);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0) continue;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_length) != 0) continue;
    if (port_of(peer) == master_port_ && port_of(local) != master_port_) {
      shutdown(static_cast<int>(fd), SHUT_RDWR);
    }
  }
  closedir(directory);
}

void throw_store_did_not_answer(const World& world, std::chrono::milliseconds timeout,
                                const StoreDeadline& deadline, const c10::Error& cause) {
  DDP_PEER_CHECK(false, "ddp: rank ", world.rank, " connected to ", address_of(world), " but waited ",
                 seconds_text(timeout), " for ", deadline.awaited(),
                 " without getting it, and gave up. Check that MASTER_PORT is the port of ",
                 "this job's rank 0 (or of its launcher's store), not another program's, and that rank 0 is not ",
                 "stopped or overloaded. (", cause.what_without_backtrace(), ")");
}

namespace {

// Connects to the rendezvous store: rank 0 hosts it, unless the launcher
// (torchrun) already serves one on MASTER_PORT, which every rank then joins
// as a client.
c10::intrusive_ptr<c10d::TCPStore> connect_store(const World& world, bool agent_store, Clock::time_point deadline,
                                                 std::chrono::milliseconds timeout, const StoreDeadline& guard) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(world.master_port);
  store_options.isServer = world.rank == 0 && !agent_store;
  if (!agent_store) store_options.numWorkers = world.world_size;
  // Arrival is checked by WorldCheck below, per rank, rather than by counting
  // connections: a foreign client would count as a rank.
  store_options.waitWorkers = false;
  if (store_options.isServer) {
    store_options.masterListenFd = listen_on(world.master_addr, world.master_port);
  } else {
    std::string problem = wait_for_master(world, deadline);
    DDP_PEER_CHECK(problem.empty(), "ddp: rank ", world.rank, " cannot reach the ",
              agent_store ? "launcher's store" : "master", " at ", address_of(world), " within ",
              seconds_text(timeout), ": ", problem, ". Check that ",
              agent_store ? "the launcher (torchrun) is running" : "rank 0 is running",
              ", that MASTER_ADDR/MASTER_PORT point at it, and that no firewall blocks the port.");
  }
  store_options.timeout = remaining(deadline);
  try {
    return c10::make_intrusive<c10d::TCPStore>(world.master_addr, store_options);
  } catch (const c10::Error& e) {
    if (guard.expired()) throw_store_did_not_answer(world, timeout, guard, e);
    DDP_PEER_CHECK(false, "ddp: rank ", world.rank, " cannot reach the master at ", address_of(world), " within ",
              seconds_text(timeout), ". Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point at it, ",
              "and that no firewall blocks the port. (", e.what_without_backtrace(), ")");
  }
}

// What each rank publishes when it joins (rendezvous.h).
using Arrival = RankRecord;

// The rendezvous after the store is connected, all under one deadline:
//  - the run id (rank 0's, in the unprefixed store) must be this rank's;
//  - every rank claims its rank (two processes with one rank fail) and
//    publishes its world size;
//  - a rank whose world size differs from rank 0's stops every rank at once
//    with a message naming both;
//  - rank 0 waits for every rank's record, then tells the others that all
//    arrived; a rank that never comes is reported with those that did.
class WorldCheck {
 public:
  WorldCheck(c10d::Store& shared, c10d::Store& attempt, const World& world, std::string run_id, bool hosts_store,
          Clock::time_point deadline, std::chrono::milliseconds timeout)
      : shared_(shared), store_(attempt), world_(world), run_id_(std::move(run_id)), hosts_store_(hosts_store),
        deadline_(deadline), timeout_(timeout) {
    poll_interval_ = std::chrono::milliseconds(std::min(200, 10 + world.world_size / 4));
  }

  void run() {
    check_run_id();
    me_.world_size = world_.world_size;
    me_.run_id = run_id_;
    me_.host = host_name();
    me_.pid = std::to_string(::getpid());
    if (store_.add(claim_key(world_.rank), 1) > 1) {
      std::string other = store_.check({rank_key(world_.rank)})
                              ? " (" + Arrival::decode(text_of(store_.get(rank_key(world_.rank)))).where() + ")"
                              : "";
      abort(c10::str("ddp: two processes joined as rank ", world_.rank, " at ", address_of(world_), ": this one (",
                     me_.where(), ") and an earlier one", other,
                     ". Every process of a job needs its own RANK; check the launcher's variables, and that no ",
                     "other job uses this MASTER_PORT."),
            /*peer_failure=*/false);
    }
    store_.set(rank_key(world_.rank), bytes_of(me_.encode()));
    if (world_.rank == 0) {
      gather_everyone();
    } else {
      check_against_rank_0();
      wait_for_all_arrived();
    }
  }

 private:
  static std::string rank_key(int r) { return "rdzv/rank_" + std::to_string(r); }
  static std::string claim_key(int r) { return "rdzv/claim_" + std::to_string(r); }
  static constexpr const char* kAbort = "rdzv/abort";
  static constexpr const char* kComplete = "rdzv/complete";
  static constexpr const char* kAbortSeen = "rdzv/abort_seen";

  // `peer_failure`: this rank stops because of another one (a rank that
  // never came), not because of its own setup.
  [[noreturn]] void abort(const std::string& message, bool peer_failure) {
    try {
      store_.set(kAbort, bytes_of(message));
      if (!hosts_store_) store_.add(kAbortSeen, 1);
      linger_for_the_others();
    } catch (const c10::Error&) {
      // The others then fail at their own deadline.
    }
    if (peer_failure) throw PeerFailure(message);
    DDP_CHECK(false, message);
  }

  // Throws the message of a rank that stopped the rendezvous, if any.
  void check_abort() {
    if (!store_.check({kAbort})) return;
    std::string message = text_of(store_.get(kAbort));
    try {
      store_.add(kAbortSeen, 1);
      linger_for_the_others();
    } catch (const c10::Error&) {
    }
    DDP_PEER_CHECK(false, message, " (rank ", world_.rank, " stops too)");
  }

  // The rank that hosts the store keeps it up until every rank that joined
  // has read why the rendezvous stopped (at most 1 s): they would otherwise
  // see only a closed connection.
  void linger_for_the_others() {
    if (!hosts_store_) return;
    int others = 0;
    for (int r = 1; r < world_.world_size; ++r) others += store_.check({rank_key(r)}) ? 1 : 0;
    auto until = Clock::now() + std::chrono::seconds(1);
    while (store_.add(kAbortSeen, 0) < others && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  void sleep_a_little() { std::this_thread::sleep_for(std::min(poll_interval_, remaining(deadline_))); }

  std::string world_size_mismatch(int rank, const Arrival& theirs) const {
    return c10::str("ddp: the ranks disagree on the world size: rank ", rank, " (", theirs.where(),
                    ") was started with world size ", theirs.world_size, " but rank ", world_.rank, " (",
                    me_.where(), ") with world size ", world_.world_size, " (", world_.source,
                    " variables). Start every rank of the job with the same world size (WORLD_SIZE); ",
                    "ddprun and torchrun set it for every rank.");
  }

  void check_run_id() {
    const std::string key = "ddp/run_id";
    if (world_.rank == 0) {
      shared_.set(key, bytes_of(run_id_));
      return;
    }
    while (!shared_.check({key})) {
      DDP_PEER_CHECK(Clock::now() < deadline_, "ddp: rank ", world_.rank, " reached the store at ", address_of(world_),
                " but rank 0 did not publish its run id there within ", seconds_text(timeout_),
                ". Check that rank 0 of this job is running and uses this MASTER_ADDR/MASTER_PORT.");
      sleep_a_little();
    }
    std::string master_run_id = text_of(shared_.get(key));
    DDP_CHECK(master_run_id == run_id_, "ddp: rank ", world_.rank, " belongs to run '", run_id_,
              "' but the master at ", address_of(world_), " runs '", master_run_id,
              "'. Another job is using this MASTER_PORT; give each job its own port and run id ",
              "(ddprun --rdzv-id, or DDP_RUN_ID).");
  }

  // Which ranks have published their record, and which have not.
  void arrivals(std::vector<int>& arrived, std::vector<int>& missing) {
    for (int r = 0; r < world_.world_size; ++r) (store_.check({rank_key(r)}) ? arrived : missing).push_back(r);
  }

  std::string not_all_joined(const std::vector<int>& arrived, const std::vector<int>& missing) const {
    return c10::str("ddp: rank ", world_.rank, " waited ", seconds_text(timeout_), " at ", address_of(world_),
                    " for the other ", world_.world_size - 1, " rank(s), but not all of them joined: rank(s) ",
                    rank_list(arrived), " arrived, rank(s) ", rank_list(missing),
                    " did not. Check that every rank was started with the same MASTER_ADDR/MASTER_PORT and ",
                    "WORLD_SIZE=", world_.world_size, ", and whether a missing rank failed before it got here.");
  }

  void gather_everyone() {
    wait_for_every_rank(
        world_.world_size, deadline_,
        [&](int r) {
          if (!store_.check({rank_key(r)})) return false;
          Arrival theirs = Arrival::decode(text_of(store_.get(rank_key(r))));
          if (theirs.world_size != world_.world_size) abort(world_size_mismatch(r, theirs), /*peer_failure=*/false);
          return true;
        },
        [&] { check_abort(); }, [&] { sleep_a_little(); },
        [&](const std::vector<int>& arrived, const std::vector<int>& missing) {
          abort(not_all_joined(arrived, missing), /*peer_failure=*/true);
        });
    store_.set(kComplete, bytes_of("1"));
  }

  void check_against_rank_0() {
    while (!store_.check({rank_key(0)})) {
      check_abort();
      DDP_PEER_CHECK(Clock::now() < deadline_, "ddp: rank ", world_.rank, " waited ", seconds_text(timeout_), " at ",
                address_of(world_), " for rank 0 to join, but it did not. Check that rank 0 of this job is running.");
      sleep_a_little();
    }
    Arrival rank0 = Arrival::decode(text_of(store_.get(rank_key(0))));
    if (rank0.world_size != world_.world_size) abort(world_size_mismatch(0, rank0), /*peer_failure=*/false);
  }

  void wait_for_all_arrived() {
    while (!store_.check({kComplete})) {
      check_abort();
      if (Clock::now() >= deadline_) {
        std::vector<int> arrived, missing;
        try {
          arrivals(arrived, missing);
          store_.add(kAbortSeen, 1);  // rank 0 need not keep the store up for us
        } catch (const c10::Error&) {
          // The store went away meanwhile: report what we know.
        }
        DDP_PEER_CHECK(false, not_all_joined(arrived, missing));
      }
      sleep_a_little();
    }
  }

  c10d::Store& shared_;
  c10d::Store& store_;
  const World& world_;
  const std::string run_id_;
  const bool hosts_store_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
  std::chrono::milliseconds poll_interval_;
  Arrival me_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> rendezvous(const World& world, const std::string& run_id,
                                           std::chrono::milliseconds timeout, StoreDeadline& deadline_guard) {
  // Rendezvous as a whole, not each of its waits, takes at most `timeout`.
  const Clock::time_point deadline = Clock::now() + timeout;
  const bool agent_store = env_true(launch_env::kUseAgentStore);
  deadline_guard.arm(deadline + kGuardGrace, "an answer to the store's handshake");
  auto tcp = connect_store(world, agent_store, deadline, timeout, deadline_guard);
  deadline_guard.arm(deadline + kGuardGrace, "the store's answers while the ranks met");
  // torchrun's store outlives a restart: each attempt keeps its own keys.
  auto attempt = c10::make_intrusive<c10d::PrefixStore>("ddp/attempt_" + std::to_string(restart_count()), tcp);
  WorldCheck(*tcp, *attempt, world, run_id, world.rank == 0 && !agent_store, deadline, timeout).run();
  tcp->setTimeout(timeout);  // later uses of the store get the full timeout each
  deadline_guard.arm(Clock::now() + timeout + kGuardGrace, "the store's answers while the backend connected");
  // Every key of this job lives under its run id, so even a foreign
  // process that got past the check could not touch them.
  return c10::make_intrusive<c10d::PrefixStore>("run/" + run_id, attempt);
}

std::string RankRecord::encode() const {
  return std::to_string(world_size) + "\n" + run_id + "\n" + host + "\n" + pid;
}

RankRecord RankRecord::read(std::istream& in) {
  RankRecord r;
  std::string size;
  std::getline(in, size);
  std::getline(in, r.run_id);
  std::getline(in, r.host);
  std::getline(in, r.pid);
  try {
    r.world_size = std::stoi(size);
  } catch (...) {
    r.world_size = -1;
  }
  return r;
}

RankRecord RankRecord::decode(const std::string& text) {
  std::istringstream in(text);
  return read(in);
}

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "none";
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

std::chrono::milliseconds remaining(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

void wait_for_every_rank(int world_size, std::chrono::steady_clock::time_point deadline,
                         const std::function<bool(int)>& has_arrived, const std::function<void()>& check_stop,
                         const std::function<void()>& sleep,
                         const std::function<void(const std::vector<int>&, const std::vector<int>&)>& at_deadline) {
  std::vector<bool> seen(static_cast<size_t>(world_size), false);
  seen[0] = true;
  int still_missing = world_size - 1;
  while (still_missing > 0) {
    check_stop();
    for (int r = 1; r < world_size; ++r) {
      if (seen[static_cast<size_t>(r)] || !has_arrived(r)) continue;
      seen[static_cast<size_t>(r)] = true;
      --still_missing;
    }
    if (still_missing == 0) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> arrived, missing;
      for (int r = 0; r < world_size; ++r) (seen[static_cast<size_t>(r)] ? arrived : missing).push_back(r);
      at_deadline(arrived, missing);
      TORCH_CHECK(false, "ddp: internal error: the rendezvous went on past its deadline");
    }
    sleep();
  }
}

}  // namespace ddp::detail
