// One small model trained under a chosen strategy (ddp, zero1, fsdp-full,
// fsdp-grad-op, fsdp-no-shard, or single: one process, no wrapper, with the
// whole batch), so tests can compare strategies. Each step's global batch
// depends only on the step number; rank r takes rows r, r+N, ... Used by the
// FSDP tests (test_fsdp_strategies.cpp, test_fsdp_state_dict.cpp) inside
// run_on_ranks, and by workers/ddp_worker.cpp (train) for the launcher tests. No
// gtest here: the callers assert.
#pragma once

#include <ddp/checkpoint.h>
#include <ddp/clip_grad.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp::testing {

// Units wrapped where the model is built, a nested Sequential, a root-owned
// head and a buffer.
struct WrappedNetImpl : torch::nn::Module {
  WrappedNetImpl() {
    first = register_module("first", ddp::fsdp_unit(torch::nn::Linear(10, 33)));
    middle = register_module("middle", ddp::fsdp_unit(torch::nn::Sequential(torch::nn::Linear(33, 17), torch::nn::Tanh())));
    head = register_module("head", torch::nn::Linear(17, 5));
    scale = register_buffer("scale", at::linspace(0.5, 1.5, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return head(middle->forward(at::relu(first->forward(x)))) * scale; }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> first;
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Sequential>> middle;
  torch::nn::Linear head{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(WrappedNet);

/// What to train and how; the defaults are the common run.
struct TrainSpec {
  std::string strategy = "ddp";
  /// seq: unit sizes 363, 578 and 90 (uneven shards at 2 and 3 ranks);
  /// tiny: units of 4 and 2 elements (one-element shards and parameters);
  /// wrapped: WrappedNet.
  std::string model = "seq";
  std::string optimizer = "adam";
  int64_t first_step = 0;
  int64_t steps = 6;
  int64_t init_seed = 0;
  /// Backward passes per optimizer step (gradient accumulation).
  int64_t micro_batches = 1;
  /// Full checkpoints (PREFIX.model.pt, PREFIX.optim.pt; any world size):
  /// "" for none.
  std::string load_full, save_full;
  /// Distributed checkpoints (a directory in DCP's HuggingFace layout; any
  /// world size and strategy but single): "" for none.
  std::string load_dcp, save_dcp;
  c10::Device device = c10::kCPU;
  /// Gradient clipping before each step: off at 0. ddp::clip_grad_norm_, or
  /// with clip_with_libtorch LibTorch's own function on the wrapper's
  /// parameters() (right for DDP, wrong for sharded FSDP).
  double clip_max_norm = 0;
  double clip_norm_type = 2.0;
  bool clip_with_libtorch = false;
  /// FSDP's param_dtype (mixed precision); undefined: the parameters' own.
  std::optional<at::ScalarType> param_dtype;
  /// FSDP's reduce_dtype; undefined: the gradients' own.
  std::optional<at::ScalarType> reduce_dtype;
  /// A 2-D mesh {replicate, shard}: the FSDP strategies run as HSDP on it,
  /// and zero1 shards the optimizer over the shard dimension only (DDP over
  /// the whole group). Empty: the group alone.
  std::vector<int> mesh_shape;
  /// FSDP built from factories (DeferredSequential); "seq" model only.
  bool deferred = false;
};

/// What training left.
struct TrainResult {
  ddp::StateDict state;        ///< the full state dict (complete on rank 0)
  std::string units;           ///< FSDP's unit names, each quoted after a space
  int64_t bytes_after_forward = 0;  ///< parameter bytes held after the 2nd step's first forward (FSDP)
  ddp::ShardedMemory between_steps;  ///< what FSDP holds after the last step
  std::vector<double> norms;          ///< each step's total gradient norm, when clipping
  ddp::DistributedCheckpointReport loaded;  ///< what load_dcp read on this rank
};

inline std::unique_ptr<torch::optim::Optimizer> make_trainer_optimizer(const std::string& kind,
                                                                      std::vector<at::Tensor> params) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  throw std::invalid_argument("the optimizer must be adam, adamw or sgd, not '" + kind + "'");
}

/// The global batch of `step`: the same on every rank and world size.
inline std::pair<at::Tensor, at::Tensor> global_batch(int64_t step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({12, 10}, generator), at::randn({12, 5}, generator)};
}

namespace detail {

// A strategy's model and optimizer behind one interface.
struct Trainer {
  virtual ~Trainer() = default;
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  virtual void step() = 0;
  virtual void zero_grad() = 0;
  virtual ddp::StateDict full_state() = 0;
  virtual c10::IValue full_optim_state() = 0;
  virtual void load_full(const ddp::StateDict& model, const c10::IValue& optim) = 0;
  virtual double clip(double max_norm, double norm_type, bool with_libtorch) = 0;
  // FSDP only.
  virtual std::string units() { return ""; }
  virtual ddp::ShardedMemory memory() { return {}; }
  virtual void save_dcp(const std::string&) { throw std::invalid_argument("single has no process group"); }
  virtual ddp::DistributedCheckpointReport load_dcp(const std::string&) {
    throw std::invalid_argument("single has no process group");
  }
};

template <typename M>
struct PlainTrainer : Trainer {
  PlainTrainer(M model, const std::string& optim) : model(model), plain(make_trainer_optimizer(optim, model->parameters())) {}
  at::Tensor forward(const at::Tensor& x) override { return model->forward(x); }
  void step() override { plain->step(); }
  void zero_grad() override { plain->zero_grad(); }
  ddp::StateDict full_state() override { return ddp::state_dict(*model); }
  c10::IValue full_optim_state() override { return ddp::optimizer_state_dict(*plain); }
  void load_full(const ddp::StateDict& state, const c10::IValue& optim) override {
    ddp::load_state_dict(*model, state);
    ddp::load_optimizer_state_dict(*plain, optim);
  }
  double clip(double max_norm, double norm_type, bool) override {
    return torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm, norm_type);
  }
  M model;
  std::unique_ptr<torch::optim::Optimizer> plain;
};

template <typename M>
struct DdpTrainer : Trainer {
  DdpTrainer(M model, std::shared_ptr<ddp::ProcessGroup> group, const std::string& optim, bool zero,
             std::shared_ptr<ddp::ProcessGroup> zero_group = nullptr)
      : ddp(model, group) {
    if (zero) {
      zero_optimizer = std::make_unique<ddp::ZeroRedundancyOptimizer>(
          ddp->parameters(), zero_group ? zero_group : group,
          [optim](std::vector<at::Tensor> shard) { return make_trainer_optimizer(optim, shard); });
    } else {
      plain = make_trainer_optimizer(optim, ddp->parameters());
    }
  }
  at::Tensor forward(const at::Tensor& x) override { return ddp.forward(x); }
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
  double clip(double max_norm, double norm_type, bool with_libtorch) override {
    if (with_libtorch) return torch::nn::utils::clip_grad_norm_(ddp.parameters(), max_norm, norm_type);
    return ddp::clip_grad_norm_(ddp, max_norm, norm_type);
  }
  void save_dcp(const std::string& dir) override {
    if (zero_optimizer) ddp::save_distributed_checkpoint(dir, ddp, *zero_optimizer);
    else ddp::save_distributed_checkpoint(dir, ddp, plain.get());
  }
  ddp::DistributedCheckpointReport load_dcp(const std::string& dir) override {
    return zero_optimizer ? ddp::load_distributed_checkpoint(dir, ddp, *zero_optimizer)
                          : ddp::load_distributed_checkpoint(dir, ddp, plain.get());
  }
  ddp::DistributedDataParallel<M> ddp;
  std::unique_ptr<torch::optim::Optimizer> plain;
  std::unique_ptr<ddp::ZeroRedundancyOptimizer> zero_optimizer;
};

template <typename M>
struct FsdpTrainer : Trainer {
  FsdpTrainer(M model, std::shared_ptr<ddp::ProcessGroup> group, const std::string& optim, ddp::FSDPOptions options)
      : fsdp(model, group, options), plain(make_trainer_optimizer(optim, fsdp.parameters())) {}
  FsdpTrainer(M model, const ddp::DeviceMesh& mesh, const std::string& optim, ddp::FSDPOptions options)
      : fsdp(model, mesh, options), plain(make_trainer_optimizer(optim, fsdp.parameters())) {}
  template <typename Groups>
  FsdpTrainer(const ddp::DeferredSequential& children, const Groups& groups, const std::string& optim,
              ddp::FSDPOptions options)
      : fsdp(children, groups, options), plain(make_trainer_optimizer(optim, fsdp.parameters())) {}
  at::Tensor forward(const at::Tensor& x) override { return fsdp.forward(x); }
  void step() override { plain->step(); }
  void zero_grad() override { plain->zero_grad(); }
  ddp::StateDict full_state() override { return fsdp.full_state_dict(); }
  c10::IValue full_optim_state() override { return fsdp.full_optim_state_dict(*plain); }
  void load_full(const ddp::StateDict& model, const c10::IValue& optim) override {
    fsdp.load_full_state_dict(model);
    fsdp.load_full_optim_state_dict(*plain, optim);
  }
  double clip(double max_norm, double norm_type, bool with_libtorch) override {
    if (with_libtorch) return torch::nn::utils::clip_grad_norm_(fsdp.parameters(), max_norm, norm_type);
    return ddp::clip_grad_norm_(fsdp, max_norm, norm_type);
  }
  std::string units() override {
    std::string names;
    for (const auto& n : fsdp.unit_names()) names += " '" + n + "'";
    return names;
  }
  ddp::ShardedMemory memory() override { return fsdp.memory(); }
  void save_dcp(const std::string& dir) override { ddp::save_distributed_checkpoint(dir, fsdp, plain.get()); }
  ddp::DistributedCheckpointReport load_dcp(const std::string& dir) override {
    return ddp::load_distributed_checkpoint(dir, fsdp, plain.get());
  }
  ddp::FullyShardedDataParallel<M> fsdp;
  std::unique_ptr<torch::optim::Optimizer> plain;
};

inline ddp::ShardingStrategy trainer_sharding(const std::string& strategy) {
  std::string kind = strategy.substr(0, 5) == "fsdp-" ? strategy.substr(5) : strategy;
  if (kind == "full") kind = "full_shard";
  if (kind == "grad-op") kind = "shard_grad_op";
  return ddp::parse_sharding_strategy(kind);
}

template <typename M>
std::unique_ptr<Trainer> make_trainer(M model, const std::string& strategy, const std::shared_ptr<ddp::ProcessGroup>& group,
                                      const std::string& optim, ddp::FSDPOptions fsdp_options,
                                      const std::optional<ddp::DeviceMesh>& mesh = std::nullopt) {
  if (strategy == "single") return std::make_unique<PlainTrainer<M>>(model, optim);
  if (strategy == "ddp") return std::make_unique<DdpTrainer<M>>(model, group, optim, false);
  if (strategy == "zero1") {
    return std::make_unique<DdpTrainer<M>>(model, group, optim, true, mesh ? mesh->group("shard") : nullptr);
  }
  fsdp_options.sharding_strategy(trainer_sharding(strategy));
  if (mesh) return std::make_unique<FsdpTrainer<M>>(model, *mesh, optim, fsdp_options);
  return std::make_unique<FsdpTrainer<M>>(model, group, optim, fsdp_options);
}

}  // namespace detail

/// Trains `spec` on `group` (ignored by "single", which may pass nullptr).
inline TrainResult train(const std::shared_ptr<ddp::ProcessGroup>& group, const TrainSpec& spec) {
  const c10::Device device = spec.device;
  torch::manual_seed(spec.init_seed);
  ddp::FSDPOptions fsdp_options;
  if (spec.param_dtype) fsdp_options.param_dtype(*spec.param_dtype).output_dtype(at::kFloat);
  if (spec.reduce_dtype) fsdp_options.reduce_dtype(*spec.reduce_dtype);
  std::optional<ddp::DeviceMesh> mesh;
  if (!spec.mesh_shape.empty()) mesh.emplace(group, spec.mesh_shape, std::vector<std::string>{"replicate", "shard"});
  std::unique_ptr<detail::Trainer> trainer;
  if (spec.model == "seq" && spec.deferred) {
    // The same children, each a unit (as min_num_params(1) makes them). The
    // whole Sequential below draws its children in the order the compiler
    // evaluates constructor arguments, so the factories' own draws differ:
    // the weights come from a copy built as the "seq" model is.
    auto whole = torch::nn::Sequential(torch::nn::Linear(10, 33), torch::nn::ReLU(), torch::nn::Linear(33, 17),
                                       torch::nn::Tanh(), torch::nn::Linear(17, 5));
    ddp::DeferredSequential children;
    children.add([] { return torch::nn::Linear(10, 33); }).add([] { return torch::nn::ReLU(); });
    children.add([] { return torch::nn::Linear(33, 17); }).add([] { return torch::nn::Tanh(); });
    children.add([] { return torch::nn::Linear(17, 5); });
    fsdp_options.sharding_strategy(detail::trainer_sharding(spec.strategy));
    using Deferred = detail::FsdpTrainer<torch::nn::Sequential>;
    auto deferred = mesh ? std::make_unique<Deferred>(children, *mesh, spec.optimizer, fsdp_options)
                         : std::make_unique<Deferred>(children, group, spec.optimizer, fsdp_options);
    deferred->fsdp.load_full_state_dict(ddp::state_dict(*whole));
    trainer = std::move(deferred);
  } else if (spec.model == "seq") {
    fsdp_options.min_num_params(200);
    auto model = torch::nn::Sequential(torch::nn::Linear(10, 33), torch::nn::ReLU(), torch::nn::Linear(33, 17),
                                       torch::nn::Tanh(), torch::nn::Linear(17, 5));
    model->to(device);
    trainer = detail::make_trainer(model, spec.strategy, group, spec.optimizer, fsdp_options, mesh);
  } else if (spec.model == "tiny") {
    fsdp_options.min_num_params(1);
    auto model = torch::nn::Sequential(torch::nn::Linear(10, 1), torch::nn::Tanh(), torch::nn::Linear(1, 1));
    model->to(device);
    trainer = detail::make_trainer(model, spec.strategy, group, spec.optimizer, fsdp_options, mesh);
  } else if (spec.model == "wrapped") {
    WrappedNet model;
    model->to(device);
    trainer = detail::make_trainer(model, spec.strategy, group, spec.optimizer, fsdp_options, mesh);
  } else {
    throw std::invalid_argument("the model must be seq, tiny or wrapped, not '" + spec.model + "'");
  }
  const bool single = spec.strategy == "single";
  const int rank = single ? 0 : group->rank();
  const int world = single ? 1 : group->size();
  TrainResult result;
  result.units = trainer->units();
  if (!spec.load_full.empty()) {
    trainer->load_full(ddp::load_state_dict(spec.load_full + ".model.pt"), ddp::load_value(spec.load_full + ".optim.pt"));
  }
  if (!spec.load_dcp.empty()) result.loaded = trainer->load_dcp(spec.load_dcp);

  for (int64_t step = spec.first_step; step < spec.first_step + spec.steps; ++step) {
    auto [x, y] = global_batch(step);
    x = x.to(device);
    y = y.to(device);
    at::Tensor rows = at::arange(rank, x.size(0), world, at::TensorOptions().dtype(at::kLong).device(device));
    x = x.index_select(0, rows);
    y = y.index_select(0, rows);
    trainer->zero_grad();
    // Gradient accumulation: several backward passes, one optimizer step.
    for (const auto& part : at::arange(x.size(0), at::TensorOptions().dtype(at::kLong).device(device))
                                .tensor_split(spec.micro_batches)) {
      at::Tensor loss = torch::nn::functional::mse_loss(trainer->forward(x.index_select(0, part)),
                                                        y.index_select(0, part)) *
                        (static_cast<double>(part.numel()) / static_cast<double>(x.size(0)));
      if (step == spec.first_step + 1 && result.bytes_after_forward == 0) {
        result.bytes_after_forward = trainer->memory().parameter_bytes;
      }
      loss.backward();
    }
    if (spec.clip_max_norm > 0) {
      result.norms.push_back(trainer->clip(spec.clip_max_norm, spec.clip_norm_type, spec.clip_with_libtorch));
    }
    trainer->step();
  }
  result.between_steps = trainer->memory();
  if (!spec.save_full.empty()) {
    auto model_state = trainer->full_state();
    auto optim_state = trainer->full_optim_state();
    if (rank == 0) {
      ddp::save_state_dict(model_state, spec.save_full + ".model.pt");
      ddp::save_value(optim_state, spec.save_full + ".optim.pt");
    }
  }
  if (!spec.save_dcp.empty()) trainer->save_dcp(spec.save_dcp);
  result.state = trainer->full_state();
  if (!single) group->barrier();
  return result;
}

}  // namespace ddp::testing
