// SnapshotSaver (include/ddp/snapshot_saver.h): writing both kinds of
// snapshot, the background writer of async_write, and the one retention
// policy (src/checkpoint/snapshot_retention.h).

#include <ddp/snapshot_saver.h>

#include <ddp/collective_trace.h>
#include <ddp/error.h>

#include "common/error_text.h"
#include "checkpoint/snapshot_retention.h"
#include "launch/test_seams.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace fs = std::filesystem;

namespace ddp {
namespace detail {
namespace {

std::mutex resumed_mutex;
std::set<std::string>& resumed_paths() {
  static std::set<std::string> paths;
  return paths;
}

}  // namespace

std::string canonical_path(const std::string& path) {
  std::error_code ec;
  auto result = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? path : result.string();
}

void note_resumed_from(const std::string& path) {
  std::lock_guard<std::mutex> lock(resumed_mutex);
  resumed_paths().insert(canonical_path(path));
}

bool resumed_from(const std::string& path) {
  const std::string key = canonical_path(path);
  std::lock_guard<std::mutex> lock(resumed_mutex);
  return resumed_paths().count(key) > 0;
}

std::vector<std::string> snapshots_to_remove(const SnapshotListing& listing, int keep) {
  std::vector<std::string> remove;
  if (keep <= 0) return remove;
  // A damaged or foreign snapshot is not ours to judge: it must neither push
  // one of this run's valid fallbacks out nor be removed.
  std::vector<const SnapshotOnDisk*> ours;
  for (const auto& other : listing.others) {
    if (other.ours) ours.push_back(&other);
  }
  std::stable_sort(ours.begin(), ours.end(),
                   [](const SnapshotOnDisk* a, const SnapshotOnDisk* b) { return further_along(*a, *b); });
  int kept = 1;  // the one written
  for (const SnapshotOnDisk* other : ours) {
    if (kept < keep) {
      ++kept;
    } else if (further_along(listing.written, *other) && !other->resumed_from) {
      remove.push_back(other->path);
    }
  }
  return remove;
}

}  // namespace detail

namespace {

at::Tensor stage_tensor(const at::Tensor& t) {
  if (!t.defined()) return t;
  // copy=true: a CPU tensor is copied too, never aliased.
  return t.detach().to(t.options().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}

c10::IValue stage_value(const c10::IValue& v) {
  if (v.isTensor()) return stage_tensor(v.toTensor());
  if (v.isGenericDict()) {
    // Dicts and lists are shared by reference: the copy needs containers of
    // its own, or the caller's later inserts would show up in it.
    auto source = v.toGenericDict();
    c10::impl::GenericDict copy(source.keyType(), source.valueType());
    for (const auto& item : source) copy.insert(stage_value(item.key()), stage_value(item.value()));
    return copy;
  }
  if (v.isList()) {
    auto source = v.toList();
    c10::impl::GenericList copy(source.elementType());
    copy.reserve(source.size());
    for (const auto& item : source) copy.push_back(stage_value(item));
    return copy;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& item : v.toTupleRef().elements()) elements.push_back(stage_value(item));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  // Numbers, strings and None are immutable; anything stranger is copied
  // the way TorchScript copies it.
  if (v.isNone() || v.isInt() || v.isDouble() || v.isBool() || v.isString()) return v;
  return v.deepcopy();
}

// A deep copy of `snapshot` with every tensor in CPU memory of its own,
// detached from autograd: what an asynchronous save() queues.
Snapshot stage_snapshot(const Snapshot& snapshot) {
  Snapshot staged;
  staged.epoch = snapshot.epoch;
  staged.step = snapshot.step;
  staged.sampler_epoch = snapshot.sampler_epoch;
  staged.model.reserve(snapshot.model.size());
  for (const auto& [name, tensor] : snapshot.model) staged.model.emplace_back(name, stage_tensor(tensor));
  staged.optimizer = stage_value(snapshot.optimizer);
  staged.rng_state = stage_tensor(snapshot.rng_state);
  staged.extra = stage_value(snapshot.extra);
  return staged;
}

// The directories some saver in this process writes into: two savers of
// one directory would prune each other's snapshots.
std::mutex claimed_mutex;
std::set<std::string>& claimed_directories() {
  static std::set<std::string> directories;
  return directories;
}

// Linux schedules threads one by one: pid 0 here means the calling thread.
void lower_this_threads_priority() {
  sched_param param{};
  param.sched_priority = 0;
  if (::sched_setscheduler(0, SCHED_IDLE, &param) == 0) return;
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
}

void warn_quietly(const std::string& message) {
  try {
    TORCH_WARN(message);
  } catch (...) {  // a warning handler that throws must not end the program or the thread
  }
}

// The retention policy's verdict, carried out. `list` reads the directory;
// when the snapshot just written does not read back, it throws and the
// older ones stay: they are the only fallback.
void prune(const std::string& written, int keep, const std::function<detail::SnapshotListing()>& list) {
  if (keep <= 0) return;
  detail::SnapshotListing listing;
  try {
    listing = list();
  } catch (const std::exception& e) {
    warn_quietly("ddp: the snapshot just written ('" + written +
                 "') does not read back, so no older one is removed: " + detail::message_of(e));
    return;
  }
  for (const auto& path : detail::snapshots_to_remove(listing, keep)) {
    std::error_code ignored;  // another attempt may be pruning too
    fs::remove_all(path, ignored);
  }
}

std::string snapshot_path(const std::string& dir, const Snapshot& snapshot) {
  return dir + "/snapshot_" + std::to_string(snapshot.epoch) + ".pt";
}

// Writes `snapshot` into `dir`, then prunes: the one step a saver takes,
// on the caller's thread or on its background writer.
void write_and_prune(const std::string& dir, const Snapshot& snapshot, int keep) {
  set_trace_fallback_directory(dir);  // collective traces go next to the snapshots
  const std::string path = snapshot_path(dir, snapshot);
  save_snapshot(snapshot, path);
  prune(path, keep, [&] { return detail::list_snapshot_files(dir, path); });
}

}  // namespace

// The thread of a saver with async_write, and its bounded queue.
class SnapshotSaver::BackgroundWriter {
 public:
  BackgroundWriter(std::string directory, const SnapshotOptions& options)
      : directory_(std::move(directory)), options_(options) {
    thread_ = std::thread([this] { run(); });
  }

