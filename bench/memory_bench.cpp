// Per-rank memory of DDP, ZeRO-1 and FSDP on a large model: bytes held for
// parameters, gradients (with DDP's buckets) and optimizer state between
// steps, the process's peak resident memory, and the median step time.
// Driver: bench/run_memory_bench.py.
//
//   ddprun --standalone --nproc-per-node 2 memory_bench --strategy fsdp-full
//
// --param-dtype bf16 (fsdp-full and fsdp-grad-op only) gathers and computes
// the units in bfloat16 (FSDPOptions::param_dtype, the shards stay float32
// master weights) with the loss in float32 (output_dtype); the JSON line's
// peak_param_bytes is the most parameter bytes held at any moment during the
// steps (ShardedMemory::peak_parameter_bytes; 0 for ddp and zero1).
//
// --deferred (fsdp-full and fsdp-grad-op only) builds the model one layer at
// a time (ddp::DeferredSequential), sharding each before the next exists;
// the JSON line's construction_peak_rss_bytes (the process's peak resident
// memory right after the wrapper is built) and rss_before_model_bytes show
// what construction cost, eager or deferred.
//
// training_peak_rss_bytes is the process's peak resident memory over the
// steps alone (VmHWM reset once the model and optimizer exist):
// bench/python_fsdp_memory_bench.py measures PyTorch's FSDP2 the same way.
//
// --strategy collectives times Gloo's all-reduce, reduce-scatter and
// all-gather of one layer's worth of floats instead: what FSDP's
// communication costs next to DDP's.

#include "bench_stats.h"

#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <CLI/CLI.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

// A line of /proc/self/status ("VmHWM", "VmRSS") in bytes.
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// Starts VmHWM again from the resident memory now (Linux 4.0 and later), so
// that a later VmHWM is the peak since this call.
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

int64_t optimizer_state_bytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (auto& [key, state] : optimizer.state()) {
    if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
      for (const auto* t : {&adam->exp_avg(), &adam->exp_avg_sq(), &adam->max_exp_avg_sq()}) {
        if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
      }
    }
  }
  return bytes;
}

