#include <ddp/distributed_data_parallel.h>

#include <ddp/error.h>

#include "engine/bucket_reducer.h"
#include "engine/ddp_hooks.h"
#include "common/error_text.h"

#include <ATen/Functions.h>
#include <torch/optim/lbfgs.h>

#include <unordered_set>

namespace ddp {
namespace detail {

void collect_tensors(const c10::IValue& value, std::vector<at::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& item : value.toTupleRef().elements()) collect_tensors(item, out);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) collect_tensors(item, out);
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) collect_tensors(item.value(), out);
  }
}

DdpRuntime::DdpRuntime(std::shared_ptr<ModuleTensors> module, std::shared_ptr<ProcessGroup> group,
                       DDPOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  DDP_CHECK(module_, "ddp: DistributedDataParallel got a null module");
  DDP_CHECK(group_, "ddp: DistributedDataParallel got a null process group");
  // Refused on every rank alike before any collective, so none waits.
  auto sparse = module_->sparse_gradient_parameters();
  DDP_CHECK(sparse.empty(), "ddp: parameter '", sparse.empty() ? "" : sparse.front(),
            "' would get sparse gradients (an Embedding or EmbeddingBag built with sparse(true)), but ",
            "DistributedDataParallel averages dense gradients only. Build it with sparse(false).");
  verify_replicas_match(*module_, *group_);
  broadcast_module_state(*module_, *group_, /*parameters=*/true, /*buffers=*/true);
  has_buffers_ = !module_->named_buffers().empty();

  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& [name, p] : module_->named_parameters()) {
    if (!p.requires_grad()) continue;
    params.push_back(p);
    names.push_back(name);
  }
  DDPOptions reducer_options = options_;
  if (options_.carry_loss()) {
    DDP_CHECK(!options_.comm_hook(), "ddp: DDPOptions::carry_loss rides on the default all-reduce, which a "
              "comm hook replaces; drop one of them (with a hook, check the loss with "
              "ddp::check_loss_is_finite(loss, group, ...), one small all-reduce)");
    rider_ = std::make_shared<LossRiderHook>(allreduce_hook());
    reducer_options.comm_hook(rider_);
  }
  reducer_ = std::make_unique<BucketReducer>(std::move(params), std::move(names), group_, reducer_options);
  // Also in a world of one, so the mistake shows before the job scales out.
  if (options_.broadcast_buffers() && has_buffers_) {
    reducer_->warn_on_backward_without_forward(
        "ddp: warning: a backward pass ran without DistributedDataParallel's forward, so this step's buffers "
        "(BatchNorm statistics, say) were not synchronised across ranks. Call model.forward(x) or model(x), "
        "not model->forward(x). (Shown once.)");
  }
}

void load_on_root_and_broadcast(const ModuleTensors& module, ProcessGroup& group, const std::string& path) {
  // Every rank learns whether rank 0's load worked, so a bad file fails
  // everywhere with its cause instead of leaving the others in a broadcast.
  std::string error;
  if (group.rank() == 0) {
    try {
      load_file_into(module.state_dict(), path);
    } catch (const std::exception& e) {
      error = detail::message_of(e);  // sent to every rank: no backtrace
    }
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, group.control_options().dtype(at::kInt));
  group.broadcast(failed, 0);
  if (failed.item<int>() != 0) {
    DDP_CHECK(group.rank() != 0, error);
    DDP_CHECK(false, "ddp: rank 0 could not load '", path, "'; see rank 0's error");
  }
  broadcast_module_state(module, group, /*parameters=*/true, /*buffers=*/true, 0);
}

void DdpRuntime::before_forward() {
  reducer_->prepare_for_forward();
  if (options_.broadcast_buffers() && has_buffers_) {
    broadcast_module_state(*module_, *group_, /*parameters=*/false, /*buffers=*/true);
  }
}

void DdpRuntime::after_forward(const std::vector<at::Tensor>& outputs) {
  reducer_->prepare_for_backward(outputs);
}

DdpRuntime::~DdpRuntime() = default;

void DdpRuntime::set_require_sync(bool require_sync) { reducer_->set_require_sync(require_sync); }

bool DdpRuntime::require_sync() const { return reducer_->require_sync(); }

