#pragma once

// Sharded snapshots: distributed checkpoints (<ddp/distributed_checkpoint.h>)
// plus where training stood, written by every rank with no gather and
// resumable at another world size, as after ddprun --nnodes MIN:MAX lost or
// gained a node. The sampler's place in the epoch is kept job-wide, so the
// rest of an interrupted epoch is split anew over the ranks that are left:
//
//   ddp::DistributedSampler sampler(n, ddp::SamplerOptions(group->size(), group->rank()));
//   ddp::TrainingProgress start;
//   if (auto found = ddp::load_newest_sharded_snapshot(dir, model, &optimizer)) start = *found;
//   for (int64_t epoch = start.epoch; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     if (epoch == start.epoch) sampler.resume_epoch(start.samples_seen);
//     for (auto& batch : *loader) {
//       ... train, ++step ...
//       if (step % 100 == 0)
//         ddp::save_sharded_snapshot(dir, model, &optimizer, {epoch, step, seen_so_far});
//     }
//   }
//
// where seen_so_far is sampler.samples_seen() with a loader of workers(0),
// or counted from the batches consumed (a loader with workers prefetches).
// Each snapshot is DIR/sharded_step_<step>, committed whole (see
// distributed_checkpoint.h), so a crash mid-save leaves the previous newest.
// Every rank must see DIR (a shared file system).

#include <ddp/distributed_checkpoint.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddp {

/// Where a job stands in its data.
struct TrainingProgress {
  int64_t epoch = 0;         ///< the epoch to resume (in progress, or the next one)
  int64_t step = 0;          ///< optimizer steps taken so far
  int64_t samples_seen = 0;  ///< of `epoch`'s job-wide order (DistributedSampler::samples_seen())
};

namespace detail {
std::string sharded_snapshot_path(const std::string& dir, int64_t step);
DistributedCheckpointOptions::Metadata progress_metadata(const TrainingProgress& progress);
/// The newest snapshot in `dir` whose files and progress read back; the
/// others (newer but unreadable) are named in `skipped`.
std::optional<std::pair<std::string, TrainingProgress>> newest_sharded_snapshot(const std::string& dir,
                                                                               std::vector<std::string>* skipped);
/// Rank 0 removes all but the newest `keep` snapshots (keep <= 0: none).
void prune_sharded_snapshots(const std::string& dir, int keep, ProcessGroup& group);
}  // namespace detail

/// Saves DIR/sharded_step_<progress.step> from `model` (FullyShardedDataParallel
/// or DistributedDataParallel) and `optimizer` (a torch::optim::Optimizer*,
/// or a ZeroRedundancyOptimizer), then keeps the newest `keep`. Returns the
/// snapshot's directory. Collective.
template <typename Model, typename Optimizer>
std::string save_sharded_snapshot(const std::string& dir, Model& model, Optimizer&& optimizer,
                                  const TrainingProgress& progress, int keep = 2) {
  const std::string path = detail::sharded_snapshot_path(dir, progress.step);
  save_distributed_checkpoint(path, model, std::forward<Optimizer>(optimizer),
                              DistributedCheckpointOptions().metadata(detail::progress_metadata(progress)));
  detail::prune_sharded_snapshots(dir, keep, *model.process_group());
  return path;
}

/// Loads the newest sharded snapshot in `dir`, written at any world size and
/// under any strategy, and returns where it stood; nullopt when there is
/// none. Newer snapshots that do not read back are skipped and named in
/// `skipped`. Collective.
template <typename Model, typename Optimizer>
std::optional<TrainingProgress> load_newest_sharded_snapshot(const std::string& dir, Model& model,
                                                             Optimizer&& optimizer,
                                                             std::vector<std::string>* skipped = nullptr) {
  auto found = detail::newest_sharded_snapshot(dir, skipped);
  if (!found) return std::nullopt;
  load_distributed_checkpoint(found->first, model, std::forward<Optimizer>(optimizer));
  return found->second;
}

}  // namespace ddp
