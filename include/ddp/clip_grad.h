#pragma once

// Gradient clipping by the norm of the whole model's gradient, across ranks.
//
//   loss.backward();
//   double norm = ddp::clip_grad_norm_(model, 1.0);   // DDP, FSDP (any strategy)
//   if (std::isfinite(norm)) optimizer.step();
//
// Why not torch::nn::utils::clip_grad_norm_(model.parameters(), ...): under
// FSDP's FULL_SHARD and SHARD_GRAD_OP each rank holds only its shard of every
// gradient, so LibTorch's function computes each rank's own partial norm and
// every rank clips by a different factor. Nothing fails; the ranks' steps
// silently stop being DDP's. Here the partial sums are combined across the
// ranks first (one all-reduce of one number), so every rank clips by the
// factor of the full gradient, exactly as one process with the whole model
// would. Under DDP, ZeRO-1 (clip the DDP model before ZeroRedundancyOptimizer's
// step) and FSDP's NO_SHARD every rank holds the whole averaged gradient, the
// same bits on every rank, so no collective is needed and the result is
// LibTorch's.
//
// The arithmetic is LibTorch's: the norm of order `norm_type` of all
// gradients together (infinity: the largest magnitude), then every gradient
// multiplied by min(1, max_norm / (norm + 1e-6)).

#include <ddp/export.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace ddp {

namespace detail {
/// Clips the gradients of `params` (those that have one) by the norm of the
/// whole gradient. `shard_group`: the group across which the gradients are
/// sharded (each rank holds a disjoint part of the whole), or nullptr when
/// every rank holds all of it.
DDP_API double clip_grad_norm(const std::vector<at::Tensor>& params, ProcessGroup* shard_group, double max_norm,
                              double norm_type, NonFinitePolicy policy);
/// Throws if the model steps an optimizer inside backward: the step has
/// then already happened, and clipping afterwards would change nothing.
DDP_API void refuse_clipping_after_step_in_backward(bool steps_optimizer_in_backward);
}  // namespace detail

/// Clips a DDP model's averaged gradients (also the way to clip under
/// ZeRO-1). Returns the total norm, the same on every rank. A total norm that
/// is not finite follows `policy` as check_loss_is_finite does, on every rank
/// alike: kSkipStep leaves the gradients as they are and returns the
/// non-finite norm (skip optimizer.step() then); kAbort throws.
template <typename M>
double clip_grad_norm_(DistributedDataParallel<M>& model, double max_norm, double norm_type = 2.0,
                       NonFinitePolicy policy = NonFinitePolicy::kSkipStep) {
  detail::refuse_clipping_after_step_in_backward(model.steps_optimizer_in_backward());
  return detail::clip_grad_norm(model.parameters(), nullptr, max_norm, norm_type, policy);
}

/// Clips an FSDP model's gradients by the norm of the full (unsharded)
/// gradient, for every sharding strategy and mixed precision (the shards'
/// gradients are in the shards' own dtype). Collective under FULL_SHARD and
/// SHARD_GRAD_OP: every rank must call it. Returns the total norm, the same
/// on every rank; a non-finite one follows `policy` as above.
template <typename M>
double clip_grad_norm_(FullyShardedDataParallel<M>& model, double max_norm, double norm_type = 2.0,
                       NonFinitePolicy policy = NonFinitePolicy::kSkipStep) {
  // Under HSDP the replicas hold the same shards: the norm is summed over
  // one shard group only.
  ProcessGroup* shard_group =
      model.sharding_strategy() == ShardingStrategy::kNoShard ? nullptr : model.shard_group().get();
  return detail::clip_grad_norm(model.parameters(), shard_group, max_norm, norm_type, policy);
}

}  // namespace ddp
