#pragma once

// Internal to the library, not installed: the one gradient-synchronisation
// engine under BucketReducer (DDP's buckets) and detail::FsdpRuntime (FSDP's
// units). The public headers see only its policy interface
// (<ddp/detail/reduction_policy.h>).
//
// The engine owns what both need to agree on across ranks:
//  * one hook on every parameter's gradient accumulator;
//  * groups of parameters (buckets or units), launched in one order that is
//    the same on every rank: a complete group waits for every group before
//    it in that order, so a parameter unused on one rank only (a branch, a
//    router) cannot reorder that rank's collectives;
//  * one end-of-backward callback, which treats parameters that got no
//    gradient as zeros, launches every group before raising any error, and
//    waits for the reductions in launch order;
//  * the guards: an interrupted backward is an error at the next forward,
//    parameters unused without permission are an error naming them, and
//    no_sync() backward passes start no collective.
// The policy decides what a group is and how it is reduced: DDP copies each
// gradient into its bucket as it arrives and all-reduces the bucket; FSDP
// flattens a unit's gradients when the unit is complete and
// reduce-scatters them into the shard.

#include <ddp/detail/reduction_policy.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace ddp::detail {

struct EngineOptions {
  /// For messages: " through FullyShardedDataParallel", or empty for DDP.
  std::string owner;
  /// For messages: "all-reduces", "reduce-scatters".
  std::string collectives = "all-reduces";
  /// Parameters without a gradient count as zeros; off, they are an error
  /// that names them (DDP's find_unused_parameters).
  bool allow_unused = false;
  /// Launch a group as soon as it (and every one before it) is complete;
  /// off, every group waits for the end of backward.
  bool overlap = true;
  /// A backward pass begins with its first gradient (DDP). Off, only with
  /// begin_round() (FSDP, from a hook on its forward's outputs), and
  /// gradients outside a pass are ignored.
  bool rounds_start_on_first_gradient = true;
  /// no_sync() passes still report complete groups (FSDP frees a unit's
  /// gathered parameters then).
  bool track_rounds_without_sync = false;
  /// Hook the accumulators at all (DDP at one rank has nothing to do).
  bool install_hooks = true;
};

class GradientSyncEngine {
 public:
  /// `params` and their `names` (for errors). Groups: set_groups().
  GradientSyncEngine(std::vector<at::Tensor> params, std::vector<std::string> names,
                     std::shared_ptr<ProcessGroup> group, ReductionPolicy& policy, EngineOptions options);
  ~GradientSyncEngine();
  GradientSyncEngine(const GradientSyncEngine&) = delete;
  GradientSyncEngine& operator=(const GradientSyncEngine&) = delete;

  /// Parameter indices of each group; every parameter in exactly one. Not
  /// during a backward pass.
  void set_groups(std::vector<std::vector<size_t>> groups);
  const std::vector<std::vector<size_t>>& groups() const { return groups_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }

  /// After a forward: parameters that its outputs' graph cannot reach will
  /// get no gradient, so the next pass marks them ready when it starts and
  /// their groups need not wait for the end of backward.
  void find_unreachable(const std::vector<at::Tensor>& outputs);
  /// What find_unreachable found for the coming pass (parameter indices).
  const std::vector<size_t>& unreachable() const { return unreachable_; }
  /// Instead of find_unreachable: a static graph's set, found once.
  void set_unreachable(std::vector<size_t> unreachable) { unreachable_ = std::move(unreachable); }
  /// Starts a backward pass now, if none is running.
  void begin_round();
  /// Before a forward: throws if the last backward pass never ended (an
  /// exception inside it) or one of its reductions failed, since this rank's
  /// collectives may then be out of step with the other ranks'.
  void check_previous_round_finished();

  /// Join: a rank that ran out of data issues the collectives of one
  /// synchronised backward pass of the others, in the same launch order,
  /// over zeros (the policy's launch_shadow_group and before_waiting), and
  /// waits for them. This rank's gradients are left alone.
  void shadow_round();

  /// Hooks the accumulators now if EngineOptions::install_hooks left them
  /// alone (DDP at one rank that must still act on each bucket). Idempotent.
  void install_hooks();

  /// Off: backward passes only accumulate locally (no_sync()).
  void set_require_sync(bool require_sync) { require_sync_ = require_sync; }
  bool require_sync() const { return require_sync_; }
  bool round_active() const { return round_active_; }
  /// Synchronised passes completed.
  int64_t synchronised_rounds() const { return synchronised_rounds_; }

 private:
  void on_gradient_ready(size_t param);
  void start_round();
  void record_ready(size_t param, bool has_gradient);
  void launch_complete_groups_in_order();
  void finish_round();
  void wait_for(size_t position);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  ReductionPolicy& policy_;
  EngineOptions options_;
  std::vector<std::vector<size_t>> groups_;
  std::vector<size_t> group_of_param_;
  // The accumulators are owned weakly by their parameters; holding them
  // keeps our hooks attached for as long as the engine lives.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::mutex mutex_;  // hooks of different devices run on different threads

  // One backward pass.
  bool round_active_ = false;
  bool round_synchronised_ = true;
  bool round_failed_ = false;  // a reduction failed: the next forward is refused once
  std::vector<size_t> launch_order_;
  size_t next_to_launch_ = 0;  // position in launch_order_
  std::vector<size_t> pending_;  // per group: parameters not yet final
  std::vector<char> ready_;
  std::vector<char> counted_unused_;   // marked ready without a gradient this pass
  std::vector<char> used_locally_;     // got a gradient (this pass or a no_sync() one since)
  std::vector<char> used_since_sync_;  // got one in a no_sync() pass since the last synchronised one
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> reductions_;  // per group
  std::vector<size_t> unreachable_;
  bool require_sync_ = true;
  int64_t synchronised_rounds_ = 0;
};

/// A future that is already complete with `value`: a group whose reduction
/// needs no collective (one rank).
c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value);

}  // namespace ddp::detail
