#pragma once

// Sharded snapshots: distributed checkpoints (<ddp/distributed_checkpoint.h>)
// plus where training stood, written by every rank with no gather and
// resumable at another world size, as after ddprun --nnodes MIN:MAX lost or
// gained a node. The sampler's place in the epoch is kept job-wide, so the
// rest of an interrupted epoch is split anew over the ranks that are left:
//
//   ddp::DistributedSampler sampler(n, ddp::SamplerOptions(group->size(), group->rank()));
//   ddp::SnapshotSaver saver(dir);  // <ddp/snapshot_saver.h>
//   ddp::TrainingProgress start;
//   if (auto found = ddp::load_newest_sharded_snapshot(dir, model, &optimizer)) start = *found;
//   for (int64_t epoch = start.epoch; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     if (epoch == start.epoch) sampler.resume_epoch(start.samples_seen);
//     for (auto& batch : *loader) {
//       ... train, ++step ...
//       if (step % 100 == 0) saver.save(model, &optimizer, {epoch, step, seen_so_far});
//     }
//   }
//
// where seen_so_far is sampler.samples_seen() with a loader of workers(0),
// or counted from the batches consumed (a loader with workers prefetches).
// Each snapshot is DIR/sharded_step_<step>, committed whole (see
// distributed_checkpoint.h), so a crash mid-save leaves the previous newest;
// the saver keeps the newest `keep` of them (see snapshot_saver.h). Every
// rank must see DIR (a shared file system).

#include <ddp/export.h>
#include <ddp/distributed_checkpoint.h>
#include <ddp/snapshot.h>

#include <cstdint>
#include <exception>
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
DDP_API DistributedCheckpointOptions::Metadata progress_metadata(const TrainingProgress& progress);
/// The snapshots in `dir` whose files are all there, whose headers read and
/// whose progress matches their name, newest first; the others are named in
/// `skipped`. Reads headers only.
DDP_API std::vector<std::pair<std::string, TrainingProgress>> valid_sharded_snapshots(
    const std::string& dir, std::vector<std::string>* skipped);
/// Every rank's candidates (valid_sharded_snapshots) must be the same;
/// throws on every rank if not (the ranks see different directories).
DDP_API void agree_on_candidates(ProcessGroup& group, const std::string& dir,
                                 const std::vector<std::pair<std::string, TrainingProgress>>& candidates);
/// After every rank tried to load `path`: whether all of them did, some did,
/// or none. A failure is named in `skipped` with the first failing rank's
/// `error` ("" where this rank loaded it).
enum class LoadAgreement { kAll, kSome, kNone };
DDP_API LoadAgreement agree_on_load(ProcessGroup& group, const std::string& path, const std::string& error,
                                    std::vector<std::string>* skipped);
/// The message of an exception, without a backtrace.
DDP_API std::string message_of(const std::exception& e);
/// Throws, naming `dir`, when ranks that loaded a snapshot the others could
/// not are left holding it (`partly_loaded`).
DDP_API void check_not_left_partly_loaded(const std::string& dir, bool partly_loaded,
                                          const std::vector<std::string>& why);
}  // namespace detail

/// Loads the newest sharded snapshot in `dir` that every rank can load,
/// written at any world size and under any strategy, and returns where it
/// stood; nullopt when there is none. Newer snapshots that are incomplete,
/// damaged or of another model are skipped, each named in `skipped`; the
/// ranks fall back together. Collective.
template <typename Model, typename Optimizer>
std::optional<TrainingProgress> load_newest_sharded_snapshot(const std::string& dir, Model& model,
                                                             Optimizer&& optimizer,
                                                             std::vector<std::string>* skipped = nullptr) {
  ProcessGroup& group = *model.process_group();
  std::vector<std::string> why;
  const auto candidates = detail::valid_sharded_snapshots(dir, &why);
  detail::agree_on_candidates(group, dir, candidates);
  bool partly_loaded = false;  // some rank holds a snapshot that others could not load
  for (const auto& [path, progress] : candidates) {
    std::string error;
    try {
      load_distributed_checkpoint(path, model, optimizer);
    } catch (const std::exception& e) {
      error = detail::message_of(e);
    }
    const auto agreement = detail::agree_on_load(group, path, error, &why);
    if (agreement == detail::LoadAgreement::kAll) {
      detail::note_resumed_from(path);
      if (skipped) skipped->insert(skipped->end(), why.begin(), why.end());
      return progress;
    }
    partly_loaded = partly_loaded || agreement == detail::LoadAgreement::kSome;
  }
  if (skipped) skipped->insert(skipped->end(), why.begin(), why.end());
  detail::check_not_left_partly_loaded(dir, partly_loaded, why);
  return std::nullopt;
}

}  // namespace ddp
