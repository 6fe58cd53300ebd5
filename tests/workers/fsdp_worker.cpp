// Trains one small model under a chosen strategy (ddp, zero1, fsdp-full,
// fsdp-grad-op, fsdp-no-shard, or single: one process with the whole batch)
// and writes the full state dict, so tests can compare strategies. Each step's
// global batch depends only on the step number; rank r takes rows r, r+N, ...
//
//   ddprun --standalone --nproc-per-node 3 fsdp_worker --strategy fsdp-full --model seq --steps 6 --out w.pt
//
// --micro-batches M accumulates M backward passes per optimizer step.
// --device cuda [--backend gloo --share-devices] trains on the GPU.
//
// Checkpoint round trips: --save-full PREFIX writes PREFIX.model.pt and
// PREFIX.optim.pt (full, any world size) after the steps; --load-full PREFIX
// starts from them. --save-sharded DIR / --load-sharded DIR do the same with
// per-rank sharded checkpoints (FSDP only).

#include "worker_flags.h"

#include <ddp/checkpoint.h>
#include <ddp/device.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

namespace {

// Units wrapped where the model is built, a nested Sequential, a root-owned
// head and a buffer.
struct WrappedNetImpl : torch::nn::Module {
  WrappedNetImpl() {
    first = register_module("first", ddp::fsdp_unit(torch::nn::Linear(10, 33)));
    middle = register_module("middle", ddp::fsdp_unit(torch::nn::Sequential(torch::nn::Linear(33, 17), torch::nn::Tanh())));
    head = register_module("head", torch::nn::Linear(17, 5));
    scale = register_buffer("scale", at::linspace(0.5, 1.5, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return head(middle->forward(at::relu(first->forward(x)))) * scale;
  }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> first;
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Sequential>> middle;
  torch::nn::Linear head{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(WrappedNet);

// Unit sizes 363, 578 and 90: uneven shards (padding) at 2 and 3 ranks.
torch::nn::Sequential make_sequential() {
  return torch::nn::Sequential(torch::nn::Linear(10, 33), torch::nn::ReLU(), torch::nn::Linear(33, 17),
                               torch::nn::Tanh(), torch::nn::Linear(17, 5));
}

using worker::flag;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  throw std::invalid_argument("--optimizer must be adam, adamw or sgd");
}

// The global batch of `step`: the same on every rank and world size.
std::pair<at::Tensor, at::Tensor> global_batch(int64_t step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({12, 10}, generator), at::randn({12, 5}, generator)};
}

// A strategy's model and optimizer behind one interface.
struct Trainer {
  virtual ~Trainer() = default;
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  virtual void step() { optimizer().step(); }
  virtual void zero_grad() { optimizer().zero_grad(); }
  virtual ddp::StateDict full_state() = 0;  // on rank 0
  virtual c10::IValue full_optim_state() = 0;
  virtual void load_full(const ddp::StateDict& model, const c10::IValue& optim) = 0;
  // FSDP only.
  virtual std::string units() { return ""; }
  virtual ddp::ShardedMemory memory() { return {}; }
  virtual void save_sharded(const std::string&, ddp::ProcessGroup&) { throw std::invalid_argument("not FSDP"); }
  virtual void load_sharded(const std::string&, ddp::ProcessGroup&) { throw std::invalid_argument("not FSDP"); }
};

template <typename M>
struct DdpTrainer : Trainer {
  DdpTrainer(M model, std::shared_ptr<ddp::ProcessGroup> group, const std::string& optim, bool zero)
      : ddp(model, group) {
    if (zero) {
      zero_optimizer = std::make_unique<ddp::ZeroRedundancyOptimizer>(
          ddp->parameters(), group, [optim](std::vector<at::Tensor> shard) { return make_optimizer(optim, shard); });
    } else {
      plain = make_optimizer(optim, ddp->parameters());
    }
  }
  at::Tensor forward(const at::Tensor& x) override { return ddp.forward(x); }
  torch::optim::Optimizer& optimizer() override {
    return zero_optimizer ? zero_optimizer->local_optimizer() : *plain;
  }
  void step() override {
    if (zero_optimizer) zero_optimizer->step();
    else plain->step();
  }
  void zero_grad() override {
    if (zero_optimizer) zero_optimizer->zero_grad();
    else plain->zero_grad();
  }
  ddp::StateDict full_state() override { return ddp::state_dict(*ddp.module()); }
  c10::IValue full_optim_state() override {
    return zero_optimizer ? zero_optimizer->consolidate_state_dict(0) : ddp::optimizer_state_dict(*plain);
  }
  void load_full(const ddp::StateDict& model, const c10::IValue& optim) override {
    ddp::load_state_dict(*ddp.module(), model);
    if (zero_optimizer) zero_optimizer->load_state_dict(optim);
    else ddp::load_optimizer_state_dict(*plain, optim);
  }
  ddp::DistributedDataParallel<M> ddp;
  std::unique_ptr<torch::optim::Optimizer> plain;
  std::unique_ptr<ddp::ZeroRedundancyOptimizer> zero_optimizer;
};

template <typename M>
struct FsdpTrainer : Trainer {
  FsdpTrainer(M model, std::shared_ptr<ddp::ProcessGroup> group, const std::string& optim, ddp::FSDPOptions options)
      : fsdp(model, group, options), plain(make_optimizer(optim, fsdp.parameters())) {}
  at::Tensor forward(const at::Tensor& x) override { return fsdp.forward(x); }
  torch::optim::Optimizer& optimizer() override { return *plain; }
  ddp::StateDict full_state() override { return fsdp.full_state_dict(); }
  c10::IValue full_optim_state() override { return fsdp.full_optim_state_dict(*plain); }
  void load_full(const ddp::StateDict& model, const c10::IValue& optim) override {
    fsdp.load_full_state_dict(model);
    fsdp.load_full_optim_state_dict(*plain, optim);
  }
  std::string units() override {
    std::string names;
    for (const auto& n : fsdp.unit_names()) names += " '" + n + "'";
    return names;
  }
  ddp::ShardedMemory memory() override { return fsdp.memory(); }
  void save_sharded(const std::string& dir, ddp::ProcessGroup& group) override {
    ddp::save_sharded_checkpoint(fsdp.sharded_state_dict(plain.get()), dir, group);
  }
  void load_sharded(const std::string& dir, ddp::ProcessGroup& group) override {
    fsdp.load_sharded_state_dict(ddp::load_sharded_checkpoint(dir, group), plain.get());
  }
  ddp::FullyShardedDataParallel<M> fsdp;
  std::unique_ptr<torch::optim::Optimizer> plain;
};

template <typename M>
std::unique_ptr<Trainer> make_trainer(M model, const std::string& strategy, std::shared_ptr<ddp::ProcessGroup> group,
                                      const std::string& optim, ddp::FSDPOptions fsdp_options) {
  if (strategy == "ddp" || strategy == "single") return std::make_unique<DdpTrainer<M>>(model, group, optim, false);
  if (strategy == "zero1") return std::make_unique<DdpTrainer<M>>(model, group, optim, true);
  std::string kind = strategy.substr(0, 5) == "fsdp-" ? strategy.substr(5) : strategy;
  if (kind == "full") kind = "full_shard";
  if (kind == "grad-op") kind = "shard_grad_op";
  fsdp_options.sharding_strategy(ddp::parse_sharding_strategy(kind));
  return std::make_unique<FsdpTrainer<M>>(model, group, optim, fsdp_options);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string strategy = flag(argc, argv, "--strategy", "ddp");
    const std::string model_kind = flag(argc, argv, "--model", "seq");
    const std::string optim = flag(argc, argv, "--optimizer", "adam");
    const int64_t first_step = std::stoll(flag(argc, argv, "--first-step", "0"));
    const int64_t steps = std::stoll(flag(argc, argv, "--steps", "6"));
    const std::string out = flag(argc, argv, "--out");
    const int64_t init_seed = std::stoll(flag(argc, argv, "--init-seed", "0"));
    const int64_t micro_batches = std::stoll(flag(argc, argv, "--micro-batches", "1"));

    auto device_options = ddp::DeviceOptions()
                              .kind(ddp::parse_device_kind(flag(argc, argv, "--device", "cpu")))
                              .share_devices(flag(argc, argv, "--share-devices", "no") == "yes");
    const c10::Device device = ddp::init_device(ddp::world_from_env(), device_options);
    auto group = ddp::init_process_group(ddp::ProcessGroupOptions().device(device).backend(
        ddp::parse_backend(flag(argc, argv, "--backend", "auto"))));
    const int rank = group->rank(), world = group->size();
    torch::manual_seed(init_seed);
    ddp::FSDPOptions fsdp_options;
    std::unique_ptr<Trainer> trainer;
    if (model_kind == "seq") {
      fsdp_options.min_num_params(std::stoll(flag(argc, argv, "--min-num-params", "200")));
      auto model = make_sequential();
      model->to(device);
      trainer = make_trainer(model, strategy, group, optim, fsdp_options);
    } else if (model_kind == "tiny") {
      // Units of 4 and 2 elements: one-element shards and one-element parameters.
      fsdp_options.min_num_params(1);
      auto model = torch::nn::Sequential(torch::nn::Linear(10, 1), torch::nn::Tanh(), torch::nn::Linear(1, 1));
      model->to(device);
      trainer = make_trainer(model, strategy, group, optim, fsdp_options);
    } else if (model_kind == "wrapped") {
      WrappedNet model;
      model->to(device);
      trainer = make_trainer(model, strategy, group, optim, fsdp_options);
    } else {
      throw std::invalid_argument("--model must be seq, tiny or wrapped");
    }
    const bool is_fsdp = strategy.rfind("fsdp-", 0) == 0;
    if (is_fsdp && rank == 0) std::printf("units:%s\n", trainer->units().c_str());

    if (auto prefix = flag(argc, argv, "--load-full"); !prefix.empty()) {
      trainer->load_full(ddp::load_state_dict(prefix + ".model.pt"), ddp::load_value(prefix + ".optim.pt"));
    }
    if (auto dir = flag(argc, argv, "--load-sharded"); !dir.empty()) trainer->load_sharded(dir, *group);

    for (int64_t step = first_step; step < first_step + steps; ++step) {
      auto [x, y] = global_batch(step);
      x = x.to(device);
      y = y.to(device);
      if (strategy != "single") {
        at::Tensor rows = at::arange(rank, x.size(0), world, at::TensorOptions().dtype(at::kLong).device(device));
        x = x.index_select(0, rows);
        y = y.index_select(0, rows);
      }
      trainer->zero_grad();
      // Gradient accumulation: several backward passes, one optimizer step.
      for (const auto& rows : at::arange(x.size(0), at::TensorOptions().dtype(at::kLong).device(device))
                                  .tensor_split(micro_batches)) {
        at::Tensor loss = torch::nn::functional::mse_loss(trainer->forward(x.index_select(0, rows)),
                                                          y.index_select(0, rows)) *
                          (static_cast<double>(rows.numel()) / static_cast<double>(x.size(0)));
        if (is_fsdp && step == first_step + 1) {
          std::printf("rank %d after forward holds %lld parameter bytes\n", rank,
                      static_cast<long long>(trainer->memory().parameter_bytes));
        }
        loss.backward();
      }
      trainer->step();
    }
    if (is_fsdp) {
      auto memory = trainer->memory();
      std::printf("rank %d between steps holds %lld parameter bytes, %lld gradient bytes\n", rank,
                  static_cast<long long>(memory.parameter_bytes), static_cast<long long>(memory.gradient_bytes));
    }

    if (auto prefix = flag(argc, argv, "--save-full"); !prefix.empty()) {
      auto model_state = trainer->full_state();
      auto optim_state = trainer->full_optim_state();
      if (rank == 0) {
        ddp::save_state_dict(model_state, prefix + ".model.pt");
        ddp::save_value(optim_state, prefix + ".optim.pt");
      }
    }
    if (auto dir = flag(argc, argv, "--save-sharded"); !dir.empty()) trainer->save_sharded(dir, *group);
    auto state = trainer->full_state();
    if (rank == 0 && !out.empty()) ddp::save_state_dict(state, out);
    group->barrier();
    std::printf("rank %d: fsdp_worker %s done\n", rank, strategy.c_str());
  } catch (const c10::Error& e) {
    ddp::record_error(e);  // for the launcher's root cause (TORCHELASTIC_ERROR_FILE)
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    ddp::record_error(e);
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
