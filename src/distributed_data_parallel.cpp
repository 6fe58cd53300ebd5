#include <ddp/distributed_data_parallel.h>

#include <ddp/error.h>

#include "error_text.h"

#include <ATen/Functions.h>

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
  reducer_ = std::make_unique<BucketReducer>(std::move(params), std::move(names), group_,
                                               options_.reducer());
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

void DdpRuntime::shadow_step() {
  before_forward();
  reducer_->shadow_backward();
}

}  // namespace detail

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