// Median milliseconds of all-reduce, reduce-scatter and all-gather moving
// `numel` floats per rank (reduce-scatter's input and all-gather's output are
// the full `numel`, as FSDP uses them).
int time_collectives(const std::shared_ptr<ddp::ProcessGroup>& group_ptr, int64_t numel, int64_t repeats) {
  ddp::ProcessGroup& group = *group_ptr;
  const int64_t world = group.size();
  numel = numel / world * world;
  at::Tensor full = at::randn({numel});
  at::Tensor part = at::randn({numel / world});
  auto time = [&](auto&& collective) {
    std::vector<double> ms;
    for (int64_t i = 0; i < repeats; ++i) {
      group.barrier();
      auto start = std::chrono::steady_clock::now();
      collective();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    return bench::median(ms);
  };
  double all_reduce = time([&] { group.all_reduce(full); });
  // Gloo's own, called on the c10d backend directly.
  const auto& backend = group.c10d_backend();
  double reduce_scatter = time([&] {
    c10d::ReduceScatterOptions opts;
    opts.timeout = group.timeout();
    group.wait(backend->_reduce_scatter_base(part, full, opts), "reduce_scatter");
  });
  double all_gather = time([&] {
    c10d::AllgatherOptions opts;
    opts.timeout = group.timeout();
    group.wait(backend->_allgather_base(full, part, opts), "all_gather");
  });
  // ProcessGroup's, which are the rings of send/recv on Gloo CPU tensors.
  double ring_reduce_scatter = time([&] { group.wait(group.reduce_scatter_async(part, full), "reduce_scatter"); });
  double ring_all_gather = time([&] { group.wait(group.all_gather_into_async(full, part), "all_gather"); });
  bench::print_json_line({{"strategy", "collectives"},
                          {"world", group.size()},
                          {"rank", group.rank()},
                          {"numel", numel},
                          {"all_reduce_ms", bench::rounded(all_reduce, 2)},
                          {"reduce_scatter_ms", bench::rounded(reduce_scatter, 2)},
                          {"all_gather_ms", bench::rounded(all_gather, 2)},
                          {"ring_reduce_scatter_ms", bench::rounded(ring_reduce_scatter, 2)},
                          {"ring_all_gather_ms", bench::rounded(ring_all_gather, 2)}});
  group.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string strategy = "ddp";
  std::string param_dtype = "fp32";
  int64_t width = 2560, layers = 8, steps = 5;
  bool deferred = false;
  CLI::App app("Per-rank memory and step time of DDP, ZeRO-1 and FSDP; prints one JSON line per rank.",
               "memory_bench");
  app.option_defaults()->always_capture_default();
  app.add_option("--strategy", strategy, "what holds the model, or collectives: Gloo's collectives alone")
      ->check(CLI::IsMember({"ddp", "zero1", "fsdp-full", "fsdp-grad-op", "collectives"}));
  app.add_option("--width", width, "features of each Linear layer")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "Linear layers")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "training steps (the first is not timed)")->check(CLI::PositiveNumber);
  app.add_option("--param-dtype", param_dtype, "the units' compute dtype (bf16: fsdp-full and fsdp-grad-op only)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--deferred", deferred, "build the FSDP model one layer at a time (fsdp-full and fsdp-grad-op only)");
  CLI11_PARSE(app, argc, argv);
  try {
    const bool is_fsdp = strategy == "fsdp-full" || strategy == "fsdp-grad-op";
    const bool bf16 = param_dtype == "bf16";
    if (bf16 && !is_fsdp) throw std::invalid_argument("--param-dtype bf16 needs --strategy fsdp-full or fsdp-grad-op");
    if (deferred && !is_fsdp) throw std::invalid_argument("--deferred needs --strategy fsdp-full or fsdp-grad-op");
    at::set_num_threads(1);
    auto group = ddp::init_process_group();
    if (strategy == "collectives") return time_collectives(group, width * width, 2 * steps + 1);
    const int64_t rss_before_model = status_bytes("VmRSS");
    torch::manual_seed(0);
    torch::nn::Sequential net;
    ddp::DeferredSequential deferred_layers;
    for (int64_t l = 0; l < layers; ++l) {
      if (deferred) deferred_layers.add([width] { return torch::nn::Linear(width, width); });
      else net->push_back(torch::nn::Linear(width, width));
    }
    // One FSDP unit per layer: at most two layers (the running one and the
    // prefetched one) are ever gathered.
    std::unique_ptr<ddp::DistributedDataParallel<torch::nn::Sequential>> ddp_model;
    std::unique_ptr<ddp::FullyShardedDataParallel<torch::nn::Sequential>> fsdp_model;
    std::vector<at::Tensor> params;
    if (is_fsdp) {
      auto options = ddp::FSDPOptions().min_num_params(1).sharding_strategy(
          strategy == "fsdp-full" ? ddp::ShardingStrategy::kFullShard : ddp::ShardingStrategy::kShardGradOp);
      // bf16 compute, float32 master weights in the shards, float32 loss.
      if (bf16) options.param_dtype(at::kBFloat16).output_dtype(at::kFloat);
      if (deferred) {
        fsdp_model = std::make_unique<ddp::FullyShardedDataParallel<torch::nn::Sequential>>(deferred_layers, group,
                                                                                             options.min_num_params(0));
        net = fsdp_model->module();
      } else {
        fsdp_model = std::make_unique<ddp::FullyShardedDataParallel<torch::nn::Sequential>>(net, group, options);
      }
      params = fsdp_model->parameters();
    } else {
      ddp_model = std::make_unique<ddp::DistributedDataParallel<torch::nn::Sequential>>(net, group);
      params = (*ddp_model)->parameters();
    }
    const int64_t construction_peak_rss = status_bytes("VmHWM");
    auto forward = [&](const at::Tensor& x) { return is_fsdp ? fsdp_model->forward(x) : ddp_model->forward(x); };
    std::unique_ptr<torch::optim::Optimizer> full;
    std::unique_ptr<ddp::ZeroRedundancyOptimizer> zero;
    if (strategy != "zero1") {
      full = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
    } else {
      zero = std::make_unique<ddp::ZeroRedundancyOptimizer>(params, group, [](std::vector<at::Tensor> shard) {
        return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-4));
      });
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(group->rank());
    at::Tensor x = at::randn({8, width}, generator);
    at::Tensor y = at::randint(0, width, {8}, generator, at::kLong);
    std::vector<double> step_ms;
    // The peak over the steps, not over construction.
    if (is_fsdp) fsdp_model->reset_peak_memory();
    reset_peak_rss();
    for (int64_t s = 0; s < steps; ++s) {
      group->barrier();
      auto start = std::chrono::steady_clock::now();
      if (full) full->zero_grad(); else zero->zero_grad();
      torch::nn::functional::cross_entropy(forward(x), y).backward();
      if (full) full->step(); else zero->step();
      // The first step allocates optimizer state: not a typical step.
      if (s > 0) {
        step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
    }
    int64_t param_bytes = 0, grad_bytes = 0, bucket_bytes = 0, numel = 0, peak_param_bytes = 0;
    for (auto& p : net->parameters()) numel += p.numel();
    if (is_fsdp) {
      auto held = fsdp_model->memory();
      param_bytes = held.parameter_bytes;
      grad_bytes = held.gradient_bytes;
      peak_param_bytes = held.peak_parameter_bytes;
    } else {
      for (auto& p : params) {
        param_bytes += static_cast<int64_t>(p.nbytes());
        if (p.grad().defined()) grad_bytes += static_cast<int64_t>(p.grad().nbytes());
      }
      for (size_t b = 0; b < ddp_model->bucket_assignment().size(); ++b) {
        bucket_bytes += static_cast<int64_t>(ddp_model->bucket_buffer(b).nbytes());
      }
    }
    int64_t optimizer_bytes = optimizer_state_bytes(full ? *full : zero->local_optimizer());
    const int64_t training_peak_rss = status_bytes("VmHWM");
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    // Every rank reports; the driver keeps the largest.
    bench::print_json_line({{"strategy", strategy},
                            {"world", group->size()},
                            {"rank", group->rank()},
                            {"parameters", numel},
                            {"param_bytes", param_bytes},
                            {"grad_bytes", grad_bytes},
                            {"bucket_bytes", bucket_bytes},
                            {"optimizer_bytes", optimizer_bytes},
                            {"peak_rss_bytes", static_cast<int64_t>(usage.ru_maxrss) * 1024},
                            {"rss_before_model_bytes", rss_before_model},
                            {"construction_peak_rss_bytes", construction_peak_rss},
                            {"training_peak_rss_bytes", training_peak_rss},
                            {"deferred", deferred},
                            {"peak_param_bytes", peak_param_bytes},
                            {"param_dtype", param_dtype},
                            {"step_ms", bench::rounded(bench::median(step_ms), 1)}});
    group->barrier();
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
