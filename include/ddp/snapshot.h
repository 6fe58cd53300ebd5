#pragma once

// Snapshots: everything needed to resume training exactly where it stopped,
// the model, the optimizer's state (Adam moments and step counts included),
// the epoch and step, and the RNG state. Rank 0 writes them atomically with
// a SnapshotSaver (<ddp/snapshot_saver.h>), which also prunes the old ones;
// on a restart every rank resumes from the newest valid one.
//
//   ddp::SnapshotSaver saver(dir);
//   if (auto snapshot = ddp::load_newest_snapshot(dir, *group)) {
//     ddp::restore_snapshot(*snapshot, *model, optimizer);
//     first_epoch = snapshot->epoch + 1;
//   }
//   ...
//   if (group->rank() == 0) saver.save(ddp::capture_snapshot(*model, optimizer, epoch, step));

#include <ddp/export.h>
#include <ddp/checkpoint.h>
#include <ddp/process_group.h>

#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp {

/// The file format's version; loading refuses any other.
constexpr int64_t kSnapshotVersion = 1;

/// One resumable training state. capture_snapshot() fills it from a model
/// and optimizer; restore_snapshot() puts it back.
struct Snapshot {
  int64_t epoch = -1;       ///< the last completed epoch
  int64_t step = 0;         ///< optimizer steps taken so far
  int64_t sampler_epoch = 0;  ///< the DistributedSampler's epoch to resume with
  StateDict model;          ///< parameters and buffers
  c10::IValue optimizer;    ///< optimizer_state_dict(): Python's layout
  at::Tensor rng_state;     ///< the default CPU generator's state
  c10::IValue extra;        ///< anything else the program wants back (None if unused)
};

/// The optimizer's state in the layout of Python's optimizer.state_dict():
/// {"state": {index: {"step", "exp_avg", ...}}, "param_groups": [...]}.
/// Supports Adam, AdamW and SGD.
DDP_API c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer);
/// Whether the entry `key` of a parameter's optimizer state holds one value
/// per element of the parameter (exp_avg, momentum_buffer, ...) rather than
/// one for the whole parameter ("step"): what sharding must split.
DDP_API bool is_per_element_state(const std::string& key);
/// Restores what optimizer_state_dict returned. Parameters are matched by
/// position; counts and shapes must agree.
DDP_API void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state);

/// The state after `epoch` completed; the sampler resumes at epoch + 1.
DDP_API Snapshot capture_snapshot(const torch::nn::Module& model, torch::optim::Optimizer& optimizer, int64_t epoch,
                                  int64_t step);
/// The same from state gathered elsewhere: a full model state dict (FSDP's
/// full_state_dict, say) and optimizer state in Python's layout (FSDP's
/// full_optim_state_dict, ZeRO's consolidate_state_dict).
DDP_API Snapshot capture_snapshot(StateDict model, c10::IValue optimizer, int64_t epoch, int64_t step);
/// Puts back the RNG state a snapshot carries (restore_snapshot does too).
DDP_API void restore_rng_state(const Snapshot& snapshot);
/// Loads the model, the optimizer and the RNG state.
DDP_API void restore_snapshot(const Snapshot& snapshot, torch::nn::Module& model, torch::optim::Optimizer& optimizer);

/// Writes `snapshot` to `path` atomically, with a format version and a
/// checksum of its contents.
DDP_API void save_snapshot(const Snapshot& snapshot, const std::string& path);
/// Reads and validates a snapshot; throws, naming the file and the reason, if
/// it is truncated, corrupt, of another version or not a snapshot.
DDP_API Snapshot load_snapshot(const std::string& path);

/// The newest snapshot in `dir` that loads and validates, if any: the one
/// furthest along by the step recorded inside it, then its epoch, never by
/// file time. Invalid files are skipped one by one; for each, a message that
/// names it and why goes to `skipped` if given. A SnapshotSaver of this
/// process never prunes the one returned.
DDP_API std::optional<Snapshot> load_newest_snapshot(const std::string& dir,
                                                     std::vector<std::string>* skipped = nullptr);

/// Rank 0 picks the newest valid snapshot in `dir` and sends it to every
/// rank, so only rank 0 needs to see the directory; rank 0's savers never
/// prune it. Collective.
DDP_API std::optional<Snapshot> load_newest_snapshot(const std::string& dir, ProcessGroup& group,
                                                     std::vector<std::string>* skipped = nullptr);

namespace detail {
/// Records that this process resumed from the snapshot at `path`, which
/// SnapshotSaver's pruning then keeps.
DDP_API void note_resumed_from(const std::string& path);
}  // namespace detail

}  // namespace ddp
