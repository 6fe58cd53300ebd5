// The shared-memory backend: collectives between ranks of one host through
// one memory segment, instead of Gloo's TCP loopback.
//
// Segment: rank 0 makes it with memfd_create, so it has no name anywhere
// (nothing is left in /dev/shm after any exit, SIGKILL included). The others
// open it through /proc/<rank 0's pid>/fd/<fd>, which the store tells them
// (ranks of one host, one pid namespace: the host identity checks both); once
// every rank has mapped it, all close their descriptors and the memory lives
// exactly as long as the last mapping.
//
// Layout: a header, one control line per rank (its phase counter, the futex
// word peers sleep on, and its pid), then two sets of one slot per rank.
// Every step of a collective is a "chunk": each rank writes into its slot of
// set (chunk % 2), bumps its phase counter, waits until every rank's counter
// has reached the same phase, then reads what it needs from the others'
// slots. A rank only writes set s again two chunks later, after every rank
// has arrived at the chunk in between, i.e. has finished reading set s: the
// two sets make one synchronisation per chunk enough. Large all-reduces take
// a second phase per chunk (each rank reduces 1/N of the chunk, then all copy
// the reduced slices): twice the synchronisation, N times less arithmetic.
//
// Waiting: spin briefly, then yield for up to 1 ms, then sleep on the
// peer's phase word with FUTEX_WAIT (a writer wakes only when someone sleeps
// there). While asleep a waiter wakes every 100 ms to look at the peers it
// waits for: a pid that is gone, a zombie, or a stopped process (state T)
// ends the collective with an error naming that rank, so a dead or stopped
// peer is noticed within a fraction of a second instead of at the
// collective timeout, which still bounds everything else.
//
// Execution: collectives run one at a time, in the order issued. An
// asynchronous one (c10d's asyncOp, the default: DDP's buckets) goes to a
// thread of the backend's own whatever its size, so that it overlaps
// backward as over Gloo; one issued with asyncOp false runs on the caller's
// thread when nothing is queued. A thread that waits for a collective its
// worker has not yet taken runs it (and those queued before it) itself.
// What this backend does not implement (point-to-point, gather, scatter,
// all-to-all, reductions other than sum/product/min/max, dtypes it does not
// know) goes to a Gloo backend over the same ranks.
#include <ddp/error.h>

#include "comm/backends.h"
#include "comm/threaded_work.h"
#include "launch/env_impl.h"

#include <ATen/Functions.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ddp::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x64647073686d3031ull;  // "ddpshm01"
constexpr size_t kLine = 64;
// The descriptor each rank writes with a collective's first chunk, so that
// ranks which issued different collectives fail at once instead of mixing.
constexpr size_t kDescBytes = kLine;

struct alignas(kLine) Control {
  std::atomic<uint32_t> phase;     // futex word: the last phase this rank arrived at
  std::atomic<uint32_t> sleepers;  // ranks asleep on `phase`
  int32_t pid;
  std::atomic<uint32_t> left;  // 1 once this rank's backend is gone
};
static_assert(sizeof(Control) == kLine, "one cache line per rank");

struct Header {
  uint64_t magic;
  uint64_t nonce;
  int32_t size;
  int32_t pad;
  uint64_t slot_bytes;
};

struct Desc {
  uint32_t kind;  // Kind
  uint32_t dtype;
  uint64_t numel;
  int32_t root;
  int32_t op;
  bool operator==(const Desc& o) const {
    return kind == o.kind && dtype == o.dtype && numel == o.numel && root == o.root && op == o.op;
  }
};
static_assert(sizeof(Desc) <= kDescBytes, "a descriptor fits its line");

enum Kind : uint32_t { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kBarrier, kReduce };

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case kAllReduce: return "all_reduce";
    case kBroadcast: return "broadcast";
    case kAllGather: return "all_gather";
    case kReduceScatter: return "reduce_scatter";
    case kBarrier: return "barrier";
    case kReduce: return "reduce";
  }
  return "collective";
}

size_t env_bytes(const char* name, size_t fallback, size_t low, size_t high) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  const int64_t value = parse_int_env(name, text);
  DDP_CHECK(value >= static_cast<int64_t>(low) && value <= static_cast<int64_t>(high), "ddp: ", name, "='", text,
            "' must be between ", low, " and ", high);
  return static_cast<size_t>(value);
}

// Each slot: 1 MiB by default (a 40 MB all-reduce goes through in 40 chunks;
// a chunk of every rank stays in the caches). DDP_SHM_SLOT_BYTES overrides.
size_t slot_bytes_setting() {
  size_t bytes = env_bytes("DDP_SHM_SLOT_BYTES", size_t{1} << 20, 4096, size_t{1} << 30);
  return (bytes + kLine - 1) / kLine * kLine;
}

// All-reduces up to this size take one phase (every rank reduces the whole
// chunk itself) instead of two.
size_t one_phase_bytes_setting() { return env_bytes("DDP_SHM_ONE_PHASE_BYTES", 32 * 1024, 0, size_t{1} << 30); }

int futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return static_cast<int>(syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// 'R', 'S', 'T', 'Z', ... from /proc/<pid>/stat, or 0 when the process is gone.
char process_state(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[512];
  ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  text[n] = 0;
  const char* paren = std::strrchr(text, ')');
  return paren && paren[1] == ' ' ? paren[2] : '?';
}

// ---- Reduction kernels ------------------------------------------------------
//
// Plain loops over contiguous arrays, which the compiler vectorises (O3 on
// these functions only). Sources are summed in rank order, so every rank
// that reduces the same elements gets the same bits. Half and bfloat16
// accumulate in float.

struct Sum {
  template <typename A>
  A operator()(A a, A b) const { return a + b; }
};
struct Prod {
  template <typename A>
  A operator()(A a, A b) const { return a * b; }
};
struct Min {
  template <typename A>
  A operator()(A a, A b) const { return b < a ? b : a; }
};
struct Max {
  template <typename A>
  A operator()(A a, A b) const { return a < b ? b : a; }
};

template <typename T>
struct AccOf { using type = T; };
template <>
struct AccOf<c10::Half> { using type = float; };
template <>
struct AccOf<c10::BFloat16> { using type = float; };
template <>
struct AccOf<bool> { using type = int; };

#pragma GCC push_options
#pragma GCC optimize("O3")

template <typename T, typename Op, int N>
void reduce_fixed(T* __restrict out, const T* const* src, size_t count, Op op) {
  using A = typename AccOf<T>::type;
  const T* __restrict s[N];
  for (int k = 0; k < N; ++k) s[k] = src[k];
  for (size_t i = 0; i < count; ++i) {
    A a = static_cast<A>(s[0][i]);
#pragma GCC unroll 8
    for (int k = 1; k < N; ++k) a = op(a, static_cast<A>(s[k][i]));
    out[i] = static_cast<T>(a);
  }
}

template <typename T, typename Op>
void reduce_any(T* __restrict out, const T* const* src, int n, size_t count, Op op) {
  switch (n) {
    case 1: std::memcpy(out, src[0], count * sizeof(T)); return;
    case 2: reduce_fixed<T, Op, 2>(out, src, count, op); return;
    case 3: reduce_fixed<T, Op, 3>(out, src, count, op); return;
    case 4: reduce_fixed<T, Op, 4>(out, src, count, op); return;
    case 5: reduce_fixed<T, Op, 5>(out, src, count, op); return;
    case 6: reduce_fixed<T, Op, 6>(out, src, count, op); return;
    case 7: reduce_fixed<T, Op, 7>(out, src, count, op); return;
    case 8: reduce_fixed<T, Op, 8>(out, src, count, op); return;
    default: break;
  }
  // More ranks: eight at a time into `out`, in rank order.
  reduce_fixed<T, Op, 8>(out, src, count, op);
  for (int k = 8; k < n; ++k) {
    const T* pair[2] = {out, src[k]};
    reduce_fixed<T, Op, 2>(out, pair, count, op);
  }
}

#pragma GCC pop_options

template <typename T>
void reduce_typed(void* out, const void* const* src, int n, size_t count, c10d::ReduceOp::RedOpType op) {
  auto* o = static_cast<T*>(out);
  auto s = reinterpret_cast<const T* const*>(src);
  switch (op) {
    case c10d::ReduceOp::SUM: reduce_any(o, s, n, count, Sum()); return;
    case c10d::ReduceOp::PRODUCT: reduce_any(o, s, n, count, Prod()); return;
    case c10d::ReduceOp::MIN: reduce_any(o, s, n, count, Min()); return;
    case c10d::ReduceOp::MAX: reduce_any(o, s, n, count, Max()); return;
    default: break;
  }
  DDP_CHECK(false, "ddp: the shared-memory backend cannot reduce with op ", static_cast<int>(op));
}

using ReduceFn = void (*)(void*, const void* const*, int, size_t, c10d::ReduceOp::RedOpType);

// The kernel for `dtype`, or null for a dtype this backend leaves to Gloo.
ReduceFn reduce_fn(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return reduce_typed<float>;
    case at::kDouble: return reduce_typed<double>;
    case at::kHalf: return reduce_typed<c10::Half>;
    case at::kBFloat16: return reduce_typed<c10::BFloat16>;
    case at::kLong: return reduce_typed<int64_t>;
    case at::kInt: return reduce_typed<int32_t>;
    case at::kShort: return reduce_typed<int16_t>;
    case at::kChar: return reduce_typed<int8_t>;
    case at::kByte: return reduce_typed<uint8_t>;
    case at::kBool: return reduce_typed<bool>;
    default: return nullptr;
  }
}

bool reducible(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX: return true;
    default: return false;
  }
}

// ---- Execution ------------------------------------------------------------------

// The backend's collectives, run one at a time in the order issued: by its
// worker thread (serve), or by a thread that waits for one still queued
// (run_through). Shared with the Work handles, which may outlive the backend.
class JobQueue {
 public:
  using Job = std::function<void()>;

