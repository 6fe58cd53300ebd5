#include <ddp/gradient_reducer.h>

#include <ddp/bucket_assignment.h>

#include <ATen/Functions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

namespace ddp {
namespace {

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

size_t mib_to_bytes(double mib) { return static_cast<size_t>(mib * 1024.0 * 1024.0); }

}  // namespace

GradientReducer::GradientReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                                 std::shared_ptr<ProcessGroup> group, ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), group_(std::move(group)) {
  TORCH_CHECK(params_.size() == names_.size(), "ddp: GradientReducer needs one name per parameter");
  TORCH_CHECK(options.bucket_cap_mb() > 0 && options.first_bucket_cap_mb() > 0,
              "ddp: bucket caps must be positive, got bucket_cap_mb=", options.bucket_cap_mb(),
              " first_bucket_cap_mb=", options.first_bucket_cap_mb());

  std::vector<BucketTensorInfo> infos;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK(p.requires_grad() && p.is_leaf(), "ddp: parameter '", names_[i],
                "' must be a leaf tensor that requires grad");
    TORCH_CHECK(p.layout() == c10::kStrided, "ddp: parameter '", names_[i],
                "' is not dense; sparse parameters are not supported");
    infos.push_back({p.numel(), p.scalar_type(), p.device()});
  }
  assignment_ = compute_bucket_assignment(infos, mib_to_bytes(options.first_bucket_cap_mb()),
                                          mib_to_bytes(options.bucket_cap_mb()));

  bucket_of_param_.assign(params_.size(), 0);
  position_in_bucket_.assign(params_.size(), 0);
  ready_.assign(params_.size(), 0);
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
    const at::Tensor& first = params_[bucket.params.front()];
    bucket.flat = at::zeros({total}, first.options().requires_grad(false));
    buckets_.push_back(std::move(bucket));
  }

  // One process has nothing to average: no hooks, no cost.
  if (group_->size() == 1) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(accumulator, "ddp: parameter '", names_[i], "' has no gradient accumulator");
    hook_keys_.push_back(
        accumulator->add_post_hook(std::make_unique<GradientReadyHook>([this, i] { on_gradient_ready(i); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void GradientReducer::start_round() {
  round_active_ = true;
  next_bucket_to_launch_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (Bucket& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.work.reset();
  }
  // Runs on the autograd engine once the whole backward pass is done.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
}

void GradientReducer::on_gradient_ready(size_t param_index) {
  if (!round_active_) start_round();
  TORCH_CHECK(!ready_[param_index], "ddp: the gradient of parameter '", names_[param_index],
              "' became ready twice in one backward pass; reentrant backward is not supported");
  ready_[param_index] = 1;

  Bucket& bucket = buckets_[bucket_of_param_[param_index]];
  const at::Tensor& grad = params_[param_index].grad();
  int64_t numel = params_[param_index].numel();
  at::Tensor slot = bucket.flat.narrow(0, bucket.offsets[position_in_bucket_[param_index]], numel);
  if (grad.defined()) {
    slot.copy_(grad.reshape({numel}));
  } else {
    slot.zero_();
  }
  if (--bucket.pending == 0) launch_full_buckets_in_order();
}

void GradientReducer::launch_full_buckets_in_order() {
  // Every rank must issue the same collectives in the same order, so a full
  // bucket waits for the buckets before it even if it filled up first.
  while (next_bucket_to_launch_ < buckets_.size() && buckets_[next_bucket_to_launch_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_to_launch_];
    // Divide first, then sum: the average PyTorch's DDP computes.
    bucket.flat.div_(group_->size());
    bucket.work = group_->all_reduce_async(bucket.flat);
    ++next_bucket_to_launch_;
  }
}

void GradientReducer::finish_backward() {
  round_active_ = false;
  if (next_bucket_to_launch_ != buckets_.size()) {
    std::ostringstream unused;
    int listed = 0;
    for (size_t i = 0; i < params_.size() && listed < 10; ++i) {
      if (!ready_[i]) unused << (listed++ ? ", " : "") << "'" << names_[i] << "'";
    }
    TORCH_CHECK(false, "ddp: rank ", group_->rank(), " finished backward, but these parameters got ",
                "no gradient: ", unused.str(), ". Every parameter must take part in computing the ",
                "loss on every rank; freeze unused parameters (requires_grad false) before wrapping ",
                "the model in DistributedDataParallel.");
  }
  for (Bucket& bucket : buckets_) {
    group_->wait(bucket.work, "gradient all_reduce");
    for (size_t j = 0; j < bucket.params.size(); ++j) {
      at::Tensor& param = params_[bucket.params[j]];
      at::Tensor averaged = bucket.flat.narrow(0, bucket.offsets[j], param.numel()).view(param.sizes());
      if (param.grad().defined()) {
        param.mutable_grad().copy_(averaged);
      } else {
        param.mutable_grad() = averaged.clone();
      }
    }
    bucket.work.reset();
  }
  ++reduced_steps_;
}

}  // namespace ddp
