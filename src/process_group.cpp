#include <ddp/process_group.h>

#include <ddp/error.h>

#include "backends.h"

#include <ddp/device.h>
#include <ddp/stack_dump.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
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
#include <atomic>
#include <fstream>
#include <cerrno>
#include <csignal>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

namespace ddp {
namespace {

std::string seconds_text(std::chrono::milliseconds timeout) {
  double seconds = static_cast<double>(timeout.count()) / 1000.0;
  std::ostringstream out;
  out << seconds << " s";
  return out.str();
}

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

using Clock = std::chrono::steady_clock;

// How long after the rendezvous deadline the store guard below cuts the
// store's connection: our own waits end at the deadline and report what they
// waited for; the guard only catches reads that c10d makes without a limit.
constexpr std::chrono::milliseconds kGuardGrace{1000};

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

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

// torchrun's restart count: with torchrun's store, which lives across
// restarts, each attempt keeps its keys apart (as Python's env:// does).
int restart_count() {
  const char* text = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (text == nullptr || *text == '\0') return 0;
  return parse_int_env("TORCHELASTIC_RESTART_COUNT", text);
}

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

// Puts a deadline on the store client's reads. c10d's client reads some
// replies (its handshake's ping, add, get) without a time limit, so a master
// that accepts the connection and never answers would block a rank forever.
// When the deadline passes, the guard shuts down this process's connections
// to MASTER_ADDR:MASTER_PORT; the blocked read returns, c10d throws, and
// rendezvous reports what it was waiting for.
class StoreGuard {
 public:
  explicit StoreGuard(int master_port) : master_port_(master_port) {}
  ~StoreGuard() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  StoreGuard(const StoreGuard&) = delete;
  StoreGuard& operator=(const StoreGuard&) = delete;