  // Runs `job` on this thread if nothing is queued or running; false if it
  // has to queue.
  bool run_now_if_idle(const Job& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!queue_.empty() || busy_) return false;
    busy_ = true;
    lock.unlock();
    job();
    lock.lock();
    busy_ = false;
    if (!queue_.empty()) cv_.notify_all();
    return true;
  }

  void push(const void* tag, Job job) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(tag, std::move(job));
    cv_.notify_all();
  }

  // Runs the queued jobs up to and including `tag`'s on this thread, in
  // order, unless another thread is running one or `tag`'s is not queued
  // (taken already): then the caller waits for its Work as usual.
  void run_through(const void* tag) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (busy_ || std::none_of(queue_.begin(), queue_.end(), [&](const auto& q) { return q.first == tag; })) return;
    busy_ = true;
    bool last = false;
    while (!last) {
      auto [which, job] = std::move(queue_.front());
      queue_.pop_front();
      last = which == tag;
      lock.unlock();
      job();
      lock.lock();
    }
    busy_ = false;
    cv_.notify_all();
  }

  // The worker thread's loop, until stop() and nothing is left.
  void serve() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return (!queue_.empty() && !busy_) || (stopping_ && queue_.empty()); });
      if (queue_.empty()) return;
      Job job = std::move(queue_.front().second);
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    cv_.notify_all();
  }

  // Until no thread runs a job and none is queued.
  void wait_idle() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<const void*, Job>> queue_;
  bool busy_ = false;  // a thread is running a job
  bool stopping_ = false;
};

// ---- Work ---------------------------------------------------------------------

// A collective's handle, finished here or on the backend's thread.
class ShmWork final : public ThreadedWork {
 public:
  ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::weak_ptr<JobQueue> jobs)
      : ThreadedWork(rank, type, std::move(outputs)), jobs_(std::move(jobs)) {}

 protected:
  void run_if_queued() override {
    if (auto jobs = jobs_.lock()) jobs->run_through(this);
  }

  [[noreturn]] void throw_overrun(std::chrono::milliseconds timeout) const override {
    // ProcessGroup's wait reads "timed out" as "still running".
    DDP_PEER_CHECK(false, "ddp: a shared-memory ", opTypeToString(opType_), " timed out after ", timeout.count(),
                   " ms of waiting");
    std::abort();  // not reached
  }

 private:
  std::weak_ptr<JobQueue> jobs_;
};

// ---- The segment ----------------------------------------------------------------

class Segment {
 public:
  Segment(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), slot_bytes_(slot_bytes_setting()) {
    const size_t controls = (sizeof(Header) + kLine - 1) / kLine * kLine + size_t(size) * kLine;
    slots_offset_ = controls;
    bytes_ = controls + 2 * size_t(size) * (kDescBytes + slot_bytes_);
    int fd = -1;
    if (rank == 0) {
      fd = static_cast<int>(syscall(SYS_memfd_create, "ddp-shm", MFD_CLOEXEC));
      DDP_CHECK(fd >= 0, "ddp: memfd_create failed for the shared-memory backend: ", std::strerror(errno),
                "; set DDP_SHM=0 to use Gloo");
      if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
        const int err = errno;
        ::close(fd);
        DDP_CHECK(false, "ddp: cannot size a ", bytes_, "-byte shared-memory segment: ", std::strerror(err),
                  "; set DDP_SHM=0 to use Gloo, or DDP_SHM_SLOT_BYTES to use less");
      }
      map(fd);
      std::random_device random;
      const uint64_t nonce = (uint64_t(random()) << 32) ^ random() ^ uint64_t(::getpid());
      header()->magic = kMagic;
      header()->nonce = nonce;
      header()->size = size;
      header()->slot_bytes = slot_bytes_;
      const std::string where = std::to_string(::getpid()) + " " + std::to_string(fd) + " " +
                                std::to_string(nonce) + " " + std::to_string(bytes_);
      store->set("segment", std::vector<uint8_t>(where.begin(), where.end()));
    } else {
      store->wait({"segment"}, timeout);
      const std::vector<uint8_t> bytes = store->get("segment");
      std::istringstream where(std::string(bytes.begin(), bytes.end()));
      int pid = 0, their_fd = -1;
      uint64_t nonce = 0, size_bytes = 0;
      where >> pid >> their_fd >> nonce >> size_bytes;
      DDP_CHECK(size_bytes == bytes_, "ddp: rank 0's shared-memory segment has ", size_bytes, " bytes but this rank ",
                "expects ", bytes_, "; every rank must run with the same DDP_SHM_SLOT_BYTES");
      const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(their_fd);
      fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      DDP_CHECK(fd >= 0, "ddp: cannot open rank 0's shared-memory segment (", path, "): ", std::strerror(errno),
                ". Ranks on one host must see each other's /proc (one pid namespace, one user); set DDP_SHM=0 ",
                "to use Gloo");
      map(fd);
      DDP_CHECK(header()->magic == kMagic && header()->nonce == nonce && header()->size == size,
                "ddp: ", path, " is not this group's shared-memory segment; set DDP_SHM=0 to use Gloo");
    }
    control(rank)->pid = ::getpid();
    // Everyone maps before anyone closes: rank 0's descriptor is how the
    // others find the segment.
    const int64_t mapped = store->add("mapped", 1);
    if (mapped == size) store->set("ready", std::vector<uint8_t>{1});
    try {
      store->wait({"ready"}, timeout);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    pids_.resize(size);
    for (int r = 0; r < size; ++r) pids_[r] = control(r)->pid;
  }
  ~Segment() {
    if (base_) ::munmap(base_, bytes_);
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  Control* control(int r) const {
    return reinterpret_cast<Control*>(base_ + (sizeof(Header) + kLine - 1) / kLine * kLine + size_t(r) * kLine);
  }
  Desc* desc(int set, int r) const {
    return reinterpret_cast<Desc*>(base_ + slots_offset_ + (size_t(set) * size_ + r) * (kDescBytes + slot_bytes_));
  }
  char* slot(int set, int r) const { return reinterpret_cast<char*>(desc(set, r)) + kDescBytes; }
  size_t slot_bytes() const { return slot_bytes_; }
  int pid(int r) const { return pids_[r]; }

 private:
  void map(int fd) {
    void* base = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      DDP_CHECK(false, "ddp: cannot map the shared-memory segment (", bytes_, " bytes): ", std::strerror(err),
                "; set DDP_SHM=0 to use Gloo");
    }
    base_ = static_cast<char*>(base);
  }

