// One replica of a fault-tolerant job for tests/test_ft_healing.cpp. Like
// ft_worker, it prints one line per committed step
//   step <s> gen <g> rank <r>/<n> hash <weights' hash> t <us> window <i,...> mine <i,...>
// "heal_bytes_sent <n>" when this member's counter of state sent to joiners grew, then
// "final <hash>", "stats <json>" and, for Wine, "heldout accuracy <a> loss <l>".
// Environment: DDP_FT_* (as ddprun gives), and
//   FT_MODEL        "mlp" (synthetic data, FT_HIDDEN wide: several MB at 1024) or "wine"
//                   (wine_fault_tolerant.h's model, optimizer and sampler on the shipped split)
//   FT_HIDDEN       the MLP's hidden width (default 64)
//   FT_STEPS        committed steps to train (mlp; default 40)
//   FT_EPOCHS       epochs to train (wine; default 60)
//   FT_BATCH        samples per replica and step (default 8)
//   FT_STEP_MS      sleep per step, so a test can act mid-training (default 20)
//   FT_SEED         the seed of the initial weights (default 7)
//   FT_DATA_SEED    the sampler's seed, the job's (default 3)
//   FT_HASH_EVERY   hash the weights on every this many steps only (default 1)

#include <ddp/ddp.h>
#include <ddp/fault_tolerance.h>

#include "../support/ft_worker_common.h"
#include "simple_nn.h"
#include "wine_data.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

using ddp::testing::env_int;
using ddp::testing::hash_of;

namespace {

struct Data {
  at::Tensor train_x, train_y, test_x, test_y;
};

// The training loop of both models: wine_fault_tolerant.h's, plus a sleep
// per step and the step lines.
template <typename Net>
int train(Net net, const Data& data, bool by_epochs, int64_t length, double lr, uint64_t sampler_seed) {
  const int64_t step_ms = env_int("FT_STEP_MS", 20);
  const int64_t hash_every = std::max<int64_t>(1, env_int("FT_HASH_EVERY", 1));
  ddp::FaultTolerance ft;
  ddp::DistributedDataParallel<Net> model(net, ft.local_group(), ft.ddp_options());
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(lr));
  ddp::FaultTolerantSampler sampler(data.train_x.size(0), env_int("FT_BATCH", 8), sampler_seed);
  ft.manage(net.ptr(), &optimizer, &sampler);
  auto done = [&] { return by_epochs ? sampler.epoch() >= length : ft.step() >= length; };
  int64_t heal_sent = 0;
  while (!done()) {
    ft.start_step();
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    const int rank = ft.rank(), size = ft.size();
    const std::vector<int64_t> window = sampler.window(size);
    const std::vector<int64_t> mine = sampler.batch(rank, size);
    at::Tensor index = torch::tensor(mine, at::kLong);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model.forward(data.train_x.index_select(0, index)),
                                                     data.train_y.index_select(0, index));
    loss.backward();
    const int64_t gen = ft.generation();
    if (ft.should_commit()) {
      optimizer.step();
      const int64_t s = ft.step() - 1;
      const bool hashed = s % hash_every == 0 || done();
      ddp::testing::print_step_line(s, gen, rank, size, hashed ? net.get() : nullptr, window, mine);
      if (ft.stats().heal_bytes_sent != heal_sent) {
        heal_sent = ft.stats().heal_bytes_sent;
        std::printf("heal_bytes_sent %lld\n", static_cast<long long>(heal_sent));
      }
    } else {
      std::printf("skipped step %lld gen %lld\n", static_cast<long long>(ft.step()), static_cast<long long>(gen));
    }
    std::fflush(stdout);
  }
  std::printf("final %016llx\n", static_cast<unsigned long long>(hash_of(*net)));
  if (data.test_x.defined()) {
    torch::NoGradGuard no_grad;
    at::Tensor logits = net->forward(data.test_x);
    const double accuracy = logits.argmax(1).eq(data.test_y).to(at::kDouble).mean().item<double>();
    const double loss = torch::nn::functional::cross_entropy(logits, data.test_y).item<double>();
    std::printf("heldout accuracy %.6f loss %.6f\n", accuracy, loss);
  }
  std::printf("stats %s\n", ft.stats_json().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main() {
  return ddp::testing::run_replica([] {
    const std::string kind = std::getenv("FT_MODEL") ? std::getenv("FT_MODEL") : "mlp";
    const int64_t seed = env_int("FT_SEED", 7);
    const auto data_seed = static_cast<uint64_t>(env_int("FT_DATA_SEED", 3));
    if (kind == "wine") {
      wine::Split split = wine::load_split();
      Data data{split.train.features, split.train.labels, split.test.features, split.test.labels};
      torch::manual_seed(seed);
      wine::SimpleNN net;
      return train(net, data, /*by_epochs=*/true, env_int("FT_EPOCHS", 60), 1e-3, data_seed);
    }
    const int64_t hidden = env_int("FT_HIDDEN", 64), dataset_size = 240;
    // The same data on every replica.
    torch::manual_seed(1);
    Data data;
    data.train_x = torch::randn({dataset_size, 16});
    data.train_y = data.train_x.sum(1).gt(0).to(at::kLong);
    // Replicas may start from different weights: the first quorum's rank 0
    // gives everyone its own, and a joiner receives the members'.
    torch::manual_seed(seed);
    torch::nn::Sequential net(torch::nn::Linear(16, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, hidden),
                              torch::nn::ReLU(), torch::nn::Linear(hidden, 2));
    return train(net, data, /*by_epochs=*/false, env_int("FT_STEPS", 40), 1e-3, data_seed);
  });
}
