#include "gradient_sync_engine.h"

#include <ddp/collective_trace.h>
#include <ddp/error.h>

#include "autograd_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

namespace ddp::detail {

c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(value);
  return future;
}

c10::intrusive_ptr<c10::ivalue::Future> ReductionPolicy::launch_shadow_group(size_t /*group*/) {
  DDP_CHECK(false, "ddp: this wrapper does not support Join (a rank without data mirroring the others)");
  return {};
}

GradientSyncEngine::GradientSyncEngine(std::vector<at::Tensor> params, std::vector<std::string> names,
                                       std::shared_ptr<ProcessGroup> group, ReductionPolicy& policy,
                                       EngineOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      policy_(policy),
      options_(std::move(options)) {
  DDP_CHECK(params_.size() == names_.size(), "ddp: the gradient engine needs one name per parameter");
  ready_.assign(params_.size(), 0);
  counted_unused_.assign(params_.size(), 0);
  used_locally_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
  if (options_.install_hooks) install_hooks();
}

void GradientSyncEngine::install_hooks() {
  if (!accumulators_.empty()) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    DDP_CHECK(accumulator, "ddp: parameter '", names_[i], "' has no gradient accumulator");
    hook_keys_.push_back(
        accumulator->add_post_hook(std::make_unique<GradientReadyHook>([this, i] { on_gradient_ready(i); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradientSyncEngine::~GradientSyncEngine() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void GradientSyncEngine::set_groups(std::vector<std::vector<size_t>> groups) {
  DDP_CHECK(!round_active_, "ddp: gradient groups cannot change during a backward pass");
  group_of_param_.assign(params_.size(), SIZE_MAX);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t p : groups[g]) {
      DDP_CHECK(p < params_.size() && group_of_param_[p] == SIZE_MAX, "ddp: parameter ", p,
                " is in no or several gradient groups");
      group_of_param_[p] = g;
    }
  }
  DDP_CHECK(std::find(group_of_param_.begin(), group_of_param_.end(), SIZE_MAX) == group_of_param_.end(),
            "ddp: every parameter needs a gradient group");
  groups_ = std::move(groups);
  pending_.assign(groups_.size(), 0);
  reductions_.assign(groups_.size(), {});
}

void GradientSyncEngine::find_unreachable(const std::vector<at::Tensor>& outputs) {
  unreachable_.clear();
  if (accumulators_.empty()) return;
  // Every gradient accumulator reachable from the outputs will fire; the
  // rest belong to parameters this forward did not use.
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  // No output to follow (a result type the wrapper cannot look into): the
  // parameters without gradients are found at the end of backward instead.
  if (stack.empty()) return;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& next : node->next_edges()) {
      if (next.function && seen.insert(next.function.get()).second) stack.push_back(next.function.get());
    }
  }
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (!seen.count(accumulators_[i].get())) unreachable_.push_back(i);
  }
}

void GradientSyncEngine::begin_round() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!round_active_) start_round();
}

void GradientSyncEngine::shadow_round() {
  std::lock_guard<std::mutex> lock(mutex_);
  DDP_CHECK(!round_active_, "ddp: Join cannot mirror the other ranks' step during this rank's own backward pass");
  // The launch order of a synchronised pass, as the other ranks' engines
  // issue it, so every collective meets its counterpart.
  const std::vector<size_t> order = policy_.on_round_start(/*synchronised=*/true);
  DDP_CHECK(order.size() == groups_.size(), "ddp: the launch order must name every gradient group once");
  for (size_t group : order) {
    CollectiveTag tag(policy_.collective_tag(group));
    reductions_[group] = policy_.launch_shadow_group(group);
  }
  policy_.before_waiting(std::vector<char>(params_.size(), 0));
  for (size_t group : order) {
    wait_for(group);
    reductions_[group].reset();
  }
  policy_.on_round_end(/*synchronised=*/true);
}

void GradientSyncEngine::check_previous_round_finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!round_active_ && !round_failed_) return;
  // The autograd engine never ran finish_round (backward threw part-way), or
  // a reduction failed inside it.
  round_active_ = false;
  round_failed_ = false;
  unreachable_.clear();
  DDP_CHECK(false, "ddp: the previous backward pass", options_.owner, " on rank ", group_->rank(),
            " did not finish (an error was raised inside it), so its gradient ", options_.collectives,
            " may not match the other ranks'. Stop this rank and restart the job (ddprun --max-restarts resumes ",
            "from the newest snapshot or checkpoint).");
}

void GradientSyncEngine::on_gradient_ready(size_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!round_active_) {
    if (!options_.rounds_start_on_first_gradient) return;  // a backward that did not start from our forward
    if (!require_sync_ && !options_.track_rounds_without_sync) {
      // no_sync(): gradients just accumulate locally; remember which exist,
      // so the next synchronised pass does not take them for unused.
      used_since_sync_[param] = 1;
      return;
    }
    start_round();
  }
  record_ready(param, /*has_gradient=*/true);
}