  int rank_;
  int size_;
  size_t slot_bytes_;
  size_t slots_offset_ = 0;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  std::vector<int> pids_;
};

// ---- The backend ------------------------------------------------------------------

class ShmBackend final : public c10d::Backend {
 public:
  ShmBackend(const c10::intrusive_ptr<c10d::Store>& store, const World& world, std::vector<int> global_ranks,
             std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> fallback)
      : Backend(world.rank, world.world_size),
        segment_(store, world.rank, world.world_size, timeout),
        global_ranks_(std::move(global_ranks)),
        timeout_(timeout),
        fallback_(std::move(fallback)),
        one_phase_bytes_(one_phase_bytes_setting()) {
    // Spinning only helps while every rank has a core to spin on; with
    // fewer cores than ranks, the rank waited for needs the core back. Even
    // with enough cores, a busy host may put two ranks on one core: 50 us of
    // spinning then made each 4 KB all-reduce's phase cost 50 us (measured,
    // 2 ranks, 2 cores, load 3); the yielding below costs ~0.3 us a round.
    const unsigned cores = std::thread::hardware_concurrency();
    const bool crowded = cores > 0 && cores < static_cast<unsigned>(world.local_world_size);
    spin_ = std::chrono::microseconds(env_bytes("DDP_SHM_SPIN_US", crowded ? 2 : 5, 0, 1000000));
    // Then yield the core while still runnable: a peer that is only
    // descheduled (a busy host) comes back without a futex wake's latency,
    // and whoever else wants the core gets it. Then sleep.
    yield_ = std::chrono::microseconds(env_bytes("DDP_SHM_YIELD_US", 1000, 0, 10000000));
    // Asynchronous collectives up to this size may run on the caller's
    // thread when the worker is idle. 0 by default: such a collective would
    // not overlap what the caller does next (DDP's backward); the knob is
    // for measuring that (bench/PROFILE.md).
    inline_bytes_ = env_bytes("DDP_SHM_INLINE_BYTES", 0, 0, size_t{1} << 40);
    watch_peers();
  }

  ~ShmBackend() override {
    // As a closed Gloo connection: a peer still waiting for this rank learns
    // it left at once, not when the process ends (which its launcher may
    // outrun by stopping that peer first).
    Control* mine = segment_.control(getRank());
    mine->left.store(1, std::memory_order_seq_cst);
    futex(&mine->phase, FUTEX_WAKE, INT32_MAX, nullptr);
    jobs_->stop();
    abort_.store(true);
    if (thread_.joinable()) thread_.join();
    jobs_->wait_idle();  // a waiting thread may be running one
    if (watcher_.joinable()) {
      const uint64_t one = 1;
      (void)!::write(stop_fd_, &one, sizeof(one));
      watcher_.join();
    }
    for (int fd : pidfds_) {
      if (fd >= 0) ::close(fd);
    }
    if (stop_fd_ >= 0) ::close(stop_fd_);
  }

