#pragma once

// The gradient engine: averages every parameter's gradient across ranks during
// backward. Parameters are grouped into buckets (bucket_assignment.h); a hook
// on each parameter's gradient accumulator copies the fresh gradient into its
// bucket, and a full bucket's all-reduce starts at once, in bucket order, while
// backward goes on computing earlier layers. When backward ends, a callback
// waits for the buckets and writes the averages back into .grad.

#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace ddp {

/// How gradients are bucketed.
struct ReducerOptions {
  /// Cap of every bucket after the first, in MiB (PyTorch's default).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Cap of the first bucket, in MiB: small, so communication starts early.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
};

class GradientReducer {
 public:
  /// `params` are the parameters to average, `names` their names for errors.
  GradientReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                  std::shared_ptr<ProcessGroup> group, ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Parameter indices of each bucket, in launch order.
  const std::vector<std::vector<size_t>>& bucket_assignment() const { return assignment_; }
  /// Number of backward passes whose gradients were averaged.
  int64_t reduced_steps() const { return reduced_steps_; }

 private:
  struct Bucket {
    std::vector<size_t> params;    // indices into params_
    std::vector<int64_t> offsets;  // element offset of each param in `flat`
    at::Tensor flat;               // contiguous gradients of the bucket
    size_t pending = 0;            // gradients not yet copied in this round
    c10::intrusive_ptr<c10d::Work> work;
  };

  void on_gradient_ready(size_t param_index);
  void launch_full_buckets_in_order();
  void finish_backward();
  void start_round();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  std::vector<std::vector<size_t>> assignment_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_param_;
  std::vector<size_t> position_in_bucket_;
  std::vector<char> ready_;
  // The accumulators are owned weakly by their parameters; holding them keeps
  // our hooks attached for as long as the reducer lives.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  bool round_active_ = false;
  size_t next_bucket_to_launch_ = 0;
  int64_t reduced_steps_ = 0;
};

}  // namespace ddp