  // Writes everything queued before the thread ends.
  ~BackgroundWriter() {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        warn_quietly("ddp: an asynchronous snapshot save failed and nobody called wait() to see it: " +
                     detail::message_of(e));
      }
    }
  }

  void rethrow_error() {
    std::unique_lock<std::mutex> lock(mutex_);
    rethrow_error_locked(lock);
  }

  void push(Snapshot staged) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return queue_.size() < static_cast<size_t>(options_.queue_depth()); });
    // The write that made room may have failed: this snapshot would very
    // likely fail the same way (a full disk), so report that instead.
    rethrow_error_locked(lock);
    queue_.push_back(std::move(staged));
    lock.unlock();
    changed_.notify_all();
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return queue_.empty(); });
    rethrow_error_locked(lock);
  }

  size_t pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.size();
  }

 private:
  void rethrow_error_locked(std::unique_lock<std::mutex>& lock) {
    if (!error_) return;
    std::exception_ptr error = std::exchange(error_, nullptr);
    lock.unlock();
    std::rethrow_exception(error);
  }

  void run() {
    if (options_.low_priority()) lower_this_threads_priority();
    const auto delay = detail::test_seams().async_snapshot_write_delay;  // zero outside tests
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to write
      // The snapshot stays at the front while it is written, so it counts
      // against queue_depth: that bounds the staged copies alive at once.
      const Snapshot& snapshot = queue_.front();
      lock.unlock();
      std::exception_ptr error;
      try {
        if (delay.count() > 0) std::this_thread::sleep_for(delay);
        write_and_prune(directory_, snapshot, options_.keep());
      } catch (const std::exception& e) {
        error = std::make_exception_ptr(Error(c10::str(
            "ddp: the asynchronous save of '", snapshot_path(directory_, snapshot),
            "' failed (the previous snapshot there is still the newest valid one): ", detail::message_of(e))));
      }
      lock.lock();
      if (error && !error_) {
        error_ = error;
      } else if (error) {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          warn_quietly(detail::message_of(e));  // the first error is the one save() or wait() throws
        }
      }
      queue_.pop_front();
      changed_.notify_all();
    }
  }

  const std::string directory_;
  const SnapshotOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Snapshot> queue_;  // the front one is being written
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