  const std::string getBackendName() const override { return "shm"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void abort() override { abort_.store(true); }
  void shutdown() override { abort_.store(true); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (tensors.size() != 1 || !movable(tensors[0]) || !reduce_fn(tensors[0].scalar_type()) ||
        !reducible(opts.reduceOp)) {
      return fallback_->allreduce(tensors, opts);
    }
    at::Tensor t = tensors[0];
    const auto op = opts.reduceOp.op_;
    return submit(c10d::OpType::ALLREDUCE, {t}, t.nbytes(), opts.asyncOp, [this, t, op] { all_reduce(t, op, -1); });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    if (tensors.size() != 1 || !movable(tensors[0]) || !reduce_fn(tensors[0].scalar_type()) ||
        !reducible(opts.reduceOp)) {
      return fallback_->reduce(tensors, opts);
    }
    at::Tensor t = tensors[0];
    const auto op = opts.reduceOp.op_;
    const int root = static_cast<int>(opts.rootRank);
    return submit(c10d::OpType::REDUCE, {t}, t.nbytes(), opts.asyncOp, [this, t, op, root] { all_reduce(t, op, root); });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (tensors.size() != 1 || !movable(tensors[0])) return fallback_->broadcast(tensors, opts);
    at::Tensor t = tensors[0];
    const int root = static_cast<int>(opts.rootRank);
    return submit(c10d::OpType::BROADCAST, {t}, t.nbytes(), opts.asyncOp, [this, t, root] { broadcast_(t, root); });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    if (!movable(input) || !movable(output) || output.scalar_type() != input.scalar_type() ||
        output.numel() != input.numel() * getSize()) {
      return fallback_->_allgather_base(output, input, opts);
    }
    at::Tensor in = input, out = output;
    return submit(c10d::OpType::_ALLGATHER_BASE, {out}, out.nbytes(), opts.asyncOp, [this, in, out] {
      const size_t part = in.nbytes();
      char* base = static_cast<char*>(out.data_ptr());
      all_gather(in, [base, part](int r) { return base + size_t(r) * part; });
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    bool ours = inputs.size() == 1 && outputs.size() == 1 && movable(inputs[0]) &&
                static_cast<int>(outputs[0].size()) == getSize();
    for (size_t r = 0; ours && r < outputs[0].size(); ++r) {
      const at::Tensor& o = outputs[0][r];
      ours = movable(o) && o.scalar_type() == inputs[0].scalar_type() && o.numel() == inputs[0].numel();
    }
    if (!ours) return fallback_->allgather(outputs, inputs, opts);
    at::Tensor in = inputs[0];
    std::vector<at::Tensor> outs = outputs[0];
    return submit(c10d::OpType::ALLGATHER, outs, in.nbytes() * outs.size(), opts.asyncOp, [this, in, outs] {
      all_gather(in, [&outs](int r) { return static_cast<char*>(outs[r].data_ptr()); });
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    if (!movable(input) || !movable(output) || output.scalar_type() != input.scalar_type() ||
        input.numel() != output.numel() * getSize() || !reduce_fn(input.scalar_type()) ||
        !reducible(opts.reduceOp)) {
      return fallback_->_reduce_scatter_base(output, input, opts);
    }
    at::Tensor in = input, out = output;
    const auto op = opts.reduceOp.op_;
    return submit(c10d::OpType::_REDUCE_SCATTER_BASE, {out}, in.nbytes(), opts.asyncOp,
                  [this, in, out, op] { reduce_scatter(in, out, op); });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return submit(c10d::OpType::BARRIER, {}, 0, opts.asyncOp, [this] {
      begin(Desc{kBarrier, 0, 0, -1, 0});
      arrive_and_wait(kBarrier, true);
    });
  }

  // What this backend leaves to Gloo.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& t,
                                                  const c10d::AllreduceOptions& o) override {
    return fallback_->allreduce_sparse(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    return fallback_->allreduce_coalesced(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override {
    return fallback_->allgather_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) override {
    return fallback_->allgather_into_tensor_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override {
    return fallback_->gather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    return fallback_->scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return fallback_->reduce_scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::ReduceScatterOptions& o) override {
    return fallback_->reduce_scatter_tensor_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    return fallback_->alltoall_base(out, in, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override {
    return fallback_->alltoall(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int to, int tag) override {
    return fallback_->send(t, to, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int from, int tag) override {
    return fallback_->recv(t, from, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return fallback_->recvAnysource(t, tag);
  }

 private:
  // CPU, dense and contiguous: bytes this backend can copy as they are.
  static bool movable(const at::Tensor& t) {
    return t.defined() && t.is_cpu() && t.layout() == c10::kStrided && t.is_contiguous() && !t.is_complex();
  }

  // ---- Execution ----

  // `async_op`: c10d's asyncOp, false when the caller waits at once.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> outputs, size_t bytes,
                                        bool async_op, std::function<void()> body) {
    auto work = c10::make_intrusive<ShmWork>(getRank(), type, std::move(outputs), jobs_);
    auto job = [work, body = std::move(body)]() mutable {
      std::exception_ptr error;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      // The tensors it holds (FSDP's full gradient) go before the waiter
      // learns it is done, not whenever this thread gets to drop the job.
      body = nullptr;
      work->finish(error);
    };
    if ((!async_op || bytes <= inline_bytes_) && jobs_->run_now_if_idle(job)) return work;
    jobs_->push(work.get(), std::move(job));
    std::call_once(thread_started_, [this] { thread_ = std::thread([jobs = jobs_] { jobs->serve(); }); });
    return work;
  }

  // ---- Peers that die ----

  // A pidfd per peer turns readable the moment that process exits: a
  // thread that polls them marks the peer dead and wakes this rank's
  // waiters, so a death is noticed as fast as Gloo notices a closed socket
  // (the launcher may stop this rank a few milliseconds later). Without
  // pidfds (kernels before 5.3) the waiters' 100 ms checks still find it.
  void watch_peers() {
    const int n = getSize();
    dead_ = std::make_unique<std::atomic<bool>[]>(n);
    pidfds_.assign(n, -1);
    bool any = false;
    for (int r = 0; r < n; ++r) {
      dead_[r].store(false);
      if (r == getRank()) continue;
      pidfds_[r] = static_cast<int>(syscall(SYS_pidfd_open, segment_.pid(r), 0));
      any = any || pidfds_[r] >= 0;
    }
    stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (!any || stop_fd_ < 0) return;
    watcher_ = std::thread([this, n] {
      std::vector<pollfd> fds(n + 1);
      for (int r = 0; r < n; ++r) fds[r] = pollfd{pidfds_[r], POLLIN, 0};
      fds[n] = pollfd{stop_fd_, POLLIN, 0};
      while (true) {
        if (::poll(fds.data(), fds.size(), -1) < 0) {
          if (errno == EINTR) continue;
          return;
        }
        if (fds[n].revents) return;
        for (int r = 0; r < n; ++r) {
          if (fds[r].fd >= 0 && fds[r].revents) {
            dead_[r].store(true);
            fds[r].fd = -1;  // poll ignores it from now on
          }
        }
        for (int r = 0; r < n; ++r) futex(&segment_.control(r)->phase, FUTEX_WAKE, INT32_MAX, nullptr);
      }
    });
  }

  // ---- Synchronisation ----

  // Starts a collective: fails at once after an earlier failure, and
  // leaves this rank's descriptor in the slot of the next chunk.
  void begin(const Desc& desc) {
    if (!failure_.empty()) {
      DDP_PEER_CHECK(false, "ddp: ", kind_name(desc.kind), " over shared memory on ", me(),
                     " cannot run: an earlier collective on this group failed (", failure_, ")");
    }
    desc_ = desc;
    deadline_ = Clock::now() + timeout_;
    first_ = true;
  }

  int set() const { return static_cast<int>(chunk_ & 1); }

  // This rank's slot in the current chunk's set, with its descriptor
  // written on the collective's first chunk.
  char* my_slot() {
    if (first_) *segment_.desc(set(), getRank()) = desc_;
    return segment_.slot(set(), getRank());
  }

  // Publishes this rank's arrival at the next phase and waits for every
  // other rank's. `ends_chunk` moves to the other set afterwards.
  void arrive_and_wait(uint32_t kind, bool ends_chunk) {
    if (first_) *segment_.desc(set(), getRank()) = desc_;
    const uint32_t target = ++phase_;
    Control* mine = segment_.control(getRank());
    mine->phase.store(target, std::memory_order_seq_cst);
    if (mine->sleepers.load(std::memory_order_seq_cst) != 0) {
      futex(&mine->phase, FUTEX_WAKE, INT32_MAX, nullptr);
    }
    for (int r = 0; r < getSize(); ++r) {
      if (r != getRank()) wait_for(r, target, kind);
    }
    if (first_) {
      first_ = false;
      for (int r = 0; r < getSize(); ++r) {
        const Desc theirs = *segment_.desc(set(), r);
        if (!(theirs == desc_)) {
          fail(c10::str("the ranks issued different collectives: ", me(), " issued ", describe(desc_), " but ",
                        label(r), " issued ", describe(theirs)));
        }
      }
    }
    if (ends_chunk) ++chunk_;
  }

  static bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

  void wait_for(int r, uint32_t target, uint32_t kind) {
    Control* theirs = segment_.control(r);
    if (reached(theirs->phase.load(std::memory_order_acquire), target)) return;
    const auto spin_until = Clock::now() + spin_;
    unsigned spins = 0;
    while (Clock::now() < spin_until) {
      for (int i = 0; i < 64; ++i) {
        if (reached(theirs->phase.load(std::memory_order_acquire), target)) return;
        cpu_relax();
      }
      if (dead_[r].load(std::memory_order_relaxed) || theirs->left.load(std::memory_order_relaxed)) break;
      if (++spins % 16 == 0 && spin_.count() < 20) std::this_thread::yield();
    }
    const auto yield_until = Clock::now() + yield_;
    while (Clock::now() < yield_until) {
      if (reached(theirs->phase.load(std::memory_order_acquire), target)) return;
      if (dead_[r].load(std::memory_order_relaxed) || theirs->left.load(std::memory_order_relaxed)) break;
      std::this_thread::yield();
    }
    // Asleep on its phase word, looking at the peer every 100 ms.
    auto next_check = Clock::now();
    while (true) {
      uint32_t seen = theirs->phase.load(std::memory_order_seq_cst);
      if (reached(seen, target)) return;
      if (theirs->left.load()) {
        fail(c10::str(kind_name(kind), " over shared memory: the shared-memory peer ", label(r), " (pid ",
                      segment_.pid(r), ") left (it shut down its process group, or is ending) while ", me(),
                      " waited for it"));
      }
      const auto now = Clock::now();
      if (now >= next_check || dead_[r].load()) {
        check_alive(r, kind);
        if (abort_.load()) fail(c10::str("the process group was shut down or aborted while ", me(), " waited for ",
                                         label(r)));
        if (now >= deadline_) {
          fail(c10::str("timed out after ", std::chrono::duration_cast<std::chrono::milliseconds>(timeout_).count(),
                        " ms on ", me(), " waiting for ", label(r), " (pid ", segment_.pid(r),
                        "), which is alive but has not reached this collective"));
        }
        next_check = now + std::chrono::milliseconds(100);
      }
      theirs->sleepers.fetch_add(1, std::memory_order_seq_cst);
      seen = theirs->phase.load(std::memory_order_seq_cst);
      if (!reached(seen, target)) {
        timespec wake{0, 100 * 1000 * 1000};
        futex(&theirs->phase, FUTEX_WAIT, seen, &wake);
      }
      theirs->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void check_alive(int r, uint32_t kind) {
    const int pid = segment_.pid(r);
    const char state = dead_[r].load() ? 0 : process_state(pid);
    // The words "shared-memory peer" tell explain_stall not to ask the
    // store about a peer that cannot answer.
    if (state == 0 || state == 'Z' || state == 'X') {
      fail(c10::str(kind_name(kind), " over shared memory: the shared-memory peer ", label(r), " (pid ", pid,
                    ") died while ", me(), " waited for it"));
    }
    if (state == 'T' || state == 't') {
      fail(c10::str(kind_name(kind), " over shared memory: the shared-memory peer ", label(r), " (pid ", pid,
                    ") is stopped (SIGSTOP or a debugger) while ", me(), " waits for it"));
    }
  }

  [[noreturn]] void fail(const std::string& what) {
    failure_ = what;
    DDP_PEER_CHECK(false, "ddp: ", what);
  }

  std::string label(int r) const {
    return "rank " + std::to_string(r < static_cast<int>(global_ranks_.size()) ? global_ranks_[r] : r);
  }
  std::string me() const { return label(getRank()) + " of " + std::to_string(getSize()); }
  static std::string describe(const Desc& d) {
    if (d.kind == 0) return "nothing yet";
    return c10::str(kind_name(d.kind), " (", d.numel, " elements of ",
                    c10::toString(static_cast<at::ScalarType>(d.dtype)), d.root >= 0 ? ", root " : "",
                    d.root >= 0 ? std::to_string(d.root) : std::string(), ")");
  }

  // ---- Collectives ----

  void all_reduce(const at::Tensor& t, c10d::ReduceOp::RedOpType op, int root) {
    const uint32_t kind = root < 0 ? kAllReduce : kReduce;
    begin(Desc{kind, static_cast<uint32_t>(t.scalar_type()), static_cast<uint64_t>(t.numel()), root,
               static_cast<int32_t>(op)});
    const ReduceFn fn = reduce_fn(t.scalar_type());
    const size_t elem = t.element_size();
    const size_t total = t.numel();
    char* data = static_cast<char*>(t.data_ptr());
    const int n = getSize(), me = getRank();
    const bool writes = root < 0 || root == me;
    std::vector<const void*> src(n);
    if (total * elem <= one_phase_bytes_ && total * elem <= segment_.slot_bytes()) {
      // One phase: every rank reduces everything, from the slots, in rank order.
      std::memcpy(my_slot(), data, total * elem);
      arrive_and_wait(kind, true);
      if (writes) {
        for (int r = 0; r < n; ++r) src[r] = segment_.slot(1 - set(), r);
        fn(data, src.data(), n, total, op);
      }
      return;
    }
    const size_t per_chunk = segment_.slot_bytes() / elem;
    // Slices of a chunk that each rank reduces: whole cache lines.
    const size_t align = std::max<size_t>(1, kLine / elem);
    for (size_t start = 0; start < total; start += per_chunk) {
      const size_t count = std::min(per_chunk, total - start);
      char* chunk = data + start * elem;
      const size_t slice = (count + n - 1) / n;
      const size_t per = (slice + align - 1) / align * align;
      auto bounds = [&](int r) {
        const size_t lo = std::min(count, size_t(r) * per);
        return std::make_pair(lo, std::min(count, lo + per));
      };
      auto [lo, hi] = bounds(me);
      // Only what the others reduce goes into the slot: this rank's own
      // slice is read from the tensor itself (a third less memory traffic).
      char* slot = my_slot();
      if (lo > 0) std::memcpy(slot, chunk, lo * elem);
      if (hi < count) std::memcpy(slot + hi * elem, chunk + hi * elem, (count - hi) * elem);
      arrive_and_wait(kind, false);
      if (hi > lo) {
        for (int r = 0; r < n; ++r) src[r] = r == me ? chunk + lo * elem : segment_.slot(set(), r) + lo * elem;
        // Into this rank's own slot, where the others copy it from, then
        // into the tensor while they do.
        char* reduced = segment_.slot(set(), me) + lo * elem;
        fn(reduced, src.data(), n, hi - lo, op);
        if (writes) std::memcpy(chunk + lo * elem, reduced, (hi - lo) * elem);
      }
      arrive_and_wait(kind, false);
      if (writes) {
        for (int r = 0; r < n; ++r) {
          auto [a, b] = bounds(r);
          if (b > a && r != me) std::memcpy(chunk + a * elem, segment_.slot(set(), r) + a * elem, (b - a) * elem);
        }
      }
      ++chunk_;
    }
  }

  void broadcast_(const at::Tensor& t, int root) {
    begin(Desc{kBroadcast, static_cast<uint32_t>(t.scalar_type()), static_cast<uint64_t>(t.numel()), root, 0});
    const size_t total = t.nbytes();
    char* data = static_cast<char*>(t.data_ptr());
    const size_t step = segment_.slot_bytes();
    size_t start = 0;
    do {
      const size_t count = std::min(step, total - start);
      char* slot = my_slot();
      if (getRank() == root) std::memcpy(slot, data + start, count);
      const int used = set();
      arrive_and_wait(kBroadcast, true);
      if (getRank() != root) std::memcpy(data + start, segment_.slot(used, root), count);
      start += count;
    } while (start < total);
  }

  template <typename Where>
  void all_gather(const at::Tensor& in, Where where) {
    begin(Desc{kAllGather, static_cast<uint32_t>(in.scalar_type()), static_cast<uint64_t>(in.numel()), -1, 0});
    const size_t total = in.nbytes();
    const char* data = static_cast<const char*>(in.data_ptr());
    const size_t step = segment_.slot_bytes();
    size_t start = 0;
    do {
      const size_t count = std::min(step, total - start);
      std::memcpy(my_slot(), data + start, count);
      const int used = set();
      arrive_and_wait(kAllGather, true);
      for (int r = 0; r < getSize(); ++r) std::memcpy(where(r) + start, segment_.slot(used, r), count);
      start += count;
    } while (start < total);
  }

  void reduce_scatter(const at::Tensor& in, const at::Tensor& out, c10d::ReduceOp::RedOpType op) {
    begin(Desc{kReduceScatter, static_cast<uint32_t>(in.scalar_type()), static_cast<uint64_t>(in.numel()), -1,
               static_cast<int32_t>(op)});
    const ReduceFn fn = reduce_fn(in.scalar_type());
    const int n = getSize(), me = getRank();
    const size_t elem = in.element_size();
    const size_t part = out.numel();
    const char* input = static_cast<const char*>(in.data_ptr());
    char* output = static_cast<char*>(out.data_ptr());
    // Each chunk holds the same stretch of every rank's part.
    const size_t per_chunk = std::max<size_t>(1, segment_.slot_bytes() / elem / n);
    std::vector<const void*> src(n);
    size_t start = 0;
    do {
      const size_t count = std::min(per_chunk, part - start);
      char* slot = my_slot();
      for (int r = 0; r < n; ++r) std::memcpy(slot + r * count * elem, input + (r * part + start) * elem, count * elem);
      const int used = set();
      arrive_and_wait(kReduceScatter, true);
      for (int r = 0; r < n; ++r) src[r] = segment_.slot(used, r) + me * count * elem;
      fn(output + start * elem, src.data(), n, count, op);
      start += count;
    } while (start < part);
  }

  Segment segment_;
  std::vector<int> global_ranks_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Backend> fallback_;
  size_t one_phase_bytes_;
  size_t inline_bytes_ = 0;
  std::chrono::microseconds spin_{5};
  std::chrono::microseconds yield_{1000};

  // The protocol's state: touched only by the one job running at a time.
  uint32_t phase_ = 0;
  uint64_t chunk_ = 0;
  Desc desc_{};
  bool first_ = false;
  Clock::time_point deadline_;
  std::string failure_;
  std::atomic<bool> abort_{false};

  std::unique_ptr<std::atomic<bool>[]> dead_;
  std::vector<int> pidfds_;
  int stop_fd_ = -1;
  std::thread watcher_;

  std::shared_ptr<JobQueue> jobs_ = std::make_shared<JobQueue>();
  std::once_flag thread_started_;
  std::thread thread_;  // last: it uses everything above
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_shm_backend(const c10::intrusive_ptr<c10d::Store>& store, const World& world,
                                                   std::vector<int> global_ranks, std::chrono::milliseconds timeout,
                                                   c10::intrusive_ptr<c10d::Backend> fallback) {
  return c10::make_intrusive<ShmBackend>(store, world, std::move(global_ranks), timeout, std::move(fallback));
}

std::string shm_host_identity() {
  // For tests and emulated clusters: ranks that give different names are
  // on different "hosts" to ddp (one name on several real hosts would fail
  // to open the segment).
  if (const char* given = std::getenv("DDP_SHM_HOST_ID"); given && *given) return given;
  std::string identity;
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) == 0) identity += host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) identity += "/" + boot_id;
  // Peers open the segment through /proc/<pid>: they must share a pid namespace.
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) identity += "/pidns:" + std::to_string(ns.st_ino);
  // Network namespaces are how nodes are emulated on one machine (bench/
  // NETWORK.md): ranks in different ones are treated as different hosts.
  if (::stat("/proc/self/ns/net", &ns) == 0) identity += "/netns:" + std::to_string(ns.st_ino);
  return identity;
}

bool shm_enabled_by_env() {
  const char* text = std::getenv("DDP_SHM");
  if (!text || !*text) return true;
  const std::string value = text;
  DDP_CHECK(value == "0" || value == "1", "ddp: DDP_SHM='", value, "' must be 0 (never use shared memory) or 1");
  return value == "1";
}

}  // namespace ddp::detail
