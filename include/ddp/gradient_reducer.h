#pragma once

// The gradient engine: averages every parameter's gradient across ranks during
// backward. Parameters are grouped into buckets (bucket_assignment.h); a hook
// on each parameter's gradient accumulator copies the fresh gradient into its
// bucket, and a full bucket is handed to the communication hook (by default
// an async all-reduce) at once, in bucket order, while backward goes on
// computing earlier layers. When backward ends, a callback waits for every
// bucket and writes the averages back into .grad.

#include <ddp/comm_hooks.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace ddp {

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
};

/// Averages the gradients of `params` across `group` during each backward.
/// DistributedDataParallel owns one; use it directly to add data parallelism
/// to parameters that are not one module's.
class GradientReducer {
 public:
  /// `params` are the parameters to average, `names` their names for errors.
  GradientReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                  std::shared_ptr<ProcessGroup> group, ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

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
  /// gradient all-reduces with zeros, in the same order, without touching
  /// this rank's gradients.
  void shadow_backward();

  /// Off: backward only accumulates local gradients (DDP's no_sync()).
  void set_require_sync(bool require_sync) { require_sync_ = require_sync; }
  bool require_sync() const { return require_sync_; }

  /// Parameter indices of each bucket, in launch order.
  const std::vector<std::vector<size_t>>& bucket_assignment() const { return assignment_; }
  /// Number of backward passes whose gradients were averaged.
  int64_t reduced_steps() const { return reduced_steps_; }
  /// Whether the buckets were regrouped after the first iteration.
  bool buckets_rebuilt() const { return buckets_rebuilt_; }
  /// The flat gradient buffer of bucket `index` (for inspection and tests).
  const at::Tensor& bucket_buffer(size_t index) const { return buckets_.at(index).flat; }

 private:
  struct Bucket {
    std::vector<size_t> params;    // indices into params_
    std::vector<int64_t> offsets;  // element offset of each param in `flat`
    at::Tensor flat;               // contiguous gradients of the bucket
    size_t pending = 0;            // gradients not yet in `flat` this round
    c10::intrusive_ptr<c10::ivalue::Future> reduced;
  };

  void build_buckets(const std::vector<std::vector<size_t>>& assignment);
  at::Tensor slot_of(size_t param_index);
  void on_gradient_ready(size_t param_index);
  void mark_ready(size_t param_index, bool has_gradient);
  void launch_full_buckets_in_order();
  void finish_backward();
  void start_round();
  void maybe_rebuild_buckets();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  ReducerOptions options_;
  std::shared_ptr<CommHook> comm_hook_;
  std::vector<std::vector<size_t>> assignment_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_param_;
  std::vector<size_t> position_in_bucket_;
  std::vector<char> ready_;
  std::vector<char> used_locally_;      // got a gradient from this backward
  std::vector<char> used_since_sync_;   // got one in a no_sync() backward since
  std::vector<size_t> unused_after_forward_;
  std::vector<size_t> ready_order_;     // first iteration's, for rebuilding
  // The accumulators are owned weakly by their parameters; holding them keeps
  // our hooks attached for as long as the reducer lives.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  at::Tensor world_size_;  // 0-dim, the divisor of every gradient
  std::mutex mutex_;  // hooks of different devices run on different threads
  bool require_sync_ = true;
  bool forward_seen_ = false;
  bool warned_missing_forward_ = false;
  std::string missing_forward_warning_;
  bool round_active_ = false;
  bool buckets_rebuilt_ = false;
  size_t next_bucket_to_launch_ = 0;
  int64_t reduced_steps_ = 0;
};

}  // namespace ddp