SnapshotSaver::SnapshotSaver(std::string directory, SnapshotOptions options)
    : directory_(std::move(directory)), options_(options) {
  DDP_CHECK(!directory_.empty(), "ddp: SnapshotSaver needs a directory to write snapshots into");
  DDP_CHECK(options_.keep() >= 0, "ddp: SnapshotOptions::keep must be at least 0 (0 keeps every snapshot), got ",
            options_.keep());
  DDP_CHECK(options_.queue_depth() >= 1, "ddp: SnapshotOptions::queue_depth must be at least 1, got ",
            options_.queue_depth());
  const std::string key = detail::canonical_path(directory_);
  {
    std::lock_guard<std::mutex> lock(claimed_mutex);
    DDP_CHECK(claimed_directories().insert(key).second, "ddp: another SnapshotSaver is already writing into '",
              directory_, "'; use one saver per directory (two would prune each other's snapshots)");
  }
  claimed_ = key;
  if (options_.async_write()) writer_ = std::make_unique<BackgroundWriter>(directory_, options_);
}

SnapshotSaver::~SnapshotSaver() {
  writer_.reset();  // writes what is queued before the directory is given up
  std::lock_guard<std::mutex> lock(claimed_mutex);
  claimed_directories().erase(claimed_);
}

std::string SnapshotSaver::save(const Snapshot& snapshot) {
  if (writer_) writer_->rethrow_error();
  const std::string& dir = directory_;
  // Made here, not on the writer thread: a directory that cannot exist is
  // the caller's error now, not a failed write reported one save() later.
  std::error_code ec;
  fs::create_directories(dir, ec);
  DDP_CHECK(!ec && fs::is_directory(dir), "ddp: SnapshotSaver cannot create the snapshot directory '", dir, "'",
            ec ? ": " + ec.message() : std::string(": something else is there"),
            "; give SnapshotSaver a directory it can write into");
  if (!writer_) {
    write_and_prune(dir, snapshot, options_.keep());
  } else {
    // Staged before waiting for room: the caller may change its tensors as
    // soon as save() returns, whichever way it returns.
    writer_->push(stage_snapshot(snapshot));
  }
  return snapshot_path(dir, snapshot);
}

void SnapshotSaver::wait() {
  if (writer_) writer_->wait();
}

size_t SnapshotSaver::pending() const { return writer_ ? writer_->pending() : 0; }

std::string SnapshotSaver::sharded_path(const TrainingProgress& progress) const {
  DDP_CHECK(!options_.async_write(), "ddp: a sharded snapshot cannot be written asynchronously: every rank takes ",
            "part in its commit, and ddp has no asynchronous distributed save yet; save sharded snapshots with a ",
            "SnapshotSaver built without SnapshotOptions::async_write");
  return detail::sharded_snapshot_path(directory_, progress.step);
}

void SnapshotSaver::prune_sharded(const std::string& written) const {
  prune(written, options_.keep(), [&] { return detail::list_sharded_snapshots(directory_, written); });
}

}  // namespace ddp
