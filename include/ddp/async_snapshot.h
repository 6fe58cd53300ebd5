#pragma once

// Snapshots written off the training thread. save() copies the snapshot's
// tensors (staging) and returns; one background thread then writes the copy
// with save_snapshot_in (temporary file, fsync, rename, checksum), so a
// crash mid-write leaves the previous snapshot as the newest valid one.
//
//   ddp::AsyncSnapshotWriter writer(ddp::AsyncSnapshotOptions().keep(2));
//   for (epoch ...) {
//     ... train ...
//     if (group->rank() == 0) writer.save(dir, ddp::capture_snapshot(*model, optimizer, epoch, step));
//   }
//   writer.wait();  // before exiting: the last snapshot is on disk, or its error is thrown

#include <ddp/snapshot.h>

#include <torch/arg.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace ddp {

/// How an AsyncSnapshotWriter writes.
///
///   ddp::AsyncSnapshotWriter writer(ddp::AsyncSnapshotOptions().keep(3).queue_depth(2));
struct AsyncSnapshotOptions {
  /// Valid snapshots kept per directory, as save_snapshot_in's `keep`.
  TORCH_ARG(int, keep) = 2;
  /// Staged snapshots held at once, the one being written included; save()
  /// waits while this many are held. Each costs a full copy of the snapshot
  /// in CPU memory, so 1 (save waits for the previous write, as PyTorch's
  /// async_save does) is the default.
  TORCH_ARG(int, queue_depth) = 1;
  /// Run the writer thread at Linux's SCHED_IDLE priority (nice 19 where
  /// that is refused), so it takes only CPU time training leaves spare.
  /// bench/MEMORY.md ("Async save") measures what it changes.
  TORCH_ARG(bool, low_priority) = true;
};

/// Writes snapshots on one background thread. At most one writer may write
/// into a directory at a time (in this process): a second one that saves
/// there throws until the first is destroyed.
///
/// Not thread-safe: call save() and wait() from one thread.
class AsyncSnapshotWriter {
 public:
  explicit AsyncSnapshotWriter(AsyncSnapshotOptions options = {});
  /// Waits until every queued snapshot is written. Never throws: an error
  /// not yet reported goes to stderr through TORCH_WARN.
  ~AsyncSnapshotWriter();
  AsyncSnapshotWriter(const AsyncSnapshotWriter&) = delete;
  AsyncSnapshotWriter& operator=(const AsyncSnapshotWriter&) = delete;

  /// Copies every tensor of `snapshot` to CPU memory of its own (model,
  /// optimizer state, RNG state, extra), so training may change the
  /// parameters as soon as this returns, then queues the copy for writing to
  /// DIR/snapshot_<epoch>.pt. When the queue is full (queue_depth), waits
  /// for the writer to finish one first. Creates `dir` (and its parents)
  /// if missing. Throws, and queues nothing, if an earlier write failed
  /// (ddp::Error naming the file; the write that made room included), if
  /// `dir` cannot be created, or if another writer owns `dir`.
  void save(const std::string& dir, const Snapshot& snapshot);

  /// Waits until every queued snapshot is on disk. Throws the first error
  /// of a write since the last save() or wait() that threw, naming the file.
  void wait();

  /// Snapshots staged and not yet written (the one being written included).
  size_t pending() const;

 private:
  struct Job {
    std::string dir;
    Snapshot snapshot;
  };
  void run();
  void claim_directory(const std::string& dir);
  void rethrow_error_locked(std::unique_lock<std::mutex>& lock);

  AsyncSnapshotOptions options_;
  std::set<std::string> directories_;  // claimed by this writer, released by the destructor
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> queue_;  // the front one is being written
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

/// A deep copy of `snapshot` with every tensor in CPU memory of its own,
/// detached from autograd: what AsyncSnapshotWriter::save() queues.
Snapshot stage_snapshot(const Snapshot& snapshot);

}  // namespace ddp
