#include <ddp/bucket_reducer.h>

#include <ddp/error.h>

#include "bucket_assignment.h"
#include "gradient_sync_engine.h"
#include "stepped_in_backward.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include <mutex>
#include <numeric>
#include <unordered_map>

namespace ddp {
namespace {

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

std::vector<detail::BucketTensorInfo> infos_of(const std::vector<at::Tensor>& params) {
  std::vector<detail::BucketTensorInfo> infos;
  for (const auto& p : params) infos.push_back({p.numel(), p.scalar_type(), p.device()});
  return infos;
}

// How many live reducers step each optimizer inside backward.
struct SteppedInBackward {
  std::mutex mutex;
  std::unordered_map<const torch::optim::Optimizer*, int> counts;
};
SteppedInBackward& stepped_in_backward() {
  static SteppedInBackward registry;
  return registry;
}

}  // namespace

namespace detail {

void note_stepped_in_backward(const torch::optim::Optimizer* optimizer, bool stepped) {
  if (!optimizer) return;
  auto& registry = stepped_in_backward();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto& counts = registry.counts;
  if (stepped) {
    ++counts[optimizer];
  } else if (auto it = counts.find(optimizer); it != counts.end() && --it->second == 0) {
    counts.erase(it);
  }
}

bool is_stepped_in_backward(const torch::optim::Optimizer* optimizer) {
  auto& registry = stepped_in_backward();
  std::lock_guard<std::mutex> lock(registry.mutex);
  return registry.counts.count(optimizer) != 0;
}

}  // namespace detail

BucketReducer::BucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                             std::shared_ptr<ProcessGroup> group, ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), group_(std::move(group)), options_(options) {
  DDP_CHECK(params_.size() == names_.size(), "ddp: BucketReducer needs one name per parameter");
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
  DDP_CHECK(!(options_.carry_loss() && options_.comm_hook()), "ddp: DDPOptions::carry_loss rides on the default "
            "all-reduce, which a comm hook replaces; drop one of them (with a hook, check the loss with "
            "ddp::check_loss_is_finite(loss, group, ...), one small all-reduce)");
  comm_hook_ = options_.comm_hook() ? options_.comm_hook() : allreduce_hook();
  world_size_ = at::scalar_tensor(static_cast<double>(group_->size()), at::kDouble);
  detail::EngineOptions sync;
  sync.collectives = "all-reduces";
  sync.allow_unused = options_.find_unused_parameters();
  sync.overlap = options_.overlap_with_backward();
  // One process has nothing to average: no hooks, no cost.
  sync.install_hooks = group_->size() > 1;
  engine_ = std::make_unique<detail::GradientSyncEngine>(params_, names_, group_,
                                                         static_cast<detail::ReductionPolicy&>(*this), sync);
  build_buckets(detail::compute_bucket_assignment(infos_of(params_), mib_to_bytes(options_.first_bucket_cap_mb()),
                                          mib_to_bytes(options_.bucket_cap_mb())));
}

BucketReducer::~BucketReducer() { detail::note_stepped_in_backward(optimizer_in_backward_, false); }

void BucketReducer::set_require_sync(bool require_sync) { engine_->set_require_sync(require_sync); }

bool BucketReducer::require_sync() const { return engine_->require_sync(); }

const std::vector<std::vector<size_t>>& BucketReducer::bucket_assignment() const { return engine_->groups(); }

void BucketReducer::build_buckets(const std::vector<std::vector<size_t>>& assignment) {
  buckets_.clear();
  bucket_of_param_.assign(params_.size(), 0);
  position_in_bucket_.assign(params_.size(), 0);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    int64_t total = 0;
    for (size_t j = 0; j < assignment[b].size(); ++j) {
      size_t i = assignment[b][j];
      bucket_of_param_[i] = b;
      position_in_bucket_[i] = j;
      bucket.offsets.push_back(total);
      total += params_[i].numel();
    }
    const int64_t rider = options_.carry_loss() ? group_->size() + 1 : 0;
    bucket.sent = at::zeros({total + rider}, params_[assignment[b].front()].options().requires_grad(false));
    bucket.flat = rider ? bucket.sent.narrow(0, 0, total) : bucket.sent;
    buckets_.push_back(std::move(bucket));
  }
  engine_->set_groups(assignment);
  // Made once per bucket layout, not on every launch: hooks that use them
  // (PowerSGD) get them for free, the others pay nothing per step.
  for (size_t b = 0; b < buckets_.size(); ++b) buckets_[b].gradient_views = gradient_views(b, buckets_[b].flat);
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

