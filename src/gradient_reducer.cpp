#include <ddp/gradient_reducer.h>

#include <ddp/error.h>

#include <ddp/bucket_assignment.h>

#include "autograd_hooks.h"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdio>
#include <sstream>
#include <unordered_set>

namespace ddp {
namespace {

using detail::GradientReadyHook;

size_t mib_to_bytes(double mib) { return static_cast<size_t>(mib * 1024.0 * 1024.0); }

bool is_alias_of(const at::Tensor& grad, const at::Tensor& slot) {
  return grad.defined() && grad.data_ptr() == slot.data_ptr() && grad.sizes() == slot.sizes();
}

// A tensor over a slot's memory that is not an autograd view of the bucket:
// optimizers may detach_() it or reset it like any gradient, which they
// cannot do to a view. It keeps the bucket's storage alive.
at::Tensor gradient_alias(const at::Tensor& slot, const at::Tensor& flat) {
  at::Tensor keep_alive = flat;
  return at::from_blob(slot.data_ptr(), slot.sizes(), [keep_alive](void*) {}, slot.options());
}

std::vector<BucketTensorInfo> infos_of(const std::vector<at::Tensor>& params) {
  std::vector<BucketTensorInfo> infos;
  for (const auto& p : params) infos.push_back({p.numel(), p.scalar_type(), p.device()});
  return infos;
}

}  // namespace

GradientReducer::GradientReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                                 std::shared_ptr<ProcessGroup> group, ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), group_(std::move(group)), options_(options) {
  DDP_CHECK(params_.size() == names_.size(), "ddp: GradientReducer needs one name per parameter");
  DDP_CHECK(options_.bucket_cap_mb() > 0 && options_.first_bucket_cap_mb() > 0,
              "ddp: bucket caps must be positive, got bucket_cap_mb=", options_.bucket_cap_mb(),
              " first_bucket_cap_mb=", options_.first_bucket_cap_mb());
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    DDP_CHECK(p.requires_grad() && p.is_leaf(), "ddp: parameter '", names_[i],
                "' must be a leaf tensor that requires grad");
    DDP_CHECK(p.layout() == c10::kStrided, "ddp: parameter '", names_[i],
                "' is not dense; sparse parameters are not supported");
  }
  comm_hook_ = options_.comm_hook() ? options_.comm_hook() : allreduce_hook();
  world_size_ = at::scalar_tensor(static_cast<double>(group_->size()), at::kDouble);
  ready_.assign(params_.size(), 0);
  used_locally_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
  build_buckets(compute_bucket_assignment(infos_of(params_), mib_to_bytes(options_.first_bucket_cap_mb()),
                                          mib_to_bytes(options_.bucket_cap_mb())));

  // One process has nothing to average: no hooks, no cost.
  if (group_->size() == 1) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    DDP_CHECK(accumulator, "ddp: parameter '", names_[i], "' has no gradient accumulator");
    hook_keys_.push_back(
        accumulator->add_post_hook(std::make_unique<GradientReadyHook>([this, i] { on_gradient_ready(i); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void GradientReducer::build_buckets(const std::vector<std::vector<size_t>>& assignment) {
  assignment_ = assignment;
  buckets_.clear();
  bucket_of_param_.assign(params_.size(), 0);
  position_in_bucket_.assign(params_.size(), 0);
  for (size_t b = 0; b < assignment_.size(); ++b) {
    Bucket bucket;
    bucket.params = assignment_[b];
    int64_t total = 0;
    for (size_t j = 0; j < bucket.params.size(); ++j) {
      size_t i = bucket.params[j];
      bucket_of_param_[i] = b;
      position_in_bucket_[i] = j;
      bucket.offsets.push_back(total);
      total += params_[i].numel();
    }
    bucket.flat = at::zeros({total}, params_[bucket.params.front()].options().requires_grad(false));
    buckets_.push_back(std::move(bucket));
  }
  if (options_.gradient_as_bucket_view()) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].grad().defined()) continue;
      at::Tensor slot = slot_of(i);
      slot.copy_(params_[i].grad());
      params_[i].mutable_grad() = gradient_alias(slot, buckets_[bucket_of_param_[i]].flat);
    }
  }
}

at::Tensor GradientReducer::slot_of(size_t param_index) {
  const Bucket& bucket = buckets_[bucket_of_param_[param_index]];
  const at::Tensor& param = params_[param_index];
  return bucket.flat.narrow(0, bucket.offsets[position_in_bucket_[param_index]], param.numel())
      .view(param.sizes());
}

void GradientReducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  if (!options_.find_unused_parameters() || accumulators_.empty()) return;
  // Every gradient accumulator reachable from the outputs will fire; the
  // rest belong to parameters this forward did not use.
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  unused_after_forward_.clear();
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
    if (!seen.count(accumulators_[i].get())) unused_after_forward_.push_back(i);
  }
}

