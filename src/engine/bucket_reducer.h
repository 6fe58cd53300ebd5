#pragma once

// Internal to src/: DDP's gradient averaging, the gradient engine's
// (gradient_sync_engine.h) reduction policy for DistributedDataParallel.
// Parameters are grouped into buckets (bucket_assignment.h), each laid out
// flat (flat_layout.h). As each gradient becomes final it is copied into its
// bucket, divided by the world size; a full bucket is all-reduced at once, in
// bucket order, while backward goes on computing earlier layers, or handed to
// the comm hook when one is set. When backward ends, the engine waits for
// every bucket and the averages go back into .grad.
//
// So the reducer lays out, flattens, launches and writes back. Every other
// behaviour (compression, PowerSGD, the loss rider, the optimizer step in
// backward) is a comm hook that DistributedDataParallel composes.

#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

#include "common/flat_layout.h"
#include "engine/bucket_sizing.h"
#include "engine/gradient_sync_engine.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

/// Averages the gradients of `params` across `group` during each backward.
/// DistributedDataParallel owns one (through DdpRuntime). It reads the
/// bucketing options of DDPOptions (bucket caps, bucket_sizing.h's rules;
/// find_unused_parameters,
/// gradient_as_bucket_view, rebuild_buckets, overlap_with_backward,
/// static_graph, comm_hook) and ignores the rest.
class BucketReducer : private ReductionPolicy {
 public:
  /// `params` are the parameters to average, `names` their names for errors.
  BucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names, std::shared_ptr<ProcessGroup> group,
                DDPOptions options = {});
  ~BucketReducer() override = default;
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
  void shadow_backward() { engine_->shadow_round(); }

  /// Off: backward only accumulates local gradients (DDP's no_sync()).
  void set_require_sync(bool require_sync) { engine_->set_require_sync(require_sync); }
  bool require_sync() const { return engine_->require_sync(); }
  /// Replaces the comm hook (null: the plain all-reduce); not during a
  /// backward pass. DistributedDataParallel composes its hooks here.
  void set_comm_hook(std::shared_ptr<CommHook> hook);

  /// The parameters this reducer averages.
  const std::vector<at::Tensor>& params() const { return params_; }
  /// Parameter indices of each bucket, in launch order.
  const std::vector<std::vector<size_t>>& bucket_assignment() const { return engine_->groups(); }
  /// Number of backward passes whose gradients were averaged.
  int64_t reduced_steps() const { return reduced_steps_; }
  /// Whether the buckets were regrouped after the first iteration.
  bool buckets_rebuilt() const { return buckets_rebuilt_; }
  /// The cap of every bucket after the first, in bytes (fitted to the link
  /// once buckets are rebuilt, when the options set none).
  size_t bucket_cap_bytes() const { return caps_.bytes; }
  /// The figures the cap was fitted to, once it was.
  const std::optional<LinkMeasurement>& link_measurement() const { return link_; }
  /// The flat gradient buffer of bucket `index` (for inspection and tests).
  const at::Tensor& bucket_buffer(size_t index) const { return buckets_.at(index).flat; }

 private:
  struct Bucket {
    FlatLayout layout;                  // where each parameter's gradient lies in `flat`
    at::Tensor flat;                    // contiguous gradients of the bucket
    std::vector<at::Tensor> gradients;  // layout.views(flat): each parameter's slot, in its shape
    std::vector<at::Tensor> params;     // the parameters of those slots
  };

  // ReductionPolicy: the engine calls these during backward.
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
  /// Parameter `param`'s slot of its bucket.
  at::Tensor slot_of(size_t param) const {
    return buckets_[bucket_of_param_[param]].gradients[position_in_bucket_[param]];
  }
  void maybe_rebuild_buckets();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  BucketCaps caps_;
  std::optional<LinkMeasurement> link_;
  // First iteration: the backward window that buckets can hide behind.
  std::chrono::steady_clock::time_point first_gradient_at_, last_gradient_at_;
  std::shared_ptr<CommHook> comm_hook_;  // null: the plain all-reduce, called directly
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
  std::unique_ptr<GradientSyncEngine> engine_;  // last: its hooks call the members above
};

}  // namespace ddp::detail
