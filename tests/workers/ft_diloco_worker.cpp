// One replica of a DiLoCo job for tests/test_ft_diloco.cpp: a small MLP
// trained by AdamW inner steps, synchronised by ddp::DiLoCo either under
// FaultTolerance (FTD_MODE=ft, DDP_FT_* as ddprun --fault-tolerance gives) or
// over a fixed Gloo group (FTD_MODE=group, RANK/WORLD_SIZE/MASTER_*). Each
// replica trains on rows chosen by its rank and the inner step, so both modes
// see the same data. After each sync it prints
//   sync <index> skipped <syncs skipped so far> hash <global weights' hash>
// and at the end "final <hash>". Environment:
//   FTD_STEPS    inner steps (default 100)      FTD_H        sync_every (default 5)
//   FTD_STEP_MS  sleep per inner step (default 0)  FTD_SEED  initial weights' seed (default 7)

#include <ddp/ddp.h>
#include <ddp/diloco.h>
#include <ddp/fault_tolerance.h>

#include "../support/ft_worker_common.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

using ddp::testing::env_int;
using ddp::testing::hash_of;

int main() {
  return ddp::testing::run_replica([] {
    const bool ft_mode = std::string(std::getenv("FTD_MODE") ? std::getenv("FTD_MODE") : "ft") == "ft";
    const int64_t steps = env_int("FTD_STEPS", 100);
    const int64_t h = env_int("FTD_H", 5);
    const int64_t step_ms = env_int("FTD_STEP_MS", 0);

    torch::manual_seed(1);
    const int64_t rows = 64, batch = 8;
    at::Tensor features = torch::randn({rows, 8});
    at::Tensor targets = features.sum(1, /*keepdim=*/true).sin();

    torch::manual_seed(env_int("FTD_SEED", 7));
    torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    const auto options = ddp::DiLoCoOptions().sync_every(h);

    std::unique_ptr<ddp::FaultTolerance> ft;
    std::shared_ptr<ddp::ProcessGroup> group;
    std::unique_ptr<ddp::DiLoCo> diloco;
    if (ft_mode) {
      ft = std::make_unique<ddp::FaultTolerance>();
      diloco = std::make_unique<ddp::DiLoCo>(*net, inner, *ft, options);
    } else {
      ddp::World world;
      world.rank = static_cast<int>(env_int("RANK", 0));
      world.world_size = static_cast<int>(env_int("WORLD_SIZE", 1));
      world.master_addr = std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1";
      world.master_port = static_cast<int>(env_int("MASTER_PORT", 0));
      group = ddp::ProcessGroup::create(
          world, ddp::ProcessGroupOptions().backend(ddp::BackendKind::kGloo).init_method("env://"));
      diloco = std::make_unique<ddp::DiLoCo>(*net, inner, group, options);
    }
    std::printf("joined at %lld\n", static_cast<long long>(diloco->inner_step()));
    std::fflush(stdout);

    while (diloco->inner_step() < steps) {
      const int64_t t = diloco->inner_step();
      const int64_t rank = ft_mode ? ft->rank() : group->rank();
      at::Tensor index = (torch::arange(batch, at::kLong) + t * batch + rank * 2 * batch).remainder(rows);
      if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
      inner.zero_grad();
      auto out = net->forward(features.index_select(0, index));
      (out - targets.index_select(0, index)).pow(2).mean().backward();
      diloco->step();
      if (diloco->inner_step() % h == 0) {
        std::printf("sync %lld skipped %lld hash %016llx\n", static_cast<long long>(diloco->inner_step() / h),
                    static_cast<long long>(diloco->skipped_syncs()),
                    static_cast<unsigned long long>(hash_of(diloco->global_parameters())));
        std::fflush(stdout);
      }
    }
    std::printf("final %016llx\n", static_cast<unsigned long long>(hash_of(diloco->global_parameters())));
    if (ft) std::printf("stats %s\n", ft->stats_json().c_str());
    std::fflush(stdout);
    return 0;
  });
}
