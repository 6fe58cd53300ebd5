#pragma once

// Internal: the hooks DistributedDataParallel composes around the comm hook
// (DDPOptions::comm_hook, or the plain all-reduce) from what the user asks
// for. Each acts on a bucket's future, so BucketReducer only lays out,
// flattens, launches and writes back, and knows neither the loss nor the
// optimizer.

#include <ddp/comm_hooks.h>
#include <ddp/nonfinite.h>

#include <ATen/core/Tensor.h>

#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp::detail {

/// DDPOptions::carry_loss: this rank's loss rides on the last bucket's
/// reduction as world size + 1 extra elements (a non-finite flag per rank and
/// the loss divided by the world size), so that the non-finite check and the
/// averaged loss cost no collective of their own.
class LossRiderHook : public CommHook {
 public:
  explicit LossRiderHook(std::shared_ptr<CommHook> inner);
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override;
  /// `loss` (one element) rides on the next synchronised backward.
  void note_loss(const at::Tensor& loss);
  /// What the last synchronised backward carried.
  const ReducedLoss& reduced_loss() const { return reduced_loss_; }

 private:
  std::shared_ptr<CommHook> inner_;
  at::Tensor noted_loss_;
  ReducedLoss reduced_loss_;  // written by the last bucket's continuation; backward waits for it
};

/// DistributedDataParallel::step_in_backward, as PyTorch's
/// _hook_then_optimizer: as soon as a bucket's average arrives, the
/// optimizer steps that bucket's parameters alone (a continuation of the
/// inner hook's future), while later buckets are still on the wire.
class OptimizerStepHook : public CommHook {
 public:
  /// `model_params` are every parameter the buckets hold: one of the
  /// optimizer's outside them would never be stepped.
  OptimizerStepHook(std::shared_ptr<CommHook> inner, torch::optim::Optimizer& optimizer,
                    const std::vector<at::Tensor>& model_params);
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override;

 private:
  void step(const std::vector<at::Tensor>& params);

  std::shared_ptr<CommHook> inner_;
  torch::optim::Optimizer& optimizer_;
  std::unordered_set<const c10::TensorImpl*> model_params_;
  std::mutex mutex_;  // continuations of different buckets may complete on different threads
};

}  // namespace ddp::detail
