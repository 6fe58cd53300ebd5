#pragma once

// Internal to the library, not installed: the one gradient-synchronisation
// engine under BucketReducer (DDP's buckets) and detail::FsdpRuntime (FSDP's
// units), whole in this header: the policy interface they implement, the
// hook on the gradient accumulators, and the engine itself.
//
// The engine owns what both need to agree on across ranks:
//  * one hook on every parameter's gradient accumulator;
//  * groups of parameters (buckets or units), launched in one order that is
//    the same on every rank: a complete group waits for every group before
//    it in that order, so a parameter unused on one rank only (a branch, a
//    router) cannot reorder that rank's collectives;
//  * one end-of-backward callback, which treats parameters that got no
//    gradient as zeros, launches every group before raising any error, and
//    waits for the reductions in launch order;
//  * the guards: an interrupted backward is an error at the next forward,
//    parameters unused without permission are an error naming them, and
//    no_sync() backward passes start no collective.
// The policy decides what a group is and how it is reduced: DDP copies each
// gradient into its bucket as it arrives and all-reduces the bucket; FSDP
// flattens a unit's gradients when the unit is complete and
// reduce-scatters them into the shard.

#include <ddp/collective_trace.h>
#include <ddp/error.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ddp::detail {

/// What DDP and FSDP decide; the engine calls these, on the autograd thread.
class ReductionPolicy {
 public:
  virtual ~ReductionPolicy() = default;
  /// A backward pass starts (synchronised: false inside no_sync()). Returns
  /// the order its groups launch in, every group once, the same on every
  /// rank.
  virtual std::vector<size_t> on_round_start(bool synchronised) = 0;
  /// Synchronised passes only: parameter `param` is final for this pass
  /// (has_gradient false: it got none and counts as zeros).
  virtual void on_gradient_ready(size_t param, bool has_gradient) = 0;
  /// Every parameter of `group` is final and every group before it has been
  /// launched: start its reduction. The future's value is the reduced
  /// tensor (a tensor or a list whose first element is it).
  virtual c10::intrusive_ptr<c10::ivalue::Future> launch_group(size_t group) = 0;
  /// no_sync() passes, when the engine tracks them: every parameter of
  /// `group` is final. No collective may start.
  virtual void on_group_complete_without_sync(size_t /*group*/) {}
  /// Every group has been launched and none waited for: a collective that
  /// every rank runs here (DDP's unused-parameter flags) overlaps them.
  /// used_locally[p]: whether p got a gradient on this rank since the last
  /// synchronised pass.
  virtual void before_waiting(const std::vector<char>& /*used_locally*/) {}
  /// `group`'s reduction finished with `result`.
  virtual void finish_group(size_t group, const at::Tensor& result) = 0;
  /// The pass is over: after every finish_group, or after a no_sync() pass.
  virtual void on_round_end(bool /*synchronised*/) {}
  /// Join's shadow pass (GradientSyncEngine::shadow_round): start `group`'s
  /// reduction as launch_group would, over zeros, leaving this rank's
  /// gradients alone. Policies that do not support Join keep the default,
  /// which refuses.
  virtual c10::intrusive_ptr<c10::ivalue::Future> launch_shadow_group(size_t /*group*/) {
    DDP_CHECK(false, "ddp: this wrapper does not support Join (a rank without data mirroring the others)");
    return {};
  }
  /// For errors: "gradient bucket 2/3".
  virtual std::string group_label(size_t group) const = 0;
  /// For the collective trace: "ddp bucket 2/3".
  virtual std::string collective_tag(size_t group) const = 0;
  /// Whether a backward pass begins with its first gradient (DDP). FSDP's
  /// begin only with GradientSyncEngine::begin_round(), from a hook on its
  /// forward's outputs, and gradients outside a pass are ignored.
  virtual bool rounds_start_on_first_gradient() const { return true; }
  /// Whether no_sync() passes still report complete groups
  /// (on_group_complete_without_sync: FSDP frees a unit's gathered
  /// parameters then). DDP's only accumulate.
  virtual bool tracks_rounds_without_sync() const { return false; }
};

// Runs a callback after a parameter's gradient has been accumulated into
// .grad, i.e. when the gradient is final for this backward pass.
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

struct EngineOptions {
  /// For messages: " through FullyShardedDataParallel", or empty for DDP.
  std::string owner;
  /// For messages: "all-reduces", "reduce-scatters".
  std::string collectives = "all-reduces";
  /// Parameters without a gradient count as zeros; off, they are an error
  /// that names them (DDP's find_unused_parameters).
  bool allow_unused = false;
  /// Launch a group as soon as it (and every one before it) is complete;
  /// off, every group waits for the end of backward.
  bool overlap = true;
};

class GradientSyncEngine {
 public:
  /// `params` and their `names` (for errors). Groups: set_groups().
  GradientSyncEngine(std::vector<at::Tensor> params, std::vector<std::string> names,
                     std::shared_ptr<ProcessGroup> group, ReductionPolicy& policy, EngineOptions options);
  ~GradientSyncEngine();
  GradientSyncEngine(const GradientSyncEngine&) = delete;
  GradientSyncEngine& operator=(const GradientSyncEngine&) = delete;

  /// Parameter indices of each group; every parameter in exactly one. Not
  /// during a backward pass.
  void set_groups(std::vector<std::vector<size_t>> groups);
  const std::vector<std::vector<size_t>>& groups() const { return groups_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }

