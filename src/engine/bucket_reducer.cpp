#include "engine/bucket_reducer.h"

#include <ddp/error.h>

#include "engine/bucket_assignment.h"
#include "engine/bucket_sizing.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>

namespace ddp::detail {
namespace {

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

BucketReducer::BucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                             std::shared_ptr<ProcessGroup> group, DDPOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(std::move(options)),
      caps_(bucket_caps_of(options_.bucket_cap_mb(), options_.first_bucket_cap_mb())),
      comm_hook_(options_.comm_hook()) {
  DDP_CHECK(params_.size() == names_.size(), "ddp: BucketReducer needs one name per parameter");
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    DDP_CHECK(p.requires_grad() && p.is_leaf(), "ddp: parameter '", names_[i],
                "' must be a leaf tensor that requires grad");
    DDP_CHECK(p.layout() == c10::kStrided, "ddp: parameter '", names_[i],
                "' is not dense; sparse parameters are not supported");
  }
  world_size_ = at::scalar_tensor(static_cast<double>(group_->size()), at::kDouble);
  EngineOptions sync;
  sync.collectives = "all-reduces";
  sync.allow_unused = options_.find_unused_parameters();
  sync.overlap = options_.overlap_with_backward();
  engine_ = std::make_unique<GradientSyncEngine>(params_, names_, group_, static_cast<ReductionPolicy&>(*this), sync);
  build_buckets(compute_bucket_assignment(infos_of(params_), caps_.first_bytes, caps_.bytes));
}

void BucketReducer::build_buckets(const std::vector<std::vector<size_t>>& assignment) {
  buckets_.clear();
  bucket_of_param_.assign(params_.size(), 0);
  position_in_bucket_.assign(params_.size(), 0);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    std::vector<std::string> names;
    for (size_t j = 0; j < assignment[b].size(); ++j) {
      const size_t i = assignment[b][j];
      bucket_of_param_[i] = b;
      position_in_bucket_[i] = j;
      bucket.params.push_back(params_[i]);
      names.push_back(names_[i]);
    }
    bucket.layout = FlatLayout::of(bucket.params, std::move(names));
    bucket.flat = at::zeros({bucket.layout.numel}, bucket.params.front().options().requires_grad(false));
    // Made once per bucket layout, not on every launch: hooks that use them
    // (PowerSGD) get them for free, the others pay nothing per step.
    bucket.gradients = bucket.layout.views(bucket.flat);
    buckets_.push_back(std::move(bucket));
  }
  engine_->set_groups(assignment);
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

void BucketReducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  if (!options_.find_unused_parameters()) return;
  if (options_.static_graph() && static_unreachable_) {
    engine_->set_unreachable(*static_unreachable_);
    return;
  }
  engine_->find_unreachable(outputs);
  if (options_.static_graph()) static_unreachable_ = engine_->unreachable();
}

void BucketReducer::warn_on_backward_without_forward(std::string warning) {
  missing_forward_warning_ = std::move(warning);
}

void BucketReducer::prepare_for_forward() {
  forward_seen_ = true;
  engine_->check_previous_round_finished();
}

std::vector<size_t> BucketReducer::on_round_start(bool /*synchronised: always, DDP does not track no_sync()*/) {
  if (reduced_steps_ == 0) first_gradient_at_ = last_gradient_at_ = std::chrono::steady_clock::now();
  if (!forward_seen_ && !missing_forward_warning_.empty() && !warned_missing_forward_) {
    warned_missing_forward_ = true;
    // Once per reducer, not TORCH_WARN_ONCE's once per process: each wrapped
    // model that is bypassed says so.
    TORCH_WARN(missing_forward_warning_);
  }
  forward_seen_ = false;
  used_anywhere_.reset();
  // Buckets launch in index order: bucket_assignment() is already the
  // expected order of readiness, the same on every rank.
  std::vector<size_t> order(buckets_.size());
  std::iota(order.begin(), order.end(), 0);
  return order;
}

void BucketReducer::on_gradient_ready(size_t param_index, bool has_gradient) {
  if (reduced_steps_ == 0) {
    ready_order_.push_back(param_index);
    last_gradient_at_ = std::chrono::steady_clock::now();
  }
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
}

c10::intrusive_ptr<c10::ivalue::Future> BucketReducer::launch_group(size_t b) {
  Bucket& bucket = buckets_[b];
  if (!comm_hook_) return group_->all_reduce_async(bucket.flat)->getFuture();
  GradBucket view(b, bucket.flat, b + 1 == buckets_.size(), {}, &bucket.gradients, &bucket.params);
  return comm_hook_->run(*group_, view);
}