void GradientReducer::warn_on_backward_without_forward(std::string warning) {
  missing_forward_warning_ = std::move(warning);
}

void GradientReducer::start_round() {
  if (!forward_seen_ && !missing_forward_warning_.empty() && !warned_missing_forward_) {
    warned_missing_forward_ = true;
    std::fprintf(stderr, "%s\n", missing_forward_warning_.c_str());
  }
  forward_seen_ = false;
  round_active_ = true;
  next_bucket_to_launch_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(used_locally_.begin(), used_locally_.end(), 0);
  for (Bucket& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.reduced.reset();
  }
  // Runs on the autograd engine once the whole backward pass is done.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
  auto unused = std::move(unused_after_forward_);
  unused_after_forward_.clear();
  for (size_t i : unused) mark_ready(i, /*has_gradient=*/false);
}

void GradientReducer::prepare_for_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  forward_seen_ = true;
  if (!round_active_) return;
  // The engine never ran finish_backward: backward threw part-way.
  round_active_ = false;
  unused_after_forward_.clear();
  DDP_CHECK(false, "ddp: the previous backward pass on rank ", group_->rank(),
              " did not finish (an error was raised inside it), so its gradient all-reduces may not match ",
              "the other ranks'. Stop this rank and restart the job (ddprun --max-restarts resumes from ",
              "the newest snapshot).");
}

void GradientReducer::on_gradient_ready(size_t param_index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!require_sync_) {
    // no_sync(): gradients just accumulate locally; remember which exist,
    // so the next synced step does not take them for unused.
    used_since_sync_[param_index] = 1;
    return;
  }
  if (!round_active_) start_round();
  mark_ready(param_index, /*has_gradient=*/true);
}

void GradientReducer::mark_ready(size_t param_index, bool has_gradient) {
  DDP_CHECK(!ready_[param_index], "ddp: the gradient of parameter '", names_[param_index],
              "' became ready twice in one backward pass; reentrant backward is not supported");
  ready_[param_index] = 1;
  used_locally_[param_index] = has_gradient || used_since_sync_[param_index] ? 1 : 0;
  if (reduced_steps_ == 0) ready_order_.push_back(param_index);

  at::Tensor slot = slot_of(param_index);
  at::Tensor& param = params_[param_index];
  const at::Tensor& grad = param.grad();
  DDP_CHECK(!grad.defined() || grad.layout() == c10::kStrided, "ddp: parameter '", names_[param_index],
            "' got a sparse gradient, but ddp averages dense gradients only. Build the layer without sparse ",
            "gradients (torch::nn::EmbeddingOptions(...).sparse(false)), or keep it out of the wrapped module.");
  // Into the bucket, divided by the world size on the way: hooks then only
  // sum. A gradient from earlier no_sync() steps counts even if this forward
  // did not use the parameter.
  if (grad.defined()) {
    if (is_alias_of(grad, slot)) {
      slot.div_(world_size_);
    } else {
      at::div_out(slot, grad, world_size_);
    }
  } else {
    slot.zero_();
  }
  if (options_.gradient_as_bucket_view() && has_gradient && !is_alias_of(param.grad(), slot)) {
    param.mutable_grad() = gradient_alias(slot, buckets_[bucket_of_param_[param_index]].flat);
  }

  if (--buckets_[bucket_of_param_[param_index]].pending == 0 && options_.overlap_with_backward()) {
    launch_full_buckets_in_order();
  }
}

void GradientReducer::launch_full_buckets_in_order() {
  // Every rank must issue the same collectives in the same order, so a full
  // bucket waits for the buckets before it even if it filled up first.
  while (next_bucket_to_launch_ < buckets_.size() && buckets_[next_bucket_to_launch_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_to_launch_];
    GradBucket view(next_bucket_to_launch_, bucket.flat, next_bucket_to_launch_ + 1 == buckets_.size());
    CollectiveTag tag("ddp bucket " + std::to_string(next_bucket_to_launch_ + 1) + "/" +
                      std::to_string(buckets_.size()));
    bucket.reduced = comm_hook_->run(*group_, view);
    ++next_bucket_to_launch_;
  }
}