  /// After a forward: parameters that its outputs' graph cannot reach will
  /// get no gradient, so the next pass marks them ready when it starts and
  /// their groups need not wait for the end of backward.
  void find_unreachable(const std::vector<at::Tensor>& outputs);
  /// What find_unreachable found for the coming pass (parameter indices).
  const std::vector<size_t>& unreachable() const { return unreachable_; }
  /// Instead of find_unreachable: a static graph's set, found once.
  void set_unreachable(std::vector<size_t> unreachable) { unreachable_ = std::move(unreachable); }
  /// Starts a backward pass now, if none is running.
  void begin_round();
  /// Before a forward: throws if the last backward pass never ended (an
  /// exception inside it) or one of its reductions failed, since this rank's
  /// collectives may then be out of step with the other ranks'.
  void check_previous_round_finished();

  /// Join: a rank that ran out of data issues the collectives of one
  /// synchronised backward pass of the others, in the same launch order,
  /// over zeros (the policy's launch_shadow_group and before_waiting), and
  /// waits for them. This rank's gradients are left alone.
  void shadow_round();

  /// Off: backward passes only accumulate locally (no_sync()).
  void set_require_sync(bool require_sync) { require_sync_ = require_sync; }
  bool require_sync() const { return require_sync_; }
  bool round_active() const { return round_active_; }
  /// Synchronised passes completed.
  int64_t synchronised_rounds() const { return synchronised_rounds_; }

 private:
  void on_gradient_ready(size_t param);
  void start_round();
  void record_ready(size_t param, bool has_gradient);
  void launch_complete_groups_in_order();
  void finish_round();
  void wait_for(size_t position);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  ReductionPolicy& policy_;
  EngineOptions options_;
  std::vector<std::vector<size_t>> groups_;
  std::vector<size_t> group_of_param_;
  // The accumulators are owned weakly by their parameters; holding them
  // keeps our hooks attached for as long as the engine lives.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::mutex mutex_;  // hooks of different devices run on different threads

  // One backward pass.
  bool round_active_ = false;
  bool round_synchronised_ = true;
  bool round_failed_ = false;  // a reduction failed: the next forward is refused once
  std::vector<size_t> launch_order_;
  size_t next_to_launch_ = 0;  // position in launch_order_
  std::vector<size_t> pending_;  // per group: parameters not yet final
  std::vector<char> ready_;
  std::vector<char> counted_unused_;   // marked ready without a gradient this pass
  std::vector<char> used_locally_;     // got a gradient (this pass or a no_sync() one since)
  std::vector<char> used_since_sync_;  // got one in a no_sync() pass since the last synchronised one
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> reductions_;  // per group
  std::vector<size_t> unreachable_;
  bool require_sync_ = true;
  int64_t synchronised_rounds_ = 0;
};

/// A future that is already complete with `value`: a group whose reduction
/// needs no collective (one rank).
inline c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(value);
  return future;
}

// The engine's definitions: inline, since this header is the engine (it is
// included by bucket_reducer.cpp and FSDP's step file only).

inline GradientSyncEngine::GradientSyncEngine(std::vector<at::Tensor> params, std::vector<std::string> names,
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
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    DDP_CHECK(accumulator, "ddp: parameter '", names_[i], "' has no gradient accumulator");
    hook_keys_.push_back(
        accumulator->add_post_hook(std::make_unique<GradientReadyHook>([this, i] { on_gradient_ready(i); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

inline GradientSyncEngine::~GradientSyncEngine() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

inline void GradientSyncEngine::set_groups(std::vector<std::vector<size_t>> groups) {
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

inline void GradientSyncEngine::find_unreachable(const std::vector<at::Tensor>& outputs) {
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

inline void GradientSyncEngine::begin_round() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!round_active_) start_round();
}

inline void GradientSyncEngine::shadow_round() {
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

inline void GradientSyncEngine::check_previous_round_finished() {
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

inline void GradientSyncEngine::on_gradient_ready(size_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!round_active_) {
    if (!policy_.rounds_start_on_first_gradient()) return;  // a backward that did not start from our forward
    if (!require_sync_ && !policy_.tracks_rounds_without_sync()) {
      // no_sync(): gradients just accumulate locally; remember which exist,
      // so the next synchronised pass does not take them for unused.
      used_since_sync_[param] = 1;
      return;
    }
    start_round();
  }
  record_ready(param, /*has_gradient=*/true);
}

inline void GradientSyncEngine::start_round() {
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

inline void GradientSyncEngine::record_ready(size_t param, bool has_gradient) {
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

inline void GradientSyncEngine::launch_complete_groups_in_order() {
  // Every rank must issue the same collectives in the same order, so a
  // complete group waits for the groups before it even if it completed first.
  while (next_to_launch_ < launch_order_.size() && pending_[launch_order_[next_to_launch_]] == 0) {
    const size_t group = launch_order_[next_to_launch_];
    CollectiveTag tag(policy_.collective_tag(group));
    reductions_[group] = policy_.launch_group(group);
    ++next_to_launch_;
  }
}

inline void GradientSyncEngine::wait_for(size_t group) {
  auto& reduction = reductions_[group];
  reduction->wait();
  if (reduction->hasError()) {
    const std::string cause = reduction->tryRetrieveErrorMessage();
    DDP_PEER_CHECK(false, "ddp: reducing ", policy_.group_label(group), " failed on rank ", group_->rank(), " of ",
                   group_->size(), "; a peer may have died or stopped training. ", group_->explain_stall(cause),
                   " Cause: ", cause);
  }
}

inline void GradientSyncEngine::finish_round() {
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
