#pragma once

// The one way to write snapshots to resume from, and to prune the old ones.
// A SnapshotSaver owns one directory and writes either kind of snapshot
// into it:
//
// - a snapshot (<ddp/snapshot.h>): rank 0 writes DIR/snapshot_<epoch>.pt,
//   the whole state, from a Snapshot;
// - a sharded snapshot (<ddp/sharded_snapshot.h>): every rank writes its
//   part of DIR/sharded_step_<step>, a distributed checkpoint, with no gather.
//
//   ddp::SnapshotSaver saver(dir, ddp::SnapshotOptions().async_write(true));
//   for (epoch ...) {
//     ... train ...
//     if (group->rank() == 0) saver.save(ddp::capture_snapshot(*model, optimizer, epoch, step));
//   }
//   saver.wait();  // before exiting: the last snapshot is on disk, or its error is thrown
//
//   ddp::SnapshotSaver saver(dir, ddp::SnapshotOptions().keep(3));
//   saver.save(fsdp_model, &optimizer, ddp::TrainingProgress{epoch, step, samples_seen});  // collective
//
// Both kinds follow one retention policy. After a write the saver reads the
// new snapshot back; if it does not validate, nothing else is removed (the
// older ones are the fallback). Otherwise it keeps the newest `keep` of this
// run's snapshots, the new one included, counting only those that validate
// and hold the same model (names and shapes) by the step, then the epoch,
// recorded inside them, never by file time. It never removes a file or
// directory that does not validate, holds another model or is a symbolic
// link (someone else's, or damaged: not ours to judge), one further along
// than the new one, or the one this process resumed from.
//
// With async_write, save() copies the snapshot's tensors and returns; the
// saver's background thread then writes and prunes, so a crash mid-write
// leaves the previous snapshot the newest valid one. Sharded snapshots are
// written on the calling thread only: every rank takes part in their
// commit, and ddp has no asynchronous distributed save yet.

#include <ddp/export.h>
#include <ddp/sharded_snapshot.h>
#include <ddp/snapshot.h>

#include <torch/arg.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

namespace ddp {

/// How a SnapshotSaver writes.
///
///   ddp::SnapshotSaver saver("runs/wine", ddp::SnapshotOptions().keep(3).async_write(true));
struct SnapshotOptions {
  /// This run's valid snapshots kept, the one just written included;
  /// 0 keeps every one.
  TORCH_ARG(int, keep) = 2;
  /// Write snapshots on a background thread: save() returns once the
  /// snapshot is copied to CPU memory of its own. Not for sharded
  /// snapshots, whose save() refuses it.
  TORCH_ARG(bool, async_write) = false;
  /// With async_write: staged snapshots held at once, the one being written
  /// included; save() waits while this many are held. Each costs a full
  /// copy of the snapshot in CPU memory, so 1 (save waits for the previous
  /// write, as PyTorch's async_save does) is the default.
  TORCH_ARG(int, queue_depth) = 1;
  /// With async_write: run the writer thread at Linux's SCHED_IDLE priority
  /// (nice 19 where that is refused), so it takes only CPU time training
  /// leaves spare. bench/MEMORY.md ("Async save") measures what it changes.
  TORCH_ARG(bool, low_priority) = true;
};

/// Writes snapshots into one directory and prunes them by one policy (see
/// the top of this header).
///
/// Not thread-safe: call save() and wait() from one thread.
class DDP_API SnapshotSaver {
 public:
  /// Writes into `directory`, made (with its parents) at the first save of a
  /// snapshot. At most one saver may own a directory in a process: a second
  /// one for the same directory throws until the first is destroyed.
  explicit SnapshotSaver(std::string directory, SnapshotOptions options = {});
  /// Waits until every queued snapshot is written. Never throws: an error
  /// not yet reported goes to stderr through TORCH_WARN.
  ~SnapshotSaver();
  SnapshotSaver(const SnapshotSaver&) = delete;
  SnapshotSaver& operator=(const SnapshotSaver&) = delete;

  /// Writes `snapshot` to DIR/snapshot_<epoch>.pt atomically (temporary
  /// file, fsync, rename; a format version and a checksum inside), then
  /// prunes. Call it on one rank (rank 0). Creates the directory if missing.
  /// With async_write, copies every tensor of `snapshot` first (model,
  /// optimizer state, RNG state, extra), so training may change the
  /// parameters as soon as this returns, and queues the copy; when the queue
  /// is full (queue_depth), waits for the writer to finish one. Throws, and
  /// writes nothing, if an earlier write failed (ddp::Error naming the file;
  /// the write that made room included) or if the directory cannot be made.
  /// Returns the snapshot's path.
  std::string save(const Snapshot& snapshot);

  /// Writes DIR/sharded_step_<progress.step> from `model`
  /// (FullyShardedDataParallel or DistributedDataParallel) and `optimizer`
  /// (a torch::optim::Optimizer*, or a ZeroRedundancyOptimizer), as
  /// save_distributed_checkpoint does, with `progress` in its metadata; then
  /// rank 0 prunes. Returns the snapshot's directory. Collective; every rank
  /// must see the directory (a shared file system). Throws on every rank,
  /// before writing, with async_write.
  template <typename Model, typename Optimizer>
  std::string save(Model& model, Optimizer&& optimizer, const TrainingProgress& progress) {
    const std::string path = sharded_path(progress);
    save_distributed_checkpoint(path, model, std::forward<Optimizer>(optimizer),
                                DistributedCheckpointOptions().metadata(detail::progress_metadata(progress)));
    if (model.process_group()->rank() == 0) prune_sharded(path);
    return path;
  }

  /// Waits until every queued snapshot is on disk. Throws the first error
  /// of a write since the last save() or wait() that threw, naming the file.
  void wait();

  /// Snapshots staged and not yet written (the one being written included);
  /// 0 without async_write.
  size_t pending() const;

  const std::string& directory() const { return directory_; }
  const SnapshotOptions& options() const { return options_; }

 private:
  class BackgroundWriter;
  std::string sharded_path(const TrainingProgress& progress) const;
  void prune_sharded(const std::string& written) const;

  std::string directory_;
  SnapshotOptions options_;
  std::string claimed_;  // the directory's key in the process-wide set of claimed ones
  std::unique_ptr<BackgroundWriter> writer_;  // with async_write only
};

}  // namespace ddp