at::Tensor BucketReducer::slot_of(size_t param_index) {
  const Bucket& bucket = buckets_[bucket_of_param_[param_index]];
  const at::Tensor& param = params_[param_index];
  return bucket.flat.narrow(0, bucket.offsets[position_in_bucket_[param_index]], param.numel())
      .view(param.sizes());
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
}

std::vector<at::Tensor> BucketReducer::gradient_views(size_t b, const at::Tensor& buffer) const {
  std::vector<at::Tensor> views;
  for (size_t i : engine_->groups()[b]) {
    const at::Tensor& param = params_[i];
    views.push_back(buffer.narrow(0, buckets_[b].offsets[position_in_bucket_[i]], param.numel()).view(param.sizes()));
  }
  return views;
}

void BucketReducer::note_loss(const at::Tensor& loss) {
  DDP_CHECK(options_.carry_loss(), "ddp: note_loss needs DDPOptions().carry_loss(true)");
  DDP_CHECK(loss.numel() == 1, "ddp: note_loss takes the loss itself, one element; got ", loss.numel());
  noted_loss_ = loss.detach().reshape({1});
  if (group_->size() == 1) {
    // Nothing to reduce with: what the rider would have carried.
    at::Tensor rider = at::zeros({2}, at::kDouble);
    write_rider(rider);
    read_rider(rider);
  }
}

// Slots [0, world) are one flag per rank, slot `world` the loss divided by
// the world size; summed over ranks they are the ranks with a non-finite
// loss and the average loss. Written on the device, so nothing waits here.
void BucketReducer::write_rider(const at::Tensor& rider) {
  rider.zero_();
  if (!noted_loss_.defined()) return;
  const int world = group_->size();
  at::Tensor loss = noted_loss_.to(rider.device(), rider.scalar_type());
  at::Tensor finite = at::isfinite(loss);
  rider.narrow(0, group_->rank(), 1).copy_(finite.logical_not());
  rider.narrow(0, world, 1).copy_(at::where(finite, loss, at::zeros_like(loss)) / world);
}

void BucketReducer::read_rider(const at::Tensor& rider) {
  const int world = group_->size();
  at::Tensor values = rider.to(at::kCPU, at::kDouble);
  const double* data = values.data_ptr<double>();
  reduced_loss_ = ReducedLoss{};
  reduced_loss_.valid = noted_loss_.defined();
  for (int r = 0; r < world; ++r) {
    if (data[r] != 0) reduced_loss_.nonfinite_ranks.push_back(r);
  }
  reduced_loss_.average = data[world];
  noted_loss_.reset();
}

c10::intrusive_ptr<c10::ivalue::Future> BucketReducer::launch_group(size_t b) {
  Bucket& bucket = buckets_[b];
  if (carries_loss(b)) write_rider(bucket.sent.narrow(0, bucket.flat.numel(), group_->size() + 1));
  // Hooked at one rank only for step_in_backward: nothing to average.
  if (group_->size() == 1) return detail::completed_future(carries_loss(b) ? bucket.sent : bucket.flat);
  GradBucket view(b, carries_loss(b) ? bucket.sent : bucket.flat, b + 1 == buckets_.size(), {},
                  &bucket.gradient_views);
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
  at::Tensor& sent = carries_loss(b) ? bucket.sent : bucket.flat;
  if (!result.is_same(sent)) sent.copy_(result.view_as(sent));
  if (carries_loss(b)) read_rider(bucket.sent.narrow(0, bucket.flat.numel(), group_->size() + 1));
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
  if (optimizer_in_backward_) step_optimizer_over_bucket(b);
}

