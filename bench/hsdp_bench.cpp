// HSDP against FSDP FULL_SHARD and DDP across nodes: step time, and the bytes
// that leave each node per step, read from the node's network interfaces
// (/sys/class/net/*/statistics/tx_bytes, loopback excluded), not computed.
// Meant for nodes that are network namespaces joined by a (rate-limited)
// veth pair, each namespace running ddprun; bench/run_hsdp_bench.py drives it.
//
//   ddprun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
//       hsdp_bench --strategy hsdp --steps 10
//
// Strategies: ddp (DistributedDataParallel over every rank), fsdp (FULL_SHARD
// over every rank), hsdp (FULL_SHARD within the node, replicated across
// nodes: DeviceMesh::from_launcher), hsdp-zero2 (SHARD_GRAD_OP within),
// ddp-hier (DDP with hierarchical_allreduce_hook: reduce in the node,
// all-reduce between node leaders, broadcast in the node), ddp-unused (DDP
// with find_unused_parameters) and ddp-static (the same with static_graph).
// The model: --layers Linear(width, width) children, each an FSDP unit.
//
// Prints one JSON line (rank 0): the median step time and the bytes all
// nodes sent, per step, over the timed steps.

#include "bench_stats.h"

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <CLI/CLI.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string strategy = "hsdp";
  int64_t width = 1024;
  int64_t layers = 4;
  int64_t batch = 8;  // per rank
  int64_t steps = 10;
  int64_t warmup = 2;
};

// Bytes this network namespace has sent on every interface but loopback.
int64_t node_tx_bytes() {
  int64_t total = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/class/net")) {
    if (entry.path().filename() == "lo") continue;
    std::ifstream counter(entry.path() / "statistics" / "tx_bytes");
    int64_t bytes = 0;
    if (counter >> bytes) total += bytes;
  }
  return total;
}

// The model's training step behind one interface.
struct Trainer {
  virtual ~Trainer() = default;
  virtual void step(const at::Tensor& x, const at::Tensor& y) = 0;
};

template <typename Wrapper>
struct WrappedTrainer : Trainer {
  template <typename... Args>
  explicit WrappedTrainer(Args&&... args)
      : model(std::forward<Args>(args)...), optimizer(parameters(model), torch::optim::SGDOptions(1e-3)) {}
  static std::vector<at::Tensor> parameters(ddp::DistributedDataParallel<torch::nn::Sequential>& m) {
    return m->parameters();
  }
  static std::vector<at::Tensor> parameters(ddp::FullyShardedDataParallel<torch::nn::Sequential>& m) {
    return m.parameters();
  }
  void step(const at::Tensor& x, const at::Tensor& y) override {
    optimizer.zero_grad();
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    optimizer.step();
  }
  Wrapper model;
  torch::optim::SGD optimizer;
};

torch::nn::Sequential make_model(const Config& c) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < c.layers; ++i) {
    net->push_back(torch::nn::Linear(c.width, c.width));
    if (i + 1 < c.layers) net->push_back(torch::nn::ReLU());
  }
  return net;
}

std::unique_ptr<Trainer> make_trainer(const Config& c, const std::shared_ptr<ddp::ProcessGroup>& world) {
  using Fsdp = ddp::FullyShardedDataParallel<torch::nn::Sequential>;
  // Every Linear its own unit (ReLUs have no parameters).
  const auto options = ddp::FSDPOptions().min_num_params(1);
  if (c.strategy == "ddp") {
    return std::make_unique<WrappedTrainer<ddp::DistributedDataParallel<torch::nn::Sequential>>>(make_model(c), world);
  }
  if (c.strategy == "ddp-unused" || c.strategy == "ddp-static") {
    return std::make_unique<WrappedTrainer<ddp::DistributedDataParallel<torch::nn::Sequential>>>(
        make_model(c), world,
        ddp::DDPOptions().find_unused_parameters(true).static_graph(c.strategy == "ddp-static"));
  }
  if (c.strategy == "fsdp") return std::make_unique<WrappedTrainer<Fsdp>>(make_model(c), world, options);
  const auto mesh = ddp::DeviceMesh::from_launcher(world);
  if (c.strategy == "ddp-hier") {
    return std::make_unique<WrappedTrainer<ddp::DistributedDataParallel<torch::nn::Sequential>>>(
        make_model(c), world, ddp::DDPOptions().comm_hook(ddp::hierarchical_allreduce_hook(mesh)));
  }
  auto hybrid = options;
  hybrid.sharding_strategy(c.strategy == "hsdp" ? ddp::ShardingStrategy::kHybridShard
                                                : ddp::ShardingStrategy::kHybridShardZero2);
  return std::make_unique<WrappedTrainer<Fsdp>>(make_model(c), mesh, hybrid);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"HSDP against FSDP and DDP across nodes: step time and bytes sent per step"};
  app.option_defaults()->always_capture_default();
  app.add_option("--strategy", c.strategy, "how the model is spread")
      ->check(CLI::IsMember({"ddp", "ddp-hier", "ddp-unused", "ddp-static", "fsdp", "hsdp", "hsdp-zero2"}));
  app.add_option("--width", c.width, "features of each Linear")->check(CLI::PositiveNumber);
  app.add_option("--layers", c.layers, "Linear(width, width) children")->check(CLI::PositiveNumber);
  app.add_option("--batch", c.batch, "rows per rank")->check(CLI::PositiveNumber);
  app.add_option("--steps", c.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    auto world = ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::BackendKind::kGloo));
    auto trainer = make_trainer(c, world);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1 + world->rank());
    const at::Tensor x = at::randn({c.batch, c.width}, generator), y = at::randn({c.batch, c.width}, generator);
    for (int64_t i = 0; i < c.warmup; ++i) trainer->step(x, y);
    world->barrier();
    // One reader per node: its local rank 0.
    const bool reads = world->world().local_rank == 0;
    const int64_t before = reads ? node_tx_bytes() : 0;
    std::vector<double> ms;
    for (int64_t i = 0; i < c.steps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      trainer->step(x, y);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    world->barrier();
    at::Tensor sent = at::full({1}, reads ? static_cast<double>(node_tx_bytes() - before) : 0.0, at::kDouble);
    world->all_reduce(sent);
    if (world->rank() == 0) {
      int64_t params = 0;
      for (const auto& p : make_model(c)->parameters()) params += p.numel();
      nlohmann::ordered_json line;
      line["strategy"] = c.strategy;
      line["world_size"] = world->size();
      line["nodes"] = world->size() / world->world().local_world_size;
      line["model_bytes"] = params * 4;
      line["steps"] = c.steps;
      line["ms_per_step_median"] = bench::rounded(bench::median(ms), 3);
      line["bytes_sent_per_step"] = static_cast<int64_t>(sent.item<double>() / static_cast<double>(c.steps));
      std::cout << line.dump() << std::endl;
    }
    world->shutdown();
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
