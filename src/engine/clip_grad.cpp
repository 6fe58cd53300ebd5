#include <ddp/clip_grad.h>

#include <ddp/collective_trace.h>
#include <ddp/error.h>

#include <ATen/Functions.h>

#include <cmath>
#include <limits>
#include <string>

namespace ddp::detail {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

std::vector<at::Tensor> gradients_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

// Every rank holds the whole gradient: LibTorch's own arithmetic, tensor for
// tensor, so the result is bit-identical to torch::nn::utils::clip_grad_norm_.
at::Tensor replicated_norm(const std::vector<at::Tensor>& grads, double norm_type) {
  std::vector<at::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) {
    norms.push_back(norm_type == kInfinity ? g.detach().abs().max() : g.detach().norm(norm_type));
  }
  if (norms.size() == 1) return norms[0];
  return norm_type == kInfinity ? at::stack(norms).max() : at::stack(norms).norm(norm_type);
}

// Each rank holds a disjoint part of the gradient: the parts' sums of
// |g|^p (or their maxima) are combined across the ranks, in double. The
// per-tensor norms stay on their device until the one all-reduce, so a step
// waits for the device once, not once per unit.
double sharded_norm(const std::vector<at::Tensor>& grads, ProcessGroup& group, double norm_type) {
  const auto options = group.control_options().dtype(at::kDouble);
  std::vector<at::Tensor> norms;
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;
    norms.push_back(norm_type == kInfinity ? g.detach().abs().max() : g.detach().norm(norm_type));
  }
  at::Tensor parts = norms.empty() ? at::zeros({0}, options) : at::stack(norms).to(options);
  CollectiveTag tag("clip_grad_norm");
  if (norm_type == kInfinity) {
    // Gloo's MAX need not carry a NaN through, so whether any rank saw one
    // travels beside the maximum.
    const at::Tensor nan = parts.isnan();
    // Norms are never negative, so 0 stands in for a NaN and for no tensor.
    const at::Tensor largest = parts.numel() == 0 ? at::zeros({}, options) : parts.masked_fill(nan, 0).max();
    at::Tensor both = at::stack({largest, nan.any().to(at::kDouble)});
    group.all_reduce(both, c10d::ReduceOp::MAX);
    both = both.cpu();
    return both[1].item<double>() > 0 ? std::numeric_limits<double>::quiet_NaN() : both[0].item<double>();
  }
  // A sum carries NaN and infinity through by itself.
  at::Tensor sum = parts.pow(norm_type).sum().reshape({1});
  group.all_reduce(sum, c10d::ReduceOp::SUM);
  return std::pow(sum.cpu().item<double>(), 1.0 / norm_type);
}

}  // namespace

double clip_grad_norm(const std::vector<at::Tensor>& params, ProcessGroup* shard_group, double max_norm,
                      double norm_type, NonFinitePolicy policy) {
  DDP_CHECK(norm_type == kInfinity || (std::isfinite(norm_type) && norm_type > 0), "ddp: clip_grad_norm_ got norm_type ",
            norm_type, "; use a positive order such as 2.0, or std::numeric_limits<double>::infinity() for the largest "
            "magnitude");
  DDP_CHECK(std::isfinite(max_norm) && max_norm >= 0, "ddp: clip_grad_norm_ got max_norm ", max_norm,
            "; use a finite, non-negative bound");
  const std::vector<at::Tensor> grads = gradients_of(params);
  // A sharded norm is collective: every rank takes part, even one whose
  // shards got no gradient.
  if (grads.empty() && shard_group == nullptr) return 0.0;

  at::Tensor coefficient;
  double total = 0.0;
  if (shard_group == nullptr) {
    at::Tensor norm = replicated_norm(grads, norm_type);
    total = norm.item<double>();
    coefficient = at::clamp(max_norm / (norm + 1e-6), std::nullopt, 1.0);
  } else {
    total = sharded_norm(grads, *shard_group, norm_type);
    coefficient = at::scalar_tensor(std::min(1.0, max_norm / (total + 1e-6)), at::kDouble);
  }
  // The total is the same on every rank (the same averaged bits, or the same
  // all-reduced sum), so every rank takes this branch together.
  if (!std::isfinite(total)) {
    DDP_CHECK(policy != NonFinitePolicy::kAbort, "ddp: the total gradient norm is ", total,
              " (not finite) on every rank; every rank stops. Lower the learning rate, check the data, "
              "or pass NonFinitePolicy::kSkipStep to leave the gradients alone and skip the step.");
    return total;
  }
  for (auto& g : grads) {
    at::Tensor grad = g.detach();
    grad.mul_(coefficient.to(grad.device()));
  }
  return total;
}

void refuse_clipping_after_step_in_backward(bool steps_optimizer_in_backward) {
  DDP_CHECK(!steps_optimizer_in_backward, "ddp: clip_grad_norm_ on a model whose optimizer is "
            "stepped inside backward (step_in_backward): the step has already used the unclipped gradients. "
            "Call model.stop_stepping_in_backward() and step the optimizer yourself after clipping");
}

}  // namespace ddp::detail
