#pragma once

// DDP's gradient averaging: every parameter's gradient is averaged across
// ranks during backward. Parameters are grouped into buckets
// (src/bucket_assignment.h); as each gradient becomes final it is copied into
// its bucket, and a full bucket is handed to the communication hook (by default
// an async all-reduce) at once, in bucket order, while backward goes on
// computing earlier layers. When backward ends, the engine waits for every
// bucket and the averages go back into .grad.

#include <ddp/comm_hooks.h>
#include <ddp/detail/reduction_policy.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ddp/nonfinite.h>

namespace torch::optim {
class Optimizer;
}

namespace ddp {
namespace detail {
class GradientSyncEngine;  // the engine, internal to the library
}

/// How gradients are bucketed and reduced. DDPOptions forwards these.
struct ReducerOptions {
  /// Cap of every bucket after the first, in MiB (PyTorch's default).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Cap of the first bucket, in MiB: small, so communication starts early.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Allow parameters that take no part in a forward: they count as ready
  /// with a zero gradient. Off, such a parameter is an error naming it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Make each .grad share memory with its bucket, saving the copy back
  /// after the all-reduce and the memory of a second gradient copy. The
  /// gradients are plain tensors (not views), so optimizer.zero_grad() works.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// After the first iteration, regroup buckets in the order gradients
  /// actually became ready (rank 0's order, so all ranks agree).
  TORCH_ARG(bool, rebuild_buckets) = true;
  /// Start each bucket's reduction as soon as it is full. Off, every bucket
  /// waits for the end of backward; only useful to measure what overlap buys.
  TORCH_ARG(bool, overlap_with_backward) = true;
  /// How a bucket is reduced; null means allreduce_hook().
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;
  /// The last bucket's all-reduce also carries each rank's loss, given to
  /// note_loss() before backward, as world size + 1 extra elements: a flag
  /// per rank and the loss divided by the world size. So the non-finite
  /// check and the loss averaged for the log cost no collective of their own
  /// (reduced_loss()). Only with the default all-reduce (no comm_hook).
  TORCH_ARG(bool, carry_loss) = false;
  /// The graph is the same every iteration (PyTorch's static_graph): the
  /// same parameters take part and their gradients arrive in the same order.
  /// With find_unused_parameters, the first iteration's findings are then
  /// kept: later iterations skip the search of the autograd graph for
  /// parameters the outputs cannot reach and the all-reduce of the
  /// per-parameter "used" flags. Without find_unused_parameters there is
  /// nothing to skip (the buckets are rebuilt once either way).
  TORCH_ARG(bool, static_graph) = false;
};

/// Averages the gradients of `params` across `group` during each backward.
/// DistributedDataParallel owns one; use it directly to add data parallelism
/// to parameters that are not one module's.
///
/// The hooks, the launch order, the end of backward and the guards belong to
/// the engine shared with FSDP (src/gradient_sync_engine.h), which schedules
/// and reduces nothing itself; the reducer is its reduction policy for DDP:
/// which gradients share a bucket, how a gradient enters its bucket, how a
/// bucket is reduced (the comm hook) and how the result goes back into .grad.
class BucketReducer : private detail::ReductionPolicy {
 public:
  /// `params` are the parameters to average, `names` their names for errors.
  BucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names, std::shared_ptr<ProcessGroup> group,
                ReducerOptions options = {});
  ~BucketReducer() override;
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  /// Called after each forward with its outputs: with find_unused_parameters
  /// it walks the autograd graph so parameters that cannot get a gradient
  /// are marked ready as soon as backward starts.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  /// Called before each forward: fails clearly if the previous backward
  /// never finished (an exception inside it), since this rank's collectives
  /// may then be out of step with the other ranks'.
  void prepare_for_forward();

  /// Prints `warning` once if a backward pass starts with no
  /// prepare_for_forward() since the last one: DistributedDataParallel uses
  /// it to say that a forward bypassed it and skipped the buffer broadcast.
  void warn_on_backward_without_forward(std::string warning);

  /// For a rank that ran out of data (Join): takes part in the other ranks'
  /// gradient all-reduces with zeros, in the same order (the engine's launch
  /// order), without touching this rank's gradients.
  void shadow_backward();

  /// Off: backward only accumulates local gradients (DDP's no_sync()).
  void set_require_sync(bool require_sync);
  bool require_sync() const;

