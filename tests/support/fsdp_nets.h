// The small FSDP model most rank tests train (units of three sizes, a layer
// one rank may skip), its batches and state-dict comparisons. Shared by the
// test_fsdp_*.cpp files; needs gtest (max_difference asserts on keys).
#pragma once

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ddp::testing {

// One FSDP unit of two Linear layers whose second one is skipped when
// `skip_second` is set: its parameters are then unused in that forward.
struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(fc1(x));
    return skip_second ? h : at::tanh(fc2(h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool skip_second = false;
};
TORCH_MODULE(TwoLayer);

// Units 'first' (144 parameters) and 'block' (544), the head in the root
// unit (68): three reduce-scatters of different sizes per step.
struct BranchyNetImpl : torch::nn::Module {
  BranchyNetImpl() {
    first = register_module("first", ddp::fsdp_unit(torch::nn::Linear(8, 16)));
    block = register_module("block", ddp::fsdp_unit(TwoLayer()));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = first->forward(x);
    if (throw_in_backward) {
      // Fires after the head's and the block's gradients, before first's.
      h.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom in backward"); });
    }
    return head(block->forward(at::relu(h)));
  }
  bool throw_in_backward = false;
  void skip_second(bool skip) { block->module()->skip_second = skip; }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> first;
  std::shared_ptr<ddp::FsdpUnitImpl<TwoLayer>> block;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BranchyNet);

// Rank r's rows of step `step`'s global batch (the same for every world size).
inline std::pair<at::Tensor, at::Tensor> batch(int64_t step, int rank, int world) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  at::Tensor x = at::randn({12, 8}, generator), y = at::randn({12, 4}, generator);
  at::Tensor rows = at::arange(rank, 12, world, at::kLong);
  return {x.index_select(0, rows), y.index_select(0, rows)};
}

// Rank 1 skips the block's second layer on even steps.
inline bool skips(int64_t step, int rank) { return rank == 1 && step % 2 == 0; }

constexpr int64_t kSteps = 6;

inline std::map<std::string, at::Tensor> by_name(const ddp::StateDict& state) {
  std::map<std::string, at::Tensor> map;
  for (const auto& [name, tensor] : state) map[name] = tensor;
  return map;
}

inline double max_difference(const ddp::StateDict& a, const ddp::StateDict& b) {
  auto ma = by_name(a), mb = by_name(b);
  EXPECT_EQ(ma.size(), mb.size());
  double diff = 0;
  for (const auto& [name, tensor] : ma) {
    auto it = mb.find(name);
    EXPECT_NE(it, mb.end()) << name;
    if (it == mb.end()) return 1e9;
    diff = std::max(diff, (tensor - it->second).abs().max().item<double>());
  }
  return diff;
}

// Steps `first` to first + count - 1 of the common batches.
template <typename Model>
void run_steps(Model& model, torch::optim::Optimizer& optimizer, const std::shared_ptr<ddp::ProcessGroup>& group,
               int64_t first = 0, int64_t count = kSteps) {
  for (int64_t step = first; step < first + count; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    optimizer.zero_grad();
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    optimizer.step();
  }
}

// A parameter the graph reaches but whose gradient never comes: the block's
// second output (through fc2) is left out of rank 1's loss on even steps.
// The forward's graph cannot tell, so the block is completed with zeros at
// the end of backward, still in the common order.
struct TwoOutputBlockImpl : torch::nn::Module {
  TwoOutputBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(fc1(x));
    return {h, fc2(h)};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TwoOutputBlock);

struct AuxNetImpl : torch::nn::Module {
  AuxNetImpl() {
    first = register_module("first", ddp::fsdp_unit(torch::nn::Linear(8, 16)));
    block = register_module("block", ddp::fsdp_unit(TwoOutputBlock()));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    auto [h, aux] = block->forward(at::relu(first->forward(x)));
    return {head(h), aux};
  }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> first;
  std::shared_ptr<ddp::FsdpUnitImpl<TwoOutputBlock>> block;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(AuxNet);

// Freezes the block's fc1.weight (inside a unit) and head.bias (in the root unit).
inline void freeze(BranchyNet& net) {
  net->block->module()->fc1->weight.requires_grad_(false);
  net->head->bias.requires_grad_(false);
}

// SGD without momentum over the common batches.
template <typename Model>
void train_sgd(Model& model, std::vector<at::Tensor> params, const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.05));
  run_steps(model, optimizer, group);
}

inline ddp::StateDict sgd_ddp(const std::shared_ptr<ddp::ProcessGroup>& group, std::shared_ptr<ddp::CommHook> hook) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::DistributedDataParallel<BranchyNet> model(net, group, ddp::DDPOptions().comm_hook(std::move(hook)));
  train_sgd(model, model->parameters(), group);
  return ddp::state_dict(*net);
}

}  // namespace ddp::testing