std::string BucketReducer::group_label(size_t b) const {
  return "gradient bucket " + std::to_string(b + 1) + "/" + std::to_string(buckets_.size());
}

std::string BucketReducer::collective_tag(size_t b) const {
  return "ddp bucket " + std::to_string(b + 1) + "/" + std::to_string(buckets_.size());
}

void BucketReducer::before_waiting(const std::vector<char>& used_locally) {
  if (!options_.find_unused_parameters()) return;
  if (options_.static_graph() && static_used_anywhere_.defined()) {
    used_anywhere_ = static_used_anywhere_;
    return;
  }
  // Which parameters got a gradient on any rank: one used nowhere keeps its
  // .grad untouched, as in PyTorch.
  at::Tensor flags = at::empty({static_cast<int64_t>(params_.size())}, at::kInt);
  int32_t* data = flags.data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) data[i] = used_locally[i];
  at::Tensor sent = group_->to_control(flags);
  CollectiveTag tag("ddp unused-parameter flags");
  group_->all_reduce(sent);
  used_anywhere_ = sent.cpu();
  if (options_.static_graph()) static_used_anywhere_ = used_anywhere_;
}

void BucketReducer::finish_group(size_t b, const at::Tensor& result) {
  Bucket& bucket = buckets_[b];
  if (!result.is_same(bucket.flat)) bucket.flat.copy_(result.view_as(bucket.flat));
  for (size_t i : engine_->groups()[b]) {
    if (used_anywhere_.defined() && used_anywhere_.data_ptr<int32_t>()[i] == 0) continue;
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

void BucketReducer::set_comm_hook(std::shared_ptr<CommHook> hook) {
  DDP_CHECK(!engine_->round_active(),
            "ddp: a model's comm hook cannot change during its backward pass; change it between steps");
  comm_hook_ = std::move(hook);
}

void BucketReducer::on_round_end(bool /*synchronised*/) {
  used_anywhere_.reset();
  ++reduced_steps_;
  maybe_rebuild_buckets();
}

c10::intrusive_ptr<c10::ivalue::Future> BucketReducer::launch_shadow_group(size_t b) {
  // Scratch zeros, not the bucket: with gradient_as_bucket_view the buckets
  // hold this rank's own gradients, which shadowing must leave alone.
  at::Tensor zeros = at::zeros_like(buckets_[b].flat);
  if (!comm_hook_) return group_->all_reduce_async(zeros)->getFuture();
  const std::vector<at::Tensor> views = buckets_[b].layout.views(zeros);
  // No parameters: a hook must not update this rank's (step_in_backward).
  GradBucket view(b, zeros, b + 1 == buckets_.size(), {}, &views);
  return comm_hook_->run(*group_, view);
}

void BucketReducer::maybe_rebuild_buckets() {
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
  const auto infos = infos_of(params_);
  // A model that fits in the first bucket is one bucket whatever the cap:
  // no probe, no collective more than before.
  if (caps_.fit_to_link && bucket_cap_matters(infos, visit, caps_.first_bytes)) {
    size_t gradient_bytes = 0;
    for (const auto& p : params_) gradient_bytes += static_cast<size_t>(p.numel()) * p.element_size();
    const double backward_s = std::chrono::duration<double>(last_gradient_at_ - first_gradient_at_).count();
    // Every rank gets the same figures (the maxima), so the same cap.
    link_ = measure_link(*group_, params_.front().options(), gradient_bytes, backward_s);
    // Without overlap every bucket waits for the end of backward: nothing hides.
    if (!options_.overlap_with_backward()) link_->backward_s = 0;
    caps_.bytes = fit_bucket_cap_bytes(infos, visit, caps_.first_bytes, *link_);
    const char* log = std::getenv("DDP_LOG_BUCKETS");
    if (log && *log && std::string(log) != "0" && group_->rank() == 0) {
      std::fprintf(stderr,
                   "ddp: buckets fitted to the link: all-reduce %.3f ms + %.3f ns/byte (CPU busy %.0f%% of it), "
                   "backward %.1f ms -> bucket_cap_mb %g, %zu buckets\n",
                   link_->latency_s * 1e3, link_->seconds_per_byte * 1e9, link_->cpu_share * 100,
                   link_->backward_s * 1e3, static_cast<double>(caps_.bytes) / (1024.0 * 1024.0),
                   compute_bucket_assignment(infos, visit, caps_.first_bytes, caps_.bytes).size());
    }
  }
  auto rebuilt = compute_bucket_assignment(infos, visit, caps_.first_bytes, caps_.bytes);
  ready_order_.clear();
  ready_order_.shrink_to_fit();
  if (rebuilt != engine_->groups()) build_buckets(rebuilt);
}

}  // namespace ddp::detail