  /// Parameter indices of each bucket, in launch order.
  const std::vector<std::vector<size_t>>& bucket_assignment() const;
  /// Number of backward passes whose gradients were averaged.
  int64_t reduced_steps() const { return reduced_steps_; }
  /// Whether the buckets were regrouped after the first iteration.
  bool buckets_rebuilt() const { return buckets_rebuilt_; }
  /// With ReducerOptions::carry_loss: `loss` (this rank's, a one-element
  /// tensor) rides on the next synchronised backward's last bucket.
  void note_loss(const at::Tensor& loss);
  /// What the last synchronised backward carried (see ReducedLoss).
  const ReducedLoss& reduced_loss() const { return reduced_loss_; }
  /// Steps `optimizer` inside each synchronised backward, one bucket at a
  /// time: as soon as a bucket's averaged gradients are back in .grad,
  /// optimizer->step() runs over that bucket's parameters alone, while the
  /// later buckets are still on the wire. On a slow link the optimizer's
  /// time then hides behind communication instead of following it (PyTorch
  /// has this as DDP's fused optimizer and _apply_optimizer_in_backward).
  /// Per parameter the update is exactly optimizer.step()'s after backward,
  /// since LibTorch's optimizers skip parameters without a gradient and
  /// keep their state per parameter. Then do not call optimizer.step()
  /// yourself; no_sync() passes still only accumulate. Every parameter
  /// of `optimizer` must be one of this reducer's. Not with carry_loss, nor
  /// with anything that must see every gradient before the step: GradScaler
  /// refuses such an optimizer, and ddp::clip_grad_norm_ such a model. The
  /// optimizer must outlive the reducer or be unset first; null turns
  /// stepping off.
  void step_in_backward(torch::optim::Optimizer* optimizer);
  /// The optimizer backward steps (step_in_backward), or null.
  torch::optim::Optimizer* optimizer_in_backward() const { return optimizer_in_backward_; }
  /// The flat gradient buffer of bucket `index` (for inspection and tests).
  const at::Tensor& bucket_buffer(size_t index) const { return buckets_.at(index).flat; }

 private:
  struct Bucket {
    std::vector<int64_t> offsets;  // element offset of each param in `flat`
    at::Tensor flat;               // contiguous gradients of the bucket
    // `flat` followed by the loss rider's world size + 1 elements
    // (carry_loss), or `flat` itself.
    at::Tensor sent;
    std::vector<at::Tensor> gradient_views;  // each parameter's slot of `flat`, in its shape
  };

  // detail::ReductionPolicy: the engine calls these during backward.
  std::vector<size_t> on_round_start(bool synchronised) override;
  void on_gradient_ready(size_t param, bool has_gradient) override;
  c10::intrusive_ptr<c10::ivalue::Future> launch_group(size_t bucket) override;
  c10::intrusive_ptr<c10::ivalue::Future> launch_shadow_group(size_t bucket) override;
  void before_waiting(const std::vector<char>& used_locally) override;
  void finish_group(size_t bucket, const at::Tensor& result) override;
  void on_round_end(bool synchronised) override;
  std::string group_label(size_t bucket) const override;
  std::string collective_tag(size_t bucket) const override;

  void build_buckets(const std::vector<std::vector<size_t>>& assignment);
  at::Tensor slot_of(size_t param_index);
  /// Bucket b's gradients as views of `buffer`, in the parameters' shapes.
  std::vector<at::Tensor> gradient_views(size_t b, const at::Tensor& buffer) const;
  void maybe_rebuild_buckets();
  // carry_loss: the bucket whose all-reduce carries the loss (launched last).
  bool carries_loss(size_t b) const { return options_.carry_loss() && b + 1 == buckets_.size(); }
  void write_rider(const at::Tensor& rider);
  void step_optimizer_over_bucket(size_t b);
  void read_rider(const at::Tensor& rider);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  ReducerOptions options_;
  std::shared_ptr<CommHook> comm_hook_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_param_;
  std::vector<size_t> position_in_bucket_;
  std::vector<size_t> ready_order_;  // first iteration's, for rebuilding
  at::Tensor used_anywhere_;         // find_unused_parameters: per parameter, this pass
  at::Tensor world_size_;  // 0-dim, the divisor of every gradient
  bool forward_seen_ = false;
  bool warned_missing_forward_ = false;
  std::string missing_forward_warning_;
  bool buckets_rebuilt_ = false;
  int64_t reduced_steps_ = 0;
  // static_graph: the first iteration's unreachable parameters and used flags.
  std::optional<std::vector<size_t>> static_unreachable_;
  at::Tensor static_used_anywhere_;
  at::Tensor noted_loss_;      // carry_loss: this rank's, for the next synchronised backward
  ReducedLoss reduced_loss_;   // what the last one carried
  torch::optim::Optimizer* optimizer_in_backward_ = nullptr;
  // step_in_backward: each parameter's index in params_, by tensor.
  std::unordered_map<const c10::TensorImpl*, size_t> param_index_;
  std::unique_ptr<detail::GradientSyncEngine> engine_;  // last: its hooks call the members above
};

/// The old name, kept for existing code: "gradient reducer" did not say which
/// of the engine and its policy reduces.
using GradientReducer [[deprecated("renamed ddp::BucketReducer (<ddp/bucket_reducer.h>)")]] = BucketReducer;

}  // namespace ddp