void BucketReducer::step_in_backward(torch::optim::Optimizer* optimizer) {
  DDP_CHECK(!engine_->round_active(), "ddp: step_in_backward cannot change during a backward pass");
  if (optimizer) {
    DDP_CHECK(!options_.carry_loss(), "ddp: step_in_backward steps the optimizer before backward returns, so a "
              "non-finite loss carried by carry_loss could no longer skip the step; drop carry_loss, or step "
              "the optimizer yourself after backward");
    DDP_CHECK(dynamic_cast<torch::optim::LBFGS*>(optimizer) == nullptr, "ddp: LBFGS evaluates a closure over "
              "every parameter in each step, so it cannot step bucket by bucket in backward; call "
              "optimizer.step(closure) yourself");
    if (param_index_.empty()) {
      for (size_t i = 0; i < params_.size(); ++i) param_index_.emplace(params_[i].unsafeGetTensorImpl(), i);
    }
    size_t foreign = 0;
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) foreign += param_index_.count(p.unsafeGetTensorImpl()) ? 0 : 1;
    }
    DDP_CHECK(foreign == 0, "ddp: step_in_backward: ", foreign, " of the optimizer's parameters are not this "
              "model's, and no bucket would ever step them; build the optimizer from model->parameters(), or "
              "step a second optimizer for the others yourself");
    // One process has nothing to reduce and no hooks; the step still has to
    // happen in backward.
    engine_->install_hooks();
  }
  detail::note_stepped_in_backward(optimizer, true);
  detail::note_stepped_in_backward(optimizer_in_backward_, false);
  optimizer_in_backward_ = optimizer;
}

// LibTorch's optimizers skip every parameter whose .grad is undefined, so
// hiding the other buckets' gradients for one step() updates exactly this
// bucket's parameters, each as a step after backward would. The hidden
// gradients are only moved aside, never touched: later buckets may still be
// reducing into theirs.
void BucketReducer::step_optimizer_over_bucket(size_t b) {
  std::vector<std::pair<at::Tensor, at::Tensor>> hidden;
  auto restore = [&] {
    for (auto& [param, grad] : hidden) param.mutable_grad() = std::move(grad);
  };
  try {
    for (auto& group : optimizer_in_backward_->param_groups()) {
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto index = param_index_.find(p.unsafeGetTensorImpl());
        DDP_CHECK(index != param_index_.end(), "ddp: a parameter added to the optimizer after step_in_backward "
                  "is not this model's, and no bucket would ever step it; step that parameter group with an "
                  "optimizer of its own");
        if (bucket_of_param_[index->second] == b) continue;
        hidden.emplace_back(p, p.grad());
        p.mutable_grad() = at::Tensor();
      }
    }
    optimizer_in_backward_->step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void BucketReducer::on_round_end(bool /*synchronised*/) {
  used_anywhere_.reset();
  ++reduced_steps_;
  maybe_rebuild_buckets();
}

void BucketReducer::shadow_backward() {
  if (group_->size() > 1) engine_->shadow_round();
}

c10::intrusive_ptr<c10::ivalue::Future> BucketReducer::launch_shadow_group(size_t b) {
  // Scratch zeros, not the bucket: with gradient_as_bucket_view the buckets
  // hold this rank's own gradients, which shadowing must leave alone.
  // The loss rider too, all zeros: this rank has no loss.
  at::Tensor zeros = at::zeros_like(carries_loss(b) ? buckets_[b].sent : buckets_[b].flat);
  const std::vector<at::Tensor> views = gradient_views(b, zeros);
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
  auto rebuilt = detail::compute_bucket_assignment(infos_of(params_), visit, mib_to_bytes(options_.first_bucket_cap_mb()),
                                           mib_to_bytes(options_.bucket_cap_mb()));
  ready_order_.clear();
  ready_order_.shrink_to_fit();
  if (rebuilt != engine_->groups()) build_buckets(rebuilt);
}

}  // namespace ddp