void GradientSyncEngine::start_round() {
  round_active_ = true;
  round_synchronised_ = require_sync_;
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(counted_unused_.begin(), counted_unused_.end(), 0);
  std::fill(used_locally_.begin(), used_locally_.end(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    pending_[g] = groups_[g].size();
    reductions_[g].reset();
  }
  launch_order_ = policy_.on_round_start(round_synchronised_);
  DDP_CHECK(launch_order_.size() == groups_.size(), "ddp: the launch order must name every gradient group once");
  next_to_launch_ = 0;
  // Runs on the autograd engine once the whole backward pass is done.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_round(); });
  auto unreachable = std::move(unreachable_);
  unreachable_.clear();
  for (size_t p : unreachable) record_ready(p, /*has_gradient=*/false);
}

void GradientSyncEngine::record_ready(size_t param, bool has_gradient) {
  DDP_CHECK(!(ready_[param] && counted_unused_[param]), "ddp: parameter '", names_[param],
            "' got a gradient, but the forward's outputs cannot reach it, so it was counted as unused (zeros) when ",
            "backward started. Compute the loss from the forward's result only, or return every tensor the loss ",
            "uses from the forward.");
  DDP_CHECK(!ready_[param], "ddp: the gradient of parameter '", names_[param],
            "' became ready twice in one backward pass; reentrant backward is not supported");
  ready_[param] = 1;
  counted_unused_[param] = has_gradient ? 0 : 1;
  const size_t group = group_of_param_[param];
  if (!round_synchronised_) {
    if (has_gradient) used_since_sync_[param] = 1;
    if (--pending_[group] == 0) policy_.on_group_complete_without_sync(group);
    return;
  }
  used_locally_[param] = has_gradient || used_since_sync_[param] ? 1 : 0;
  policy_.on_gradient_ready(param, has_gradient);
  if (--pending_[group] == 0 && options_.overlap) launch_complete_groups_in_order();
}

void GradientSyncEngine::launch_complete_groups_in_order() {
  // Every rank must issue the same collectives in the same order, so a
  // complete group waits for the groups before it even if it completed first.
  while (next_to_launch_ < launch_order_.size() && pending_[launch_order_[next_to_launch_]] == 0) {
    const size_t group = launch_order_[next_to_launch_];
    CollectiveTag tag(policy_.collective_tag(group));
    reductions_[group] = policy_.launch_group(group);
    ++next_to_launch_;
  }
}

void GradientSyncEngine::wait_for(size_t group) {
  auto& reduction = reductions_[group];
  reduction->wait();
  if (reduction->hasError()) {
    const std::string cause = reduction->tryRetrieveErrorMessage();
    DDP_PEER_CHECK(false, "ddp: reducing ", policy_.group_label(group), " failed on rank ", group_->rank(), " of ",
                   group_->size(), "; a peer may have died or stopped training. ", group_->explain_stall(cause),
                   " Cause: ", cause);
  }
}

void GradientSyncEngine::finish_round() {
  round_active_ = false;
  std::vector<size_t> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) missing.push_back(i);
  }
  if (!round_synchronised_) {
    for (size_t p : missing) record_ready(p, /*has_gradient=*/false);
    policy_.on_round_end(/*synchronised=*/false);
    return;
  }
  // Every group is launched before any error, so the other ranks'
  // collectives complete instead of waiting for this rank until the timeout.
  for (size_t p : missing) record_ready(p, /*has_gradient=*/false);
  launch_complete_groups_in_order();
  if (!missing.empty() && !options_.allow_unused) {
    for (size_t g : launch_order_) reductions_[g]->wait();
    std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
    std::ostringstream names;
    for (size_t k = 0; k < missing.size() && k < 10; ++k) names << (k ? ", " : "") << "'" << names_[missing[k]] << "'";
    if (missing.size() > 10) names << " and " << missing.size() - 10 << " more";
    DDP_CHECK(false, "ddp: rank ", group_->rank(), " finished backward, but these parameters got ",
              "no gradient: ", names.str(), ". Every parameter must take part in computing the ",
              "loss on every rank. Pass DDPOptions().find_unused_parameters(true) if some ",
              "parameters are legitimately unused, or freeze them (requires_grad false) before ",
              "wrapping the model.");
  }
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  try {
    policy_.before_waiting(used_locally_);
    for (size_t group : launch_order_) {
      wait_for(group);
      const c10::IValue& value = reductions_[group]->value();
      at::Tensor result = value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
      reductions_[group].reset();
      policy_.finish_group(group, result);
    }
  } catch (...) {
    // Some gradients are reduced and some are not, and the ranks may be out
    // of step: the next forward must not go on as if nothing happened.
    round_failed_ = true;
    throw;
  }
  ++synchronised_rounds_;
  policy_.on_round_end(/*synchronised=*/true);
}

}  // namespace ddp::detail