  // From now until disarm(), a wait for `awaited` that is still going on at
  // `deadline` is cut.
  void arm(Clock::time_point deadline, std::string awaited) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      deadline_ = deadline;
      awaited_ = std::move(awaited);
      armed_ = true;
    }
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    changed_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_ = false;
    changed_.notify_all();
  }
  bool expired() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return expired_;
  }
  std::string awaited() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return awaited_;
  }

 private:
  void run() {
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

  static int port_of(const sockaddr_storage& address) {
    if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
    if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
    return -1;
  }

  // Every TCP connection of this process to the master's port (the store's
  // clients; rank 0's server side has the master's port as its own).
  void cut_store_connections() {
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

  const int master_port_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::thread thread_;
  Clock::time_point deadline_;
  std::string awaited_;
  bool armed_ = false;
  bool expired_ = false;
  bool stop_ = false;
};

// What a rank says when the store guard had to cut a wait of c10d's.
[[noreturn]] void throw_store_did_not_answer(const World& world, std::chrono::milliseconds timeout,
                                             const StoreGuard& guard, const c10::Error& cause) {
  DDP_CHECK(false, "ddp: rank ", world.rank, " connected to ", address_of(world), " but waited ", seconds_text(timeout),
            " for ", guard.awaited(), " without getting it, and gave up. Check that MASTER_PORT is the port of ",
            "this job's rank 0 (or of its launcher's store), not another program's, and that rank 0 is not ",
            "stopped or overloaded. (", cause.what_without_backtrace(), ")");
}

// Connects to the rendezvous store: rank 0 hosts it, unless the launcher
// (torchrun) already serves one on MASTER_PORT, which every rank then joins
// as a client.
c10::intrusive_ptr<c10d::TCPStore> connect_store(const World& world, bool agent_store, Clock::time_point deadline,
                                                 std::chrono::milliseconds timeout, const StoreGuard& guard) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(world.master_port);
  store_options.isServer = world.rank == 0 && !agent_store;
  if (!agent_store) store_options.numWorkers = world.world_size;
  // Arrival is checked by meet() below, per rank, rather than by counting
  // connections: a foreign client would count as a rank.
  store_options.waitWorkers = false;
  if (store_options.isServer) {
    store_options.masterListenFd = listen_on(world.master_addr, world.master_port);
  } else {
    std::string problem = wait_for_master(world, deadline);
    DDP_CHECK(problem.empty(), "ddp: rank ", world.rank, " cannot reach the ",
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
    DDP_CHECK(false, "ddp: rank ", world.rank, " cannot reach the master at ", address_of(world), " within ",
              seconds_text(timeout), ". Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point at it, ",
              "and that no firewall blocks the port. (", e.what_without_backtrace(), ")");
  }
}

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

// "0, 2, 5", or "none".
std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "none";
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

// What each rank publishes when it joins: its world size and run id, and
// where it runs, for messages.
struct Arrival {
  int world_size = 0;
  std::string run_id;
  std::string host;
  std::string pid;

  std::string encode() const {
    return std::to_string(world_size) + "\n" + run_id + "\n" + host + "\n" + pid;
  }
  static Arrival decode(const std::string& text) {
    Arrival a;
    std::istringstream in(text);
    std::string size;
    std::getline(in, size);
    std::getline(in, a.run_id);
    std::getline(in, a.host);
    std::getline(in, a.pid);
    try {
      a.world_size = std::stoi(size);
    } catch (...) {
      a.world_size = -1;
    }
    return a;
  }
  std::string where() const { return "host " + host + ", pid " + pid; }
};

// The rendezvous after the store is connected, all under one deadline:
//  - the run id (rank 0's, in the unprefixed store) must be this rank's;
//  - every rank claims its rank (two processes with one rank fail) and
//    publishes its world size;
//  - a rank whose world size differs from rank 0's stops every rank at once
//    with a message naming both;
//  - rank 0 waits for every rank's record, then tells the others that all
//    arrived; a rank that never comes is reported with those that did.
class Meeting {
 public:
  Meeting(c10d::Store& shared, c10d::Store& attempt, const World& world, std::string run_id, bool hosts_store,
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
                     "other job uses this MASTER_PORT."));
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

  [[noreturn]] void abort(const std::string& message) {
    try {
      store_.set(kAbort, bytes_of(message));
      if (!hosts_store_) store_.add(kAbortSeen, 1);
      linger_for_the_others();
    } catch (const c10::Error&) {
      // The others then fail at their own deadline.
    }
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
    DDP_CHECK(false, message, " (rank ", world_.rank, " stops too)");
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
      DDP_CHECK(Clock::now() < deadline_, "ddp: rank ", world_.rank, " reached the store at ", address_of(world_),
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
    std::vector<bool> seen(static_cast<size_t>(world_.world_size), false);
    seen[0] = true;
    int still_missing = world_.world_size - 1;
    while (true) {
      check_abort();
      for (int r = 1; r < world_.world_size; ++r) {
        if (seen[static_cast<size_t>(r)] || !store_.check({rank_key(r)})) continue;
        Arrival theirs = Arrival::decode(text_of(store_.get(rank_key(r))));
        if (theirs.world_size != world_.world_size) abort(world_size_mismatch(r, theirs));
        seen[static_cast<size_t>(r)] = true;
        --still_missing;
      }
      if (still_missing == 0) break;
      if (Clock::now() >= deadline_) {
        std::vector<int> arrived, missing;
        for (int r = 0; r < world_.world_size; ++r) (seen[static_cast<size_t>(r)] ? arrived : missing).push_back(r);
        abort(not_all_joined(arrived, missing));
      }
      sleep_a_little();
    }
    store_.set(kComplete, bytes_of("1"));
  }

  void check_against_rank_0() {
    while (!store_.check({rank_key(0)})) {
      check_abort();
      DDP_CHECK(Clock::now() < deadline_, "ddp: rank ", world_.rank, " waited ", seconds_text(timeout_), " at ",
                address_of(world_), " for rank 0 to join, but it did not. Check that rank 0 of this job is running.");
      sleep_a_little();
    }
    Arrival rank0 = Arrival::decode(text_of(store_.get(rank_key(0))));
    if (rank0.world_size != world_.world_size) abort(world_size_mismatch(0, rank0));
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
        DDP_CHECK(false, not_all_joined(arrived, missing));
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

// A backend's Work whose wait() reports Gloo's own exceptions (which are
// not c10::Errors, and would escape ProcessGroup::wait's message) as
// ddp::Errors carrying their text; everything else is the backend's.
class CheckedWork final : public c10d::Work {
 public:
  explicit CheckedWork(c10::intrusive_ptr<c10d::Work> inner)
      : Work(-1, inner->retrieveOpType()), inner_(std::move(inner)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    try {
      return inner_->wait(timeout);
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(e.what());
    }
  }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
};

// Wraps the backend so that a collective which fails as it starts (Gloo
// throws at once when a peer's connection is already gone: "Read error ...
// Connection reset by peer") gets ddp's usual message, naming the
// operation, the rank and the cause, like a failure found by wait().
class CheckedBackend final : public c10d::Backend {
 public:
  CheckedBackend(c10::intrusive_ptr<c10d::Backend> inner, const World& world, std::chrono::milliseconds timeout)
      : Backend(world.rank, world.world_size), inner_(std::move(inner)), timeout_(timeout) {}

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

#define DDP_CHECKED(name, operation, parameters, arguments)                                  \
  c10::intrusive_ptr<c10d::Work> name parameters override {                                 \
    return checked(operation, [&] { return inner_->name arguments; });                      \
  }
  DDP_CHECKED(broadcast, "broadcast", (std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o), (t, o))
  DDP_CHECKED(allreduce, "all_reduce", (std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o), (t, o))
  DDP_CHECKED(allreduce_sparse, "all_reduce", (std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o), (t, o))
  DDP_CHECKED(allreduce_coalesced, "all_reduce", (std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o),
              (t, o))
  DDP_CHECKED(reduce, "reduce", (std::vector<at::Tensor>& t, const c10d::ReduceOptions& o), (t, o))
  DDP_CHECKED(allgather, "all_gather",
              (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(_allgather_base, "all_gather", (at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(allgather_coalesced, "all_gather",
              (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(allgather_into_tensor_coalesced, "all_gather",
              (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(gather, "gather",
              (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::GatherOptions& o),
              (out, in, o))
  DDP_CHECKED(scatter, "scatter",
              (std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in, const c10d::ScatterOptions& o),
              (out, in, o))
  DDP_CHECKED(reduce_scatter, "reduce_scatter",
              (std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
               const c10d::ReduceScatterOptions& o),
              (out, in, o))
  DDP_CHECKED(_reduce_scatter_base, "reduce_scatter",
              (at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o), (out, in, o))
  DDP_CHECKED(reduce_scatter_tensor_coalesced, "reduce_scatter",
              (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::ReduceScatterOptions& o),
              (out, in, o))
  DDP_CHECKED(alltoall_base, "all_to_all",
              (at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits,
               const c10d::AllToAllOptions& o),
              (out, in, out_splits, in_splits, o))
  DDP_CHECKED(alltoall, "all_to_all",
              (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o), (out, in, o))
  DDP_CHECKED(send, "send", (std::vector<at::Tensor>& t, int to, int tag), (t, to, tag))
  DDP_CHECKED(recv, "recv", (std::vector<at::Tensor>& t, int from, int tag), (t, from, tag))
  DDP_CHECKED(recvAnysource, "recv", (std::vector<at::Tensor>& t, int tag), (t, tag))
  DDP_CHECKED(barrier, "barrier", (const c10d::BarrierOptions& o), (o))
#undef DDP_CHECKED

 private:
  template <typename Start>
  c10::intrusive_ptr<c10d::Work> checked(const char* operation, Start&& start) {
    try {
      return c10::make_intrusive<CheckedWork>(start());
    } catch (const Error&) {
      throw;  // already ddp's
    } catch (const c10::Error& e) {
      fail(operation, e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(operation, e.what());  // Gloo's own exceptions are not c10::Errors
    }
  }
  [[noreturn]] void fail(const char* operation, const std::string& cause) const {
    DDP_CHECK(false, "ddp: ", operation, " failed on rank ", getRank(), " of ", getSize(), " as it started (timeout ",
              seconds_text(timeout_), "); a peer may have died or stopped calling collectives. Cause: ", cause);
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::chrono::milliseconds timeout_;
};

// The GPU an NCCL rank uses: the one the caller chose, else its local
// rank's. Checked before rendezvous, so a missing GPU fails with its cause.
c10::Device nccl_device(const World& world, const c10::Device& requested) {
  DDP_CHECK(detail::nccl_available(), "ddp: this build of ddp has no NCCL support (no CUDA headers or nccl.h ",
              "were found when it was configured); use the gloo backend or rebuild with CUDA");
  int devices = visible_cuda_devices();
  DDP_CHECK(devices > 0, "ddp: the NCCL backend needs a CUDA device, but none is visible ",
              "(check CUDA_VISIBLE_DEVICES); use the gloo backend for CPU training");
  if (requested.is_cuda() && requested.has_index()) {
    DDP_CHECK(requested.index() < devices, "ddp: NCCL was asked to use ", requested.str(), " but only ", devices,
                " CUDA device(s) are visible");
    return requested;
  }
  return device_for_local_rank(world.local_rank, devices, DeviceOptions().kind(DeviceKind::kCuda));
}

}  // namespace

BackendKind resolve_backend(BackendKind backend, const c10::Device& device) {
  if (backend != BackendKind::kAuto) return backend;
  // The launcher's or the user's choice for programs that leave it to auto,
  // e.g. mpirun -x DDP_BACKEND=mpi ./train.
  if (const char* chosen = std::getenv("DDP_BACKEND"); chosen && *chosen) {
    BackendKind kind = parse_backend(chosen);
    if (kind != BackendKind::kAuto) return kind;
  }
  return device.is_cuda() ? BackendKind::kNccl : BackendKind::kGloo;
}

std::string default_run_id() {
  for (const char* name : {"DDP_RUN_ID", "TORCHELASTIC_RUN_ID"}) {
    if (const char* id = std::getenv(name)) {
      if (*id) return id;
    }
  }
  return "none";
}

bool mpi_available() { return detail::mpi_available(); }

BackendKind parse_backend(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "nccl") return BackendKind::kNccl;
  if (name == "mpi") return BackendKind::kMpi;
  DDP_CHECK(false, "ddp: unknown backend '", name, "'; use auto, gloo, nccl or mpi");
}

std::string to_string(BackendKind backend) {
  switch (backend) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
    case BackendKind::kMpi: return "mpi";
  }
  return "?";
}

std::chrono::milliseconds default_timeout() {
  if (const char* text = std::getenv("DDP_TIMEOUT_SECONDS")) {
    char* end = nullptr;
    double seconds = std::strtod(text, &end);
    DDP_CHECK(end != text && *end == '\0' && seconds >= 0.001 && seconds <= 1e9, "ddp: environment variable ",
                "DDP_TIMEOUT_SECONDS='", text, "' must be a number of seconds between 0.001 and 1e9");
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return std::chrono::minutes(30);
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const World& world, ProcessGroupOptions options) {
  DDP_CHECK(options.timeout().count() > 0, "ddp: the process group timeout must be positive");
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->world_ = world;
  group->options_ = options;
  BackendKind kind = resolve_backend(options.backend(), options.device());
  group->backend_kind_ = kind;
  // NCCL only moves tensors on its GPU, so small bookkeeping tensors live
  // there too; Gloo's live on the CPU.
  c10::Device device(c10::kCPU);
  if (kind == BackendKind::kNccl) device = nccl_device(world, options.device());
  group->control_options_ = at::TensorOptions().device(device);

  const std::chrono::milliseconds timeout = options.timeout();
  if (kind == BackendKind::kMpi) {
    // MPI's launcher already wired the ranks together: no TCPStore. The store
    // is this process's own; ddp's collectives never need a shared one.
    DDP_CHECK(device.is_cpu() && !options.device().is_cuda(), "ddp: the mpi backend moves CPU tensors; ",
              "use nccl for ", options.device().str());
    group->store_ = c10::make_intrusive<c10d::HashStore>();
    group->backend_ = detail::make_mpi_backend(group->world_, timeout);
    return group;
  }
  require_master(world);
  // Cuts the store's connection when a wait of c10d's outlives the
  // rendezvous deadline (see StoreGuard); unused for one process.
  std::optional<StoreGuard> guard;
  try {
    if (world.world_size == 1) {
      // One process: a private in-memory store; collectives are still real
      // (the backend runs them over a group of one), so code paths match.
      group->store_ = c10::make_intrusive<c10d::HashStore>();
    } else {
      // Rendezvous as a whole, not each of its waits, takes at most `timeout`.
      const Clock::time_point deadline = Clock::now() + timeout;
      const bool agent_store = env_true("TORCHELASTIC_USE_AGENT_STORE");
      guard.emplace(world.master_port);
      guard->arm(deadline + kGuardGrace, "an answer to the store's handshake");
      auto tcp = connect_store(world, agent_store, deadline, timeout, *guard);
      guard->arm(deadline + kGuardGrace, "the store's answers while the ranks met");
      // torchrun's store outlives a restart: each attempt keeps its own keys.
      auto attempt =
          c10::make_intrusive<c10d::PrefixStore>("ddp/attempt_" + std::to_string(restart_count()), tcp);
      Meeting(*tcp, *attempt, world, options.run_id(), world.rank == 0 && !agent_store, deadline, timeout).run();
      tcp->setTimeout(timeout);  // later uses of the store get the full timeout each
      // Every key of this job lives under its run id, so even a foreign
      // process that got past the check could not touch them.
      group->store_ = c10::make_intrusive<c10d::PrefixStore>("run/" + options.run_id(), attempt);
      guard->arm(Clock::now() + timeout + kGuardGrace, "the store's answers while the backend connected");
    }
    auto backend_store = c10::make_intrusive<c10d::PrefixStore>("ddp/backend", group->store_);
    group->backend_ = c10::make_intrusive<CheckedBackend>(
        kind == BackendKind::kNccl ? detail::make_nccl_backend(backend_store, world, device, timeout)
                                   : detail::make_gloo_backend(backend_store, world, timeout),
        world, timeout);
  } catch (const c10::Error& e) {
    if (!guard || !guard->expired() || dynamic_cast<const Error*>(&e) != nullptr) throw;
    throw_store_did_not_answer(world, timeout, *guard, e);
  }
  if (guard) guard->disarm();
  if (world.world_size > 1) group->start_progress_responder();
  install_stack_dump_handler(SIGUSR1);
  detail::install_transport_failure_handler();
  detail::register_trace_for_dumps(group.get(), group->trace_.get(), world.rank);
  return group;
}

ProcessGroup::ProcessGroup() : trace_(std::make_shared<CollectiveTrace>()) {
  // DDP_TRACE=off exists to measure what the trace costs (bench/RESULTS.md).
  const char* trace = std::getenv("DDP_TRACE");
  tracing_ = !(trace && std::string(trace) == "off");
}

ProcessGroup::~ProcessGroup() {
  detail::unregister_trace_for_dumps(this);
  try {
    shutdown();
  } catch (...) {
    // A destructor must not throw; shutdown errors were already reported.
  }
}

std::string ProcessGroup::unique_store_prefix(const std::string& purpose) {
  return "ddp/" + purpose + "/" + std::to_string(store_prefixes_issued_++) + "/";
}

void ProcessGroup::shutdown() {
  responder_.reset();  // joins its thread before the store goes
  {
    // The rings talk through backend_: stop them first.
    std::lock_guard<std::mutex> lock(rings_mutex_);
    reduce_scatter_ring_.reset();
    all_gather_ring_.reset();
  }
  backend_.reset();
  store_.reset();
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* operation) const {
  try {
    if (backend_kind_ == BackendKind::kNccl) {
      // NCCL's wait() with a timeout spins the host until the GPU is done;
      // without one it only makes the current stream wait on the
      // collective's event. The communicator's watchdog already enforces
      // options_.timeout() (set in make_nccl_backend).
      work->wait();
    } else {
      work->wait(options_.timeout());
    }
  } catch (const c10::Error& e) {
    const std::string stall = explain_stall(e.what_without_backtrace());
    DDP_CHECK(false, "ddp: ", operation, " failed on rank ", world_.rank, " of ",
                world_.world_size, " (timeout ", seconds_text(options_.timeout()),
                "); a peer may have died or stopped calling collectives. ", stall, stall.empty() ? "" : " ",
                "Cause: ", e.what_without_backtrace());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_reduce_async(at::Tensor& tensor, c10d::ReduceOp op) {
  DDP_CHECK(backend_, "ddp: all_reduce on a process group that was shut down");
  const uint64_t seq = enter("all_reduce", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.timeout = options_.timeout();
  return track(seq, backend_->allreduce(tensors, opts));
}

void ProcessGroup::all_reduce(at::Tensor& tensor, c10d::ReduceOp op) {
  wait(all_reduce_async(tensor, op), "all_reduce");
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  DDP_CHECK(backend_, "ddp: broadcast on a process group that was shut down");
  const uint64_t seq = enter("broadcast", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = options_.timeout();
  wait(track(seq, backend_->broadcast(tensors, opts)), "broadcast");
}

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& tensor) {
  DDP_CHECK(backend_, "ddp: all_gather on a process group that was shut down");
  std::vector<at::Tensor> inputs{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  const uint64_t seq = enter("all_gather", inputs[0]);
  wait(track(seq, backend_->allgather(outputs, inputs, opts)), "all_gather");
  return outputs[0];
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_gather_into_async(at::Tensor& output, at::Tensor& input) {
  DDP_CHECK(backend_, "ddp: all_gather on a process group that was shut down");
  DDP_CHECK(output.numel() == input.numel() * size(), "ddp: all_gather_into needs an output of ", size(),
              " x ", input.numel(), " elements, got ", output.numel());
  const uint64_t seq = enter("all_gather_into", input);
  if (uses_rings(output) && output.is_contiguous() && input.is_contiguous()) {
    return track(seq, ring_all_gather(output, input));
  }
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  return track(seq, backend_->_allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::reduce_scatter_async(at::Tensor& output, at::Tensor& input,
                                                                  c10d::ReduceOp op) {
  DDP_CHECK(backend_, "ddp: reduce_scatter on a process group that was shut down");
  DDP_CHECK(input.numel() == output.numel() * size(), "ddp: reduce_scatter needs an input of ", size(),
              " x ", output.numel(), " elements, got ", input.numel());
  const uint64_t seq = enter("reduce_scatter", input);
  if (uses_rings(input) && op == c10d::ReduceOp::SUM && output.is_contiguous() && input.is_contiguous()) {
    return track(seq, ring_reduce_scatter(output, input));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  opts.timeout = options_.timeout();
  return track(seq, backend_->_reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::send_async(at::Tensor& tensor, int to, int tag) {
  DDP_CHECK(backend_, "ddp: send on a process group that was shut down");
  const uint64_t seq = enter("send", tensor);
  std::vector<at::Tensor> tensors{tensor};
  return track(seq, backend_->send(tensors, to, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::recv_async(at::Tensor& tensor, int from, int tag) {
  DDP_CHECK(backend_, "ddp: recv on a process group that was shut down");
  const uint64_t seq = enter("recv", tensor);
  std::vector<at::Tensor> tensors{tensor};
  return track(seq, backend_->recv(tensors, from, tag));
}

void ProcessGroup::barrier() {
  DDP_CHECK(backend_, "ddp: barrier on a process group that was shut down");
  const uint64_t seq = enter("barrier", at::Tensor());
  c10d::BarrierOptions opts;
  opts.timeout = options_.timeout();
  wait(track(seq, backend_->barrier(opts)), "barrier");
}


// ---------------------------------------------------------------------------
// The collective trace, the desync check and the stall explanation.

DebugLevel default_debug_level() {
  for (const char* name : {"DDP_DEBUG", "TORCH_DISTRIBUTED_DEBUG"}) {
    if (const char* text = std::getenv(name); text && *text) {
      std::string value(text);
      std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
      if (value == "detail") return DebugLevel::kDetail;
      if (value == "off" || value == "info" || value == "0") return DebugLevel::kOff;
      DDP_CHECK(false, "ddp: ", name, "='", text, "' must be 'detail' or 'off'");
    }
  }
  return DebugLevel::kOff;
}

namespace detail {

struct ProgressResponder {
  std::atomic<bool> stop{false};
  std::thread thread;
  ~ProgressResponder() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
};

}  // namespace detail

namespace {

constexpr const char* kStallRequestKey = "ddp/trace/request";
std::string progress_key(int rank) { return "ddp/trace/progress/" + std::to_string(rank); }

// "<entered> <completed>\n<first unfinished>\n<last completed>"
std::string progress_of(const CollectiveTrace& trace) {
  const uint64_t entered = trace.last_entered();
  const uint64_t completed = trace.last_completed();
  auto pending = trace.find(completed + 1);
  auto done = trace.find(completed);
  return std::to_string(entered) + " " + std::to_string(completed) + "\n" + (pending ? describe(*pending) : "") +
         "\n" + (done ? describe(*done) : (completed ? "#" + std::to_string(completed) : "none"));
}

struct Progress {
  uint64_t entered = 0;
  uint64_t completed = 0;
  std::string pending;
  std::string last_completed;
};

Progress parse_progress(const std::string& text) {
  Progress p;
  std::istringstream in(text);
  in >> p.entered >> p.completed;
  std::string line;
  std::getline(in, line);
  std::getline(in, p.pending);
  std::getline(in, p.last_completed);
  return p;
}

std::string trace_file_in(const std::string& dir, int rank) {
  return dir.empty() ? "" : dir + "/trace_rank" + std::to_string(rank) + ".jsonl";
}

bool write_text(const std::string& path, const std::string& text) {
  if (path.empty()) return false;
  std::ofstream out(path, std::ios::trunc);
  out << text;
  return static_cast<bool>(out);
}

}  // namespace

uint64_t ProcessGroup::enter(const char* op, const at::Tensor& tensor) {
  if (!tracing_) return 0;
  const uint64_t seq = trace_->begin(op, tensor);
  const bool collective = std::strcmp(op, "send") != 0 && std::strcmp(op, "recv") != 0;
  if (collective && options_.debug() == DebugLevel::kDetail && world_.world_size > 1) {
    try {
      check_in_sync(seq, op, tensor);
    } catch (...) {
      trace_->end(seq, false);
      throw;
    }
  }
  return seq;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::track(uint64_t seq, c10::intrusive_ptr<c10d::Work> work) {
  if (seq == 0) return work;
  std::shared_ptr<CollectiveTrace> trace = trace_;
  try {
    work->getFuture()->addCallback([trace, seq](c10::ivalue::Future& done) { trace->end(seq, !done.hasError()); });
  } catch (const std::exception&) {
    // A backend's work without a future: its end stays unknown in the trace.
  }
  return work;
}

void ProcessGroup::check_in_sync(uint64_t seq, const char* op, const at::Tensor& tensor) {
  std::ostringstream fingerprint;
  fingerprint << op;
  if (tensor.defined()) fingerprint << " " << tensor.scalar_type() << " " << tensor.sizes();
  const std::string& tag = CollectiveTag::current();
  if (!tag.empty()) fingerprint << " tag '" << tag << "'";
  constexpr int64_t kBytes = 256;
  const std::string mine = fingerprint.str().substr(0, kBytes - 1);
  at::Tensor bytes = at::zeros({kBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> inputs{to_control(bytes)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  // Straight to the backend: the check is not a collective of the program's.
  wait(backend_->allgather(outputs, inputs, opts), "the desync check's all_gather (DDP_DEBUG=detail)");
  std::vector<std::string> all;
  for (auto& t : outputs[0]) {
    at::Tensor cpu = t.cpu();
    all.emplace_back(static_cast<const char*>(cpu.data_ptr()));
  }
  for (int r = 1; r < size(); ++r) {
    DDP_CHECK(all[r] == all[0], "ddp: the ranks are out of step at collective #", seq, ": rank 0 issued ", all[0],
              " but rank ", r, " issued ", all[r],
              ". Every rank must call the same collectives in the same order (DDP_DEBUG=detail found this before "
              "the mismatched collective could hang or mix buffers).");
  }
}

std::string ProcessGroup::trace_path() const {
  std::string dir;
  if (const char* d = std::getenv("DDP_TRACE_DIR"); d && *d) {
    dir = d;
  } else if (const char* d2 = std::getenv("DDP_LOG_DIR"); d2 && *d2) {
    dir = d2;
  } else {
    dir = trace_fallback_directory();
  }
  return trace_file_in(dir, world_.rank);
}

std::string ProcessGroup::write_trace() const {
  const std::string path = trace_path();
  return write_text(path, trace_->json_lines(world_.rank)) ? path : "";
}

void ProcessGroup::start_progress_responder() {
  if (!store_ || backend_kind_ == BackendKind::kMpi) return;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = store_->clone();  // its own connection: its polls never hold up the group's requests
  } catch (const std::exception&) {
    return;  // a store that cannot be cloned: stalls are explained by the failing ranks alone
  }
  responder_ = std::make_shared<detail::ProgressResponder>();
  auto* state = responder_.get();
  std::shared_ptr<CollectiveTrace> trace = trace_;
  const int rank = world_.rank;
  const std::string path = trace_path();
  const auto timeout = options_.timeout();
  state->thread = std::thread([state, store, trace, rank, path, timeout] {
    uint64_t dumped_for = 0;
    while (!state->stop) {
      // A collective waiting half its timeout: show every thread's stack
      // once, while there is still time to look at the live process.
      const uint64_t pending = trace->last_completed() + 1;
      if (pending <= trace->last_entered() && pending != dumped_for) {
        if (auto record = trace->find(pending); record && record->state == CollectiveRecord::State::kQueued) {
          const auto now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count();
          const auto waited = std::chrono::nanoseconds(now_ns - record->queued_ns);
          if (waited > timeout / 2 && timeout >= std::chrono::seconds(2)) {
            dumped_for = pending;
            dump_stacks("rank " + std::to_string(rank) + "'s collective " + describe(*record) + " has waited " +
                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()) +
                        " ms, half its timeout");
          }
        }
      }
      bool asked = false;
      try {
        asked = store->check({kStallRequestKey});
      } catch (const std::exception&) {
        // The store is gone (rank 0 ended): nobody is left to ask.
        return;
      }
      if (asked) {
        try {
          const std::string text = progress_of(*trace);
          store->set(progress_key(rank), std::vector<uint8_t>(text.begin(), text.end()));
        } catch (const std::exception&) {
        }
        write_text(path, trace->json_lines(rank));
        return;
      }
      for (int i = 0; i < 4 && !state->stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
}

std::string ProcessGroup::explain_stall(const std::string& cause) const {
  try {
    const std::string written = write_trace();
    const std::string wrote = written.empty() ? "" : " This rank's trace: " + written + ".";
    if (world_.world_size == 1 || !store_ || backend_kind_ == BackendKind::kMpi) return wrote.substr(wrote.empty() ? 0 : 1);
    const uint64_t completed = trace_->last_completed();
    const uint64_t failed = completed + 1;
    auto record = trace_->find(failed);
    const std::string what = record ? describe(*record) : "#" + std::to_string(failed);
    // A peer whose connection closed is gone: waiting for its answer would
    // only delay this message (and the launcher may stop this rank first).
    for (const char* gone : {"onnection reset", "onnection closed", "roken pipe", "EOF"}) {
      if (cause.find(gone) != std::string::npos) {
        return "This rank is in collective " + what + "; a peer closed its connection (it died or left)." + wrote;
      }
    }

    const std::string mine = progress_of(*trace_);
    store_->set(progress_key(world_.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    store_->set(kStallRequestKey, std::vector<uint8_t>{'1'});
    // The others answer within about 0.2 s (their responders poll).
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.timeout(), std::chrono::seconds(2));
    std::vector<int> waiting;
    for (int r = 0; r < world_.world_size; ++r) {
      if (r != world_.rank) waiting.push_back(r);
    }
    std::vector<std::optional<Progress>> reports(world_.world_size);
    while (!waiting.empty() && Clock::now() < deadline) {
      std::vector<int> still;
      for (int r : waiting) {
        if (store_->check({progress_key(r)})) {
          auto bytes = store_->get(progress_key(r));
          reports[r] = parse_progress(std::string(bytes.begin(), bytes.end()));
        } else {
          still.push_back(r);
        }
      }
      waiting.swap(still);
      if (!waiting.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }

    std::vector<std::string> findings;
    for (int r = 0; r < world_.world_size; ++r) {
      if (r == world_.rank) continue;
      if (!reports[r]) {
        findings.push_back("rank " + std::to_string(r) +
                           " did not report its progress within 2 s: it is stopped, hung outside ddp, or dead");
        continue;
      }
      const Progress& p = *reports[r];
      if (p.entered < failed) {
        std::string last = p.completed == completed ? describe_or_number(completed) : p.last_completed;
        findings.push_back("rank " + std::to_string(r) + " never entered collective " + what +
                           "; its last completed collective is " + last);
      } else if (p.completed < failed && !p.pending.empty() && record && p.pending != describe(*record)) {
        findings.push_back("rank " + std::to_string(r) + " is in " + p.pending + " while this rank is in " + what +
                           ": the ranks issued different collectives (DDP_DEBUG=detail stops at the first difference)");
      }
    }
    std::string text = "This rank is in collective " + what + ".";
    for (const auto& f : findings) text += " " + f + ".";
    if (findings.empty()) text += " Every other rank reported entering it too.";
    return text + wrote;
  } catch (const std::exception& e) {
    return std::string("(the ranks' progress could not be compared: ") + e.what() + ")";
  }
}

std::string ProcessGroup::describe_or_number(uint64_t seq) const {
  auto record = trace_->find(seq);
  return record ? describe(*record) : "#" + std::to_string(seq);
}

std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options) {
  return ProcessGroup::create(world_from_env(), options);
}

}  // namespace ddp
