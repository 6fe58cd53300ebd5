#include <ddp/grad_scaler.h>

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <utility>
#include <vector>

namespace ddp {

GradScaler::GradScaler(GradScalerOptions options, std::shared_ptr<ProcessGroup> group)
    : options_(options), group_(std::move(group)) {
  DDP_CHECK(options_.init_scale() > 0, "ddp: GradScaler init_scale must be positive, got ", options_.init_scale());
  DDP_CHECK(options_.growth_factor() > 1.0, "ddp: GradScaler growth_factor must be > 1, got ",
              options_.growth_factor());
  DDP_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0,
              "ddp: GradScaler backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  DDP_CHECK(options_.growth_interval() > 0, "ddp: GradScaler growth_interval must be positive, got ",
              options_.growth_interval());
}

void GradScaler::check_initialized(const char* caller) const {
  DDP_CHECK(scale_.defined(), "ddp: GradScaler::", caller, "() was called before any scale(): scale the loss ",
              "(scaler.scale(loss).backward()) earlier in the iteration");
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled()) return outputs;
  if (!scale_.defined()) {
    auto on = at::TensorOptions().device(outputs.device());
    scale_ = at::full({}, options_.init_scale(), on.dtype(at::kFloat));
    growth_tracker_ = at::full({}, init_growth_tracker_, on.dtype(at::kInt));
  }
  // non_blocking: a copy only when the outputs moved to another device.
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

void GradScaler::refuse_if_stepped_in_backward(bool stepped_in_backward, const char* method) {
  DDP_CHECK(!stepped_in_backward, "ddp: GradScaler::", method, "() got a model whose optimizer "
            "DistributedDataParallel already steps inside backward (step_in_backward), before its gradients could "
            "be unscaled or an inf/NaN step skipped; use one or the other: model.stop_stepping_in_backward() to "
            "keep GradScaler");
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  check_initialized("unscale_");
  OptimizerState& state = per_optimizer_[&optimizer];
  DDP_CHECK(state.stage != Stage::kUnscaled, "ddp: GradScaler::unscale_() has already been called on this ",
              "optimizer since the last update(); call it at most once per iteration");
  DDP_CHECK(state.stage != Stage::kStepped, "ddp: GradScaler::unscale_() is being called after step(); ",
              "unscale before stepping, and call update() to start the next iteration");

  // The reciprocal in double, as in Python: 1/scale is exact in float32 for
  // powers of two, and as close as possible otherwise.
  at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  // The kernel takes one device and dtype per call; found_inf and inv_scale
  // must be on that device.
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      at::Tensor& grad = param.mutable_grad();
      if (!grad.defined()) continue;
      DDP_CHECK(grad.layout() == c10::kStrided, "ddp: GradScaler cannot unscale sparse gradients; use dense ",
                  "gradients (e.g. Embedding with sparse=false)");
      groups[{grad.device().str(), static_cast<int>(grad.scalar_type())}].push_back(grad);
    }
  }
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> per_device;  // found_inf, inv_scale
  for (auto& [key, grads] : groups) {
    c10::Device device = grads.front().device();
    auto it = per_device.find(key.first);
    if (it == per_device.end()) {
      at::Tensor found = at::zeros({}, at::TensorOptions().device(device).dtype(at::kFloat));
      it = per_device.emplace(key.first, std::make_pair(found, inv_scale.to(device, /*non_blocking=*/true))).first;
    }
    at::_amp_foreach_non_finite_check_and_unscale_(grads, it->second.first, it->second.second);
  }
  at::Tensor found_inf = at::zeros({}, scale_.options());
  for (auto& [device, tensors] : per_device) found_inf.add_(tensors.first.to(scale_.device(), /*non_blocking=*/true));

  if (group_ && group_->size() > 1) {
    // Every rank must skip together: a rank that stepped while another
    // skipped would leave the replicas different for good. With NCCL this
    // stays on the GPU; step() reads the result.
    at::Tensor sent = group_->to_control(found_inf);
    CollectiveTag tag("grad scaler inf check");
    group_->all_reduce(sent, c10d::ReduceOp::MAX);
    found_inf = sent.to(scale_.device());
  }
  state.found_inf = found_inf;
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  check_initialized("step");
  OptimizerState& state = per_optimizer_[&optimizer];
  DDP_CHECK(state.stage != Stage::kStepped, "ddp: GradScaler::step() has already been called since the last ",
              "update(); call update() once per iteration");
  if (state.stage == Stage::kReady) unscale_(optimizer);
  OptimizerState& unscaled = per_optimizer_[&optimizer];
  // The one host sync of the iteration: whether to step is a host decision.
  bool stepped = unscaled.found_inf.item<float>() == 0.0f;
  if (stepped) optimizer.step();
  unscaled.stage = Stage::kStepped;
  return stepped;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  check_initialized("update");
  at::Tensor found_inf;
  for (auto& [optimizer, state] : per_optimizer_) {
    if (!state.found_inf.defined()) continue;
    found_inf = found_inf.defined() ? found_inf + state.found_inf : state.found_inf.clone();
  }
  DDP_CHECK(found_inf.defined(), "ddp: GradScaler::update() found no inf checks: call step() (or unscale_()) ",
              "on at least one optimizer before update()");
  // In place on the scale's device: no host sync.
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor(), options_.backoff_factor(),
                         options_.growth_interval());
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  check_initialized("update");
  DDP_CHECK(new_scale > 0, "ddp: GradScaler::update() needs a positive new scale, got ", new_scale);
  scale_.fill_(new_scale);
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

int64_t GradScaler::get_growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

c10::impl::GenericDict GradScaler::state_dict() const {
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  if (!options_.enabled()) return state;
  state.insert("scale", get_scale());
  state.insert("growth_factor", options_.growth_factor());
  state.insert("backoff_factor", options_.backoff_factor());
  state.insert("growth_interval", options_.growth_interval());
  state.insert("_growth_tracker", get_growth_tracker());
  return state;
}

void GradScaler::load_state_dict(const c10::impl::GenericDict& state) {
  if (!options_.enabled()) return;
  DDP_CHECK(!state.empty(), "ddp: GradScaler::load_state_dict() got an empty state, possibly saved from a ",
              "disabled GradScaler");
  auto number = [&](const char* key) {
    DDP_CHECK(state.contains(key), "ddp: GradScaler state has no '", key, "' entry");
    const c10::IValue& value = state.at(key);
    DDP_CHECK(value.isDouble() || value.isInt(), "ddp: GradScaler state entry '", key, "' must be a number, got ",
                value.tagKind());
    return value.isDouble() ? value.toDouble() : static_cast<double>(value.toInt());
  };
  GradScalerOptions loaded = options_;
  loaded.init_scale(number("scale"))
      .growth_factor(number("growth_factor"))
      .backoff_factor(number("backoff_factor"))
      .growth_interval(static_cast<int64_t>(number("growth_interval")));
  GradScaler validated(loaded);  // the constructor's checks, with their messages
  options_ = loaded;
  init_growth_tracker_ = static_cast<int64_t>(number("_growth_tracker"));
  if (scale_.defined()) scale_.fill_(options_.init_scale());
  if (growth_tracker_.defined()) growth_tracker_.fill_(init_growth_tracker_);
}

}  // namespace ddp
