#pragma once

// Internal, not API: the interface between the gradient engine
// (src/gradient_sync_engine.h, not installed), which schedules groups of
// gradients, and its two reduction policies, which decide what a group is
// and how it is reduced: DDP's buckets (BucketReducer) and FSDP's units
// (detail::FsdpRuntime). Installed only because those two classes implement
// it; it may change in any release.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <string>
#include <vector>

namespace ddp::detail {

/// What DDP and FSDP decide; the engine calls these, on the autograd thread.
class ReductionPolicy {
 public:
  virtual ~ReductionPolicy() = default;
  /// A backward pass starts (synchronised: false inside no_sync()). Returns
  /// the order its groups launch in, every group once, the same on every
  /// rank.
  virtual std::vector<size_t> on_round_start(bool synchronised) = 0;
  /// Synchronised passes only: parameter `param` is final for this pass
  /// (has_gradient false: it got none and counts as zeros).
  virtual void on_gradient_ready(size_t param, bool has_gradient) = 0;
  /// Every parameter of `group` is final and every group before it has been
  /// launched: start its reduction. The future's value is the reduced
  /// tensor (a tensor or a list whose first element is it).
  virtual c10::intrusive_ptr<c10::ivalue::Future> launch_group(size_t group) = 0;
  /// no_sync() passes, when the engine tracks them: every parameter of
  /// `group` is final. No collective may start.
  virtual void on_group_complete_without_sync(size_t /*group*/) {}
  /// Every group has been launched and none waited for: a collective that
  /// every rank runs here (DDP's unused-parameter flags) overlaps them.
  /// used_locally[p]: whether p got a gradient on this rank since the last
  /// synchronised pass.
  virtual void before_waiting(const std::vector<char>& /*used_locally*/) {}
  /// `group`'s reduction finished with `result`.
  virtual void finish_group(size_t group, const at::Tensor& result) = 0;
  /// The pass is over: after every finish_group, or after a no_sync() pass.
  virtual void on_round_end(bool /*synchronised*/) {}
  /// Join's shadow pass (GradientSyncEngine::shadow_round): start `group`'s
  /// reduction as launch_group would, over zeros, leaving this rank's
  /// gradients alone. Policies that do not support Join keep the default,
  /// which refuses.
  virtual c10::intrusive_ptr<c10::ivalue::Future> launch_shadow_group(size_t group);
  /// For errors: "gradient bucket 2/3".
  virtual std::string group_label(size_t group) const = 0;
  /// For the collective trace: "ddp bucket 2/3".
  virtual std::string collective_tag(size_t group) const = 0;
};

}  // namespace ddp::detail
