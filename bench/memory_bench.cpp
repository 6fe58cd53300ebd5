// Per-rank memory of DDP against ZeRO-1 on a large model: bytes held for
// parameters, gradients (with DDP's buckets) and optimizer state, and the
// process's peak resident memory. Driver: bench/run_memory_bench.py.
//
//   ddprun --standalone --nproc-per-node 2 memory_bench --strategy zero1

#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

namespace {

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

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string strategy = "ddp";
    int64_t width = 2560, layers = 8, steps = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
      std::string k = argv[i], v = argv[i + 1];
      if (k == "--strategy") strategy = v;
      else if (k == "--width") width = std::stoll(v);
      else if (k == "--layers") layers = std::stoll(v);
      else if (k == "--steps") steps = std::stoll(v);
      else throw std::invalid_argument("unknown flag " + k);
    }
    if (strategy != "ddp" && strategy != "zero1") throw std::invalid_argument("--strategy must be ddp or zero1");
    at::set_num_threads(1);
    auto group = ddp::init_process_group();
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int64_t l = 0; l < layers; ++l) net->push_back(torch::nn::Linear(width, width));
    ddp::DistributedDataParallel<torch::nn::Sequential> model(net, group);
    auto params = model->parameters();
    std::unique_ptr<torch::optim::Optimizer> full;
    std::unique_ptr<ddp::ZeroRedundancyOptimizer> zero;
    if (strategy == "ddp") {
      full = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
    } else {
      zero = std::make_unique<ddp::ZeroRedundancyOptimizer>(params, group, [](std::vector<at::Tensor> shard) {
        return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-4));
      });
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(group->rank());
    at::Tensor x = at::randn({8, width}, generator);
    at::Tensor y = at::randint(0, width, {8}, generator, at::kLong);
    double step_ms = 0;
    for (int64_t s = 0; s < steps; ++s) {
      auto start = std::chrono::steady_clock::now();
      if (full) full->zero_grad(); else zero->zero_grad();
      torch::nn::functional::cross_entropy(model.forward(x), y).backward();
      if (full) full->step(); else zero->step();
      step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    }
    int64_t param_bytes = 0, grad_bytes = 0, bucket_bytes = 0, numel = 0;
    for (auto& p : params) {
      param_bytes += static_cast<int64_t>(p.nbytes());
      numel += p.numel();
      if (p.grad().defined()) grad_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    for (size_t b = 0; b < model.reducer().bucket_assignment().size(); ++b) {
      bucket_bytes += static_cast<int64_t>(model.reducer().bucket_buffer(b).nbytes());
    }
    int64_t optimizer_bytes = optimizer_state_bytes(full ? *full : zero->local_optimizer());
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    // Every rank reports; the driver keeps the largest.
    std::printf("{\"strategy\":\"%s\",\"world\":%d,\"rank\":%d,\"parameters\":%lld,\"param_bytes\":%lld,"
                "\"grad_bytes\":%lld,\"bucket_bytes\":%lld,\"optimizer_bytes\":%lld,\"peak_rss_bytes\":%lld,"
                "\"last_step_ms\":%.1f}\n",
                strategy.c_str(), group->size(), group->rank(), static_cast<long long>(numel),
                static_cast<long long>(param_bytes), static_cast<long long>(grad_bytes),
                static_cast<long long>(bucket_bytes), static_cast<long long>(optimizer_bytes),
                static_cast<long long>(usage.ru_maxrss) * 1024, step_ms);
    std::fflush(stdout);
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
