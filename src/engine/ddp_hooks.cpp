#include "engine/ddp_hooks.h"

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <torch/optim/optimizer.h>

#include <utility>
#include <vector>

namespace ddp::detail {
namespace {

// Each gradient of `bucket` as a view of `flat`, which begins with the
// bucket's buffer.
std::vector<at::Tensor> gradients_in(GradBucket& bucket, const at::Tensor& flat) {
  std::vector<at::Tensor> views;
  for (const at::Tensor& g : bucket.gradients()) {
    views.push_back(flat.narrow(0, g.storage_offset() - bucket.buffer().storage_offset(), g.numel()).view(g.sizes()));
  }
  return views;
}

// A hook's result: a tensor, or a list whose first element is it.
at::Tensor tensor_of(const c10::IValue& value) {
  return value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
}

}  // namespace

LossRiderHook::LossRiderHook(std::shared_ptr<CommHook> inner) : inner_(std::move(inner)) {}

void LossRiderHook::note_loss(const at::Tensor& loss) {
  DDP_CHECK(loss.numel() == 1, "ddp: note_loss takes the loss itself, one element; got ", loss.numel());
  noted_loss_ = loss.detach().reshape({1});
}

c10::intrusive_ptr<c10::ivalue::Future> LossRiderHook::run(ProcessGroup& group, GradBucket& bucket) {
  if (!bucket.is_last()) return inner_->run(group, bucket);
  DDP_CHECK(!bucket.scatters(), "ddp: the loss rides on DDP's all-reduced buckets, not on a reduce-scatter");
  // Slots [0, world) are one flag per rank, slot `world` the loss divided by
  // the world size; summed over ranks they are the ranks with a non-finite
  // loss and the average loss. Written on the device, so nothing waits here.
  const int world = group.size();
  at::Tensor rider = at::zeros({world + 1}, bucket.buffer().options());
  const bool noted = noted_loss_.defined();
  if (noted) {
    at::Tensor loss = noted_loss_.to(rider.device(), rider.scalar_type());
    at::Tensor finite = at::isfinite(loss);
    rider.narrow(0, group.rank(), 1).copy_(finite.logical_not());
    rider.narrow(0, world, 1).copy_(at::where(finite, loss, at::zeros_like(loss)) / world);
    noted_loss_.reset();
  }
  at::Tensor buffer = bucket.buffer();
  at::Tensor sent = at::cat({buffer, rider});
  std::vector<at::Tensor> gradients = gradients_in(bucket, sent);
  GradBucket carrying(bucket.index(), sent, /*is_last=*/true, {}, bucket.gradients().empty() ? nullptr : &gradients,
                      &bucket.parameters());
  return inner_->run(group, carrying)->then(
      [this, sent, buffer, noted, world](c10::ivalue::Future& done) -> c10::IValue {
        const at::Tensor reduced = tensor_of(done.value());
        const int64_t n = buffer.numel();
        buffer.copy_(reduced.narrow(0, 0, n));
        at::Tensor values = reduced.narrow(0, n, world + 1).to(at::kCPU, at::kDouble);
        const double* data = values.data_ptr<double>();
        ReducedLoss loss;
        loss.valid = noted;
        for (int r = 0; r < world; ++r) {
          if (data[r] != 0) loss.nonfinite_ranks.push_back(r);
        }
        loss.average = data[world];
        reduced_loss_ = std::move(loss);
        return buffer;
      },
      c10::TensorType::get());
}

OptimizerStepHook::OptimizerStepHook(std::shared_ptr<CommHook> inner, torch::optim::Optimizer& optimizer,
                                     const std::vector<at::Tensor>& model_params)
    : inner_(std::move(inner)), optimizer_(optimizer) {
  for (const auto& p : model_params) model_params_.insert(p.unsafeGetTensorImpl());
}

c10::intrusive_ptr<c10::ivalue::Future> OptimizerStepHook::run(ProcessGroup& group, GradBucket& bucket) {
  // Join's shadow pass mirrors the others' reductions and updates nothing.
  if (bucket.parameters().empty()) return inner_->run(group, bucket);
  std::vector<at::Tensor> params = bucket.parameters();
  // A parameter without a gradient here that gets none from any rank either
  // keeps no gradient, as the reducer leaves it.
  std::vector<char> had_gradient;
  for (const auto& p : params) had_gradient.push_back(p.grad().defined() ? 1 : 0);
  at::Tensor buffer = bucket.buffer();
  std::vector<int64_t> offsets;
  for (const at::Tensor& g : bucket.gradients()) offsets.push_back(g.storage_offset() - buffer.storage_offset());
  return inner_->run(group, bucket)->then(
      [this, params = std::move(params), had_gradient = std::move(had_gradient), offsets = std::move(offsets)](
          c10::ivalue::Future& done) -> c10::IValue {
        const at::Tensor reduced = tensor_of(done.value());
        {
          // The bucket's parameters are final: autograd no longer touches
          // their .grad in this pass, so the average can go there now.
          at::NoGradGuard no_grad;
          const at::Tensor flat = reduced.view(-1);
          for (size_t i = 0; i < params.size(); ++i) {
            at::Tensor average = flat.narrow(0, offsets[i], params[i].numel()).view(params[i].sizes());
            at::Tensor& grad = params[i].mutable_grad();
            if (grad.defined()) {
              if (grad.data_ptr() != average.data_ptr()) grad.copy_(average);
            } else if (had_gradient[i] || average.any().item<bool>()) {
              grad = average.clone();
            }
          }
        }
        step(params);
        return reduced;
      },
      c10::TensorType::get());
}

// LibTorch's optimizers step the parameters of their groups and keep their
// state per parameter, so narrowing each group to this bucket's parameters
// for one step() updates exactly them, each as a step after backward would.
// No .grad is touched: later buckets' gradients may still be accumulating.
void OptimizerStepHook::step(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::unordered_set<const c10::TensorImpl*> in_bucket;
  for (const auto& p : params) in_bucket.insert(p.unsafeGetTensorImpl());
  auto& groups = optimizer_.param_groups();
  // Only a foreign parameter's .grad is read: the model's may still be
  // written by autograd on another thread.
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      DDP_CHECK(model_params_.count(p.unsafeGetTensorImpl()) || !p.grad().defined(),
                "ddp: a parameter added to the optimizer after step_in_backward is not this model's, and no bucket "
                "would ever step it; step that parameter group with an optimizer of its own");
    }
  }
  std::vector<std::vector<at::Tensor>> all(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> mine;
    for (const auto& p : groups[g].params()) {
      if (in_bucket.count(p.unsafeGetTensorImpl())) mine.push_back(p);
    }
    all[g] = std::exchange(groups[g].params(), std::move(mine));
  }
  auto restore = [&] {
    for (size_t g = 0; g < groups.size(); ++g) groups[g].params() = std::move(all[g]);
  };
  try {
    optimizer_.step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace ddp::detail
