#pragma once

// ZeRO stage 1: each rank keeps optimizer state (Adam's moments, say) only
// for its own shard of the parameters, steps only that shard, then sends the
// updated parameters to the other ranks. With N ranks the optimizer state per
// rank shrinks to about 1/N. Combine it with DistributedDataParallel, which
// still averages the full gradients:
//
//   ddp::DistributedDataParallel<Net> model(Net(), group);
//   ddp::ZeroRedundancyOptimizer optimizer(model->parameters(), group, [](std::vector<at::Tensor> shard) {
//     return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
//   });
//   ... loss.backward(); optimizer.step(); optimizer.zero_grad();

#include <ddp/export.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp {

class DDP_API ZeroRedundancyOptimizer {
 public:
  /// Builds the optimizer for one shard of parameters (e.g. a torch::optim::Adam).
  using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

  /// Shards `params` over `group` and creates this rank's optimizer over its
  /// shard. Every rank must pass the same parameters in the same order.
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, std::shared_ptr<ProcessGroup> group,
                          OptimizerFactory make_optimizer);
  ~ZeroRedundancyOptimizer();

  /// Steps this rank's shard, then broadcasts every shard from its owner so
  /// all ranks end with the same parameters. Collective.
  void step();
  /// Clears the gradients of all parameters, not just this rank's shard.
  void zero_grad(bool set_to_none = true);

  /// The rank that owns parameter `index`.
  int owner(size_t index) const { return owners_.at(index); }
  /// This rank's optimizer (over its shard only).
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  /// Parameter indices (into the constructor's list) of this rank's shard.
  const std::vector<size_t>& local_indices() const { return local_indices_; }

  /// Gathers every rank's optimizer state on `to_rank`, in the layout of
  /// Python's optimizer.state_dict() with global parameter indices, for
  /// saving. Other ranks get None. Collective.
  c10::IValue consolidate_state_dict(int to_rank = 0);
  /// Loads a full optimizer state (what consolidate_state_dict returned, or
  /// Python's optimizer.state_dict() for the same parameters, or an FSDP
  /// full_optim_state_dict) from any world size: each rank keeps its shard's
  /// entries. Every rank needs the whole state.
  void load_state_dict(const c10::IValue& state);

 private:
  std::vector<at::Tensor> params_;
  std::shared_ptr<ProcessGroup> group_;
  std::vector<int> owners_;
  std::vector<size_t> local_indices_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

}  // namespace ddp
