#include <ddp/async_snapshot.h>

#include <ddp/error.h>

#include "error_text.h"
#include "test_seams.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <utility>

namespace ddp {
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

// The directories some writer in this process is writing into.
std::mutex claimed_mutex;
std::set<std::string>& claimed_directories() {
  static std::set<std::string> directories;
  return directories;
}

std::string directory_key(const std::string& dir) {
  std::error_code ec;
  auto path = std::filesystem::weakly_canonical(std::filesystem::absolute(dir, ec), ec);
  return ec ? dir : path.string();
}

// Where a snapshot goes: save_snapshot_in's name for it.
std::string snapshot_path(const std::string& dir, const Snapshot& snapshot) {
  return dir + "/snapshot_" + std::to_string(snapshot.epoch) + ".pt";
}

// Linux schedules threads one by one: pid 0 here means the calling thread.
void lower_this_threads_priority() {
  sched_param param{};
  param.sched_priority = 0;
  if (::sched_setscheduler(0, SCHED_IDLE, &param) == 0) return;
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
}

}  // namespace

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

AsyncSnapshotWriter::AsyncSnapshotWriter(AsyncSnapshotOptions options) : options_(options) {
  DDP_CHECK(options_.keep() >= 1, "ddp: AsyncSnapshotOptions::keep must be at least 1, got ", options_.keep());
  DDP_CHECK(options_.queue_depth() >= 1, "ddp: AsyncSnapshotOptions::queue_depth must be at least 1, got ",
            options_.queue_depth());
  thread_ = std::thread([this] { run(); });
}

AsyncSnapshotWriter::~AsyncSnapshotWriter() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();  // the thread writes everything queued before it ends
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      try {
        TORCH_WARN("ddp: an asynchronous snapshot save failed and nobody called wait() to see it: ",
                   detail::message_of(e));
      } catch (...) {  // a warning handler that throws must not end the program
      }
    }
  }
  std::lock_guard<std::mutex> lock(claimed_mutex);
  for (const auto& dir : directories_) claimed_directories().erase(dir);
}

void AsyncSnapshotWriter::claim_directory(const std::string& dir) {
  std::string key = directory_key(dir);
  if (directories_.count(key)) return;
  std::lock_guard<std::mutex> lock(claimed_mutex);
  DDP_CHECK(claimed_directories().insert(key).second, "ddp: another AsyncSnapshotWriter is already writing into '",
            dir, "'; use one writer per directory (two would prune each other's snapshots)");
  directories_.insert(key);
}

void AsyncSnapshotWriter::rethrow_error_locked(std::unique_lock<std::mutex>& lock) {
  if (!error_) return;
  std::exception_ptr error = std::exchange(error_, nullptr);
  lock.unlock();
  std::rethrow_exception(error);
}

void AsyncSnapshotWriter::save(const std::string& dir, const Snapshot& snapshot) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    rethrow_error_locked(lock);
  }
  claim_directory(dir);
  // Made here, not on the thread: a directory that cannot exist is the
  // caller's error now, not a failed write reported one save() later.
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  DDP_CHECK(!ec && std::filesystem::is_directory(dir), "ddp: AsyncSnapshotWriter cannot create the snapshot ",
            "directory '", dir, "'", ec ? ": " + ec.message() : std::string(": something else is there"),
            "; give save() a directory it can write into");
  // Staged before waiting for room: the caller may change its tensors as
  // soon as save() returns, whichever way it returns.
  Job job{dir, stage_snapshot(snapshot)};
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.size() < static_cast<size_t>(options_.queue_depth()); });
  // The write that made room may have failed: this snapshot would very
  // likely fail the same way (a full disk), so report that instead.
  rethrow_error_locked(lock);
  queue_.push_back(std::move(job));
  lock.unlock();
  changed_.notify_all();
}

void AsyncSnapshotWriter::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty(); });
  rethrow_error_locked(lock);
}

size_t AsyncSnapshotWriter::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

void AsyncSnapshotWriter::run() {
  if (options_.low_priority()) lower_this_threads_priority();
  const auto delay = detail::test_seams().async_snapshot_write_delay;  // zero outside tests
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left to write
    // The job stays at the front while it is written, so it counts against
    // queue_depth: that bounds the staged copies alive at once.
    Job& job = queue_.front();
    lock.unlock();
    std::exception_ptr error;
    try {
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      save_snapshot_in(job.dir, job.snapshot, options_.keep());
    } catch (const std::exception& e) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      error = std::make_exception_ptr(Error(c10::str(
          "ddp: the asynchronous save of '", snapshot_path(job.dir, job.snapshot),
          "' failed (the previous snapshot there is still the newest valid one): ",
          c10_error ? c10_error->what_without_backtrace() : e.what())));
    }
    lock.lock();
    if (error) {
      if (!error_) {
        error_ = error;
      } else {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          try {
            TORCH_WARN(detail::message_of(e));  // the first error is the one save() or wait() throws
          } catch (...) {  // a warning handler that throws must not end the thread
          }
        }
      }
    }
    queue_.pop_front();
    changed_.notify_all();
  }
}

}  // namespace ddp