const std::vector<std::vector<size_t>>& DdpRuntime::bucket_assignment() const { return reducer_->bucket_assignment(); }

bool DdpRuntime::buckets_rebuilt() const { return reducer_->buckets_rebuilt(); }

double DdpRuntime::bucket_cap_mb() const {
  return static_cast<double>(reducer_->bucket_cap_bytes()) / (1024.0 * 1024.0);
}

const at::Tensor& DdpRuntime::bucket_buffer(size_t index) const { return reducer_->bucket_buffer(index); }

void DdpRuntime::note_loss(const at::Tensor& loss) {
  DDP_CHECK(rider_, "ddp: note_loss needs DDPOptions().carry_loss(true)");
  rider_->note_loss(loss);
}

const ReducedLoss& DdpRuntime::reduced_loss() const {
  static const ReducedLoss none;
  return rider_ ? rider_->reduced_loss() : none;
}

void DdpRuntime::step_in_backward(torch::optim::Optimizer* optimizer) {
  std::shared_ptr<CommHook> hook = rider_ ? rider_ : options_.comm_hook();
  if (optimizer) {
    DDP_CHECK(!rider_, "ddp: step_in_backward steps the optimizer before backward returns, so a non-finite loss "
              "carried by carry_loss could no longer skip the step; drop carry_loss, or step the optimizer "
              "yourself after backward");
    DDP_CHECK(dynamic_cast<torch::optim::LBFGS*>(optimizer) == nullptr, "ddp: LBFGS evaluates a closure over "
              "every parameter in each step, so it cannot step bucket by bucket in backward; call "
              "optimizer.step(closure) yourself");
    std::unordered_set<const c10::TensorImpl*> mine;
    for (const auto& p : reducer_->params()) mine.insert(p.unsafeGetTensorImpl());
    size_t foreign = 0;
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) foreign += mine.count(p.unsafeGetTensorImpl()) ? 0 : 1;
    }
    DDP_CHECK(foreign == 0, "ddp: step_in_backward: ", foreign, " of the optimizer's parameters are not this "
              "model's, and no bucket would ever step them; build the optimizer from model->parameters(), or "
              "step a second optimizer for the others yourself");
    hook = std::make_shared<OptimizerStepHook>(hook ? hook : allreduce_hook(), *optimizer, reducer_->params());
  }
  reducer_->set_comm_hook(std::move(hook));
  optimizer_in_backward_ = optimizer;
}

void DdpRuntime::shadow_step() {
  before_forward();
  reducer_->shadow_backward();
}

}  // namespace detail

NoSyncGuard::NoSyncGuard(detail::DdpRuntime& runtime) : runtime_(&runtime), previous_(runtime.require_sync()) {
  runtime_->set_require_sync(false);
}

NoSyncGuard::~NoSyncGuard() {
  if (runtime_) runtime_->set_require_sync(previous_);
}

int Join::step() {
  DDP_CHECK(!finished_, "ddp: Join::step() after finish()");
  at::Tensor active = at::ones({1}, group_.control_options().dtype(at::kInt));
  CollectiveTag tag("join flag");
  group_.all_reduce(active);
  ++steps_;
  return active.item<int>();
}

void Join::finish() {
  DDP_CHECK(!finished_, "ddp: Join::finish() called twice");
  finished_ = true;
  while (true) {
    at::Tensor active = at::zeros({1}, group_.control_options().dtype(at::kInt));
    {
      CollectiveTag tag("join flag");
      group_.all_reduce(active);
    }
    if (active.item<int>() == 0) break;
    runtime_.shadow_step();
    ++shadowed_;
  }
  // The rank that trained longest holds the weights every step touched;
  // the highest such rank is the source for all.
  at::Tensor longest = at::full({1}, steps_, group_.control_options().dtype(at::kLong));
  group_.all_reduce(longest, c10d::ReduceOp::MAX);
  at::Tensor source = at::full({1}, steps_ == longest.item<int64_t>() ? group_.rank() : -1,
                               group_.control_options().dtype(at::kLong));
  group_.all_reduce(source, c10d::ReduceOp::MAX);
  detail::broadcast_module_state(runtime_.tensors(), group_, /*parameters=*/true, /*buffers=*/true,
                                 static_cast<int>(source.item<int64_t>()));
}
}  // namespace ddp