void GradientReducer::finish_backward() {
  round_active_ = false;
  if (next_bucket_to_launch_ != buckets_.size() || !options_.overlap_with_backward()) {
    std::vector<size_t> missing;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) missing.push_back(i);
    }
    // Every bucket is launched before any error, so the other ranks' all-
    // reduces complete instead of waiting for this rank until the timeout.
    for (size_t i : missing) mark_ready(i, /*has_gradient=*/false);
    launch_full_buckets_in_order();
    if (!missing.empty() && !options_.find_unused_parameters()) {
      for (Bucket& bucket : buckets_) bucket.reduced->wait();
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
  }
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);

  // Which parameters got a gradient on any rank: one used nowhere keeps its
  // .grad untouched, as in PyTorch.
  at::Tensor used_anywhere;
  if (options_.find_unused_parameters()) {
    used_anywhere = at::empty({static_cast<int64_t>(params_.size())}, at::kInt);
    int32_t* data = used_anywhere.data_ptr<int32_t>();
    for (size_t i = 0; i < params_.size(); ++i) data[i] = used_locally_[i];
    at::Tensor sent = group_->to_control(used_anywhere);
    CollectiveTag tag("ddp unused-parameter flags");
    group_->all_reduce(sent);
    used_anywhere = sent.cpu();
  }

  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.reduced->wait();
    if (bucket.reduced->hasError()) {
      DDP_CHECK(false, "ddp: reducing gradient bucket ", b + 1, "/", buckets_.size(), " failed on rank ",
                group_->rank(), " of ", group_->size(), "; a peer may have died or stopped training. ",
                group_->explain_stall(bucket.reduced->tryRetrieveErrorMessage()), " Cause: ",
                bucket.reduced->tryRetrieveErrorMessage());
    }
    const c10::IValue& value = bucket.reduced->value();
    at::Tensor result = value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
    if (!result.is_same(bucket.flat)) bucket.flat.copy_(result.view_as(bucket.flat));
    bucket.reduced.reset();

    for (size_t i : bucket.params) {
      if (used_anywhere.defined() && used_anywhere.data_ptr<int32_t>()[i] == 0) continue;
      at::Tensor slot = slot_of(i);
      at::Tensor& param = params_[i];
      if (options_.gradient_as_bucket_view()) {
        if (!is_alias_of(param.grad(), slot)) param.mutable_grad() = gradient_alias(slot, bucket.flat);
      } else if (param.grad().defined()) {
        param.mutable_grad().copy_(slot);
      } else {
        param.mutable_grad() = slot.clone();
      }
    }
  }
  ++reduced_steps_;
  maybe_rebuild_buckets();
}

void GradientReducer::shadow_backward() {
  if (group_->size() == 1) return;
  // Scratch buffers: with gradient_as_bucket_view the buckets hold this
  // rank's own gradients, which shadowing must leave alone.
  std::vector<at::Tensor> zeros;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    zeros.push_back(at::zeros_like(buckets_[b].flat));
    GradBucket view(b, zeros.back(), b + 1 == buckets_.size());
    CollectiveTag tag("ddp bucket " + std::to_string(b + 1) + "/" + std::to_string(buckets_.size()) + " (joined)");
    buckets_[b].reduced = comm_hook_->run(*group_, view);
  }
  if (options_.find_unused_parameters()) {
    at::Tensor used_anywhere = at::zeros({static_cast<int64_t>(params_.size())}, group_->control_options().dtype(at::kInt));
    group_->all_reduce(used_anywhere);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].reduced->wait();
    DDP_CHECK(!buckets_[b].reduced->hasError(), "ddp: shadowing gradient bucket ", b, " failed on rank ",
                group_->rank(), ": ", buckets_[b].reduced->tryRetrieveErrorMessage());
    buckets_[b].reduced.reset();
  }
  ++reduced_steps_;
  maybe_rebuild_buckets();
}

void GradientReducer::maybe_rebuild_buckets() {
  if (buckets_rebuilt_ || !options_.rebuild_buckets()) return;
  buckets_rebuilt_ = true;
  // Rank 0's observed order, completed with any parameter it never saw, so
  // every rank rebuilds the same buckets.
  const int64_t n = static_cast<int64_t>(params_.size());
  at::Tensor order = at::empty({n}, at::kLong);
  if (group_->rank() == 0) {
    std::vector<char> listed(params_.size(), 0);
    std::vector<int64_t> full;
    for (size_t i : ready_order_) {
      if (!listed[i]) full.push_back(static_cast<int64_t>(i)), listed[i] = 1;
    }
    for (size_t k = params_.size(); k-- > 0;) {
      if (!listed[k]) full.push_back(static_cast<int64_t>(k));
    }
    std::copy(full.begin(), full.end(), order.data_ptr<int64_t>());
  }
  at::Tensor sent = group_->to_control(order);
  group_->broadcast(sent, 0);
  order = sent.cpu();
  std::vector<size_t> visit(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + n);
  auto rebuilt = compute_bucket_assignment(infos_of(params_), visit, mib_to_bytes(options_.first_bucket_cap_mb()),
                                           mib_to_bytes(options_.bucket_cap_mb()));
  ready_order_.clear();
  ready_order_.shrink_to_fit();
  if (rebuilt != assignment_) build_buckets(rebuilt);
}

}  // namespace ddp
