// One replica of a fault-tolerant job for tests/test_fault_tolerance.cpp: a
// small MLP trained by DDP over FaultTolerance on a synthetic dataset, with
// FaultTolerantSampler. It prints one line per committed step:
//   step <s> gen <g> rank <r>/<n> hash <weights' hash> window <i,i,...> mine <i,...>
// and "final <hash>" at the end, so the test can compare members bit for bit
// and check every sample. Environment: DDP_FT_* (as ddprun gives), and
//   FT_STEPS        committed steps to train (default 60)
//   FT_STEP_MS      sleep per step, so a test can act mid-training (default 20)
//   FT_LEAVE_AT     leave cleanly once this many steps are committed
//   FT_ADMIT_AT     hold joiners until this step, then wait there for one
//   FT_QUIET_STEPS  print step lines only every this many steps (default 1)
//   FT_SEED         the seed of the initial weights (default 7)
//   FT_STATE_MB     a frozen buffer of this many MiB in the model (default 0): a
//                   joiner's heal then carries that much state while the steps
//                   stay as cheap: the buffers' per-step broadcast is off unless
//                   FT_BROADCAST_BUFFERS=1 says otherwise
//   FT_BATCHNORM    1: a BatchNorm1d after the first layer, and a line right after
//                   each start_step():
//                     buffers <step> gen <g> rank <r>/<n> hash <buffers' hash>
//                   and "after ..." alike after backward (what the step's forward made of them)
//   FT_BROADCAST_BUFFERS  0: FaultToleranceOptions::broadcast_buffers(false)
//   FT_FIXED_SIZE   FaultToleranceOptions::fixed_size (spares beyond it); the
//                   step lines' n is then the participants, and a spare's rank >= n
//   FT_STOP_RANK0_BEFORE_STEP  the member that is rank 0 when this step comes up
//                   prints "stopping before step <s>" and stops itself (SIGSTOP)
//                   before start_step(), so the others wait in the buffers' broadcast

#include <ddp/ddp.h>
#include <ddp/fault_tolerance.h>

#include "../support/ft_worker_common.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/adam.h>

#include <csignal>
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
    const int64_t steps = env_int("FT_STEPS", 60);
    const int64_t step_ms = env_int("FT_STEP_MS", 20);
    const int64_t leave_at = env_int("FT_LEAVE_AT", -1);
    const int64_t admit_at = env_int("FT_ADMIT_AT", -1);
    const int64_t quiet = std::max<int64_t>(1, env_int("FT_QUIET_STEPS", 1));
    const int64_t dataset_size = 240, batch = 8;

    // The same data on every replica.
    torch::manual_seed(1);
    at::Tensor features = torch::randn({dataset_size, 16});
    at::Tensor labels = features.sum(1).gt(0).to(at::kLong);

    // Replicas may start from different weights (FT_SEED): the first quorum's
    // rank 0 gives everyone its own, and a joiner receives the members'.
    torch::manual_seed(env_int("FT_SEED", 7));
    const bool batchnorm = env_int("FT_BATCHNORM", 0) == 1;
    torch::nn::Sequential net(torch::nn::Linear(16, 64));
    if (batchnorm) net->push_back(torch::nn::BatchNorm1d(64));
    net->push_back(torch::nn::ReLU());
    net->push_back(torch::nn::Linear(64, 2));
    const int64_t state_mb = env_int("FT_STATE_MB", 0);
    if (state_mb > 0) {
      net->register_buffer("ballast", torch::randn({state_mb * 1024 * 1024 / 4}));
    }
    const int64_t stop_before = env_int("FT_STOP_RANK0_BEFORE_STEP", -1);
    bool stopped = false;  // once: the attempt it broke is skipped, and comes up again

    ddp::FaultTolerance ft(
        ddp::FaultToleranceOptions()
            .broadcast_buffers(env_int("FT_BROADCAST_BUFFERS", state_mb > 0 ? 0 : 1) != 0)
            .fixed_size(static_cast<int>(env_int("FT_FIXED_SIZE", 0))));
    ddp::DistributedDataParallel<torch::nn::Sequential> model(net, ft.local_group(), ft.ddp_options());
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
    ddp::FaultTolerantSampler sampler(dataset_size, batch, /*seed=*/3);
    ft.manage(net.ptr(), &optimizer, &sampler);
    if (admit_at >= 0) ft.hold_joiners(true);

    while (ft.step() < steps) {
      if (leave_at >= 0 && ft.step() == leave_at && ft.size() > 0) {
        std::printf("leaving at %lld\n", static_cast<long long>(ft.step()));
        std::fflush(stdout);
        ft.leave();
        return 0;
      }
      if (admit_at >= 0 && ft.step() >= admit_at) ft.hold_joiners(false);
      if (ft.step() == stop_before && ft.rank() == 0 && !stopped) {
        stopped = true;
        std::printf("stopping before step %lld\n", static_cast<long long>(ft.step()));
        std::fflush(stdout);
        std::raise(SIGSTOP);
      }
      ft.start_step();
      if (batchnorm) {
        std::printf("buffers %lld gen %lld rank %d/%d hash %016llx\n", static_cast<long long>(ft.step()),
                    static_cast<long long>(ft.generation()), ft.rank(), ft.size(),
                    static_cast<unsigned long long>(hash_of(net->buffers())));
        std::fflush(stdout);
      }
      if (admit_at >= 0 && ft.step() == admit_at && ft.size() < 3) {
        // The scripted sequence lets the joiner in at exactly this step.
        while (!ft.join_pending()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
      // A spare (fixed-size mode) computes participant 0's batch; its gradients count for nothing.
      // Its step lines say "rank <r>/<n>" with r >= n.
      const int rank = ft.rank(), size = ft.participants();
      const int slice = ft.participating() ? rank : 0;
      const std::vector<int64_t> window = sampler.window(size);
      const std::vector<int64_t> mine = sampler.batch(slice, size);
      at::Tensor index = torch::tensor(mine, at::kLong);
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model.forward(features.index_select(0, index)),
                                                       labels.index_select(0, index));
      loss.backward();
      const int64_t gen = ft.generation();
      if (batchnorm) {
        // What this member's forward made of them: rank 0's is what DDP's next broadcast sends.
        std::printf("after %lld gen %lld rank %d/%d hash %016llx\n", static_cast<long long>(ft.step()),
                    static_cast<long long>(gen), rank, size, static_cast<unsigned long long>(hash_of(net->buffers())));
      }
      if (ft.should_commit()) {
        optimizer.step();
        const int64_t s = ft.step() - 1;
        if (s % quiet == 0 || ft.step() == steps) {
          ddp::testing::print_step_line(s, gen, rank, size, net.get(), window, mine);
          std::fflush(stdout);
        }
      } else {
        std::printf("skipped step %lld gen %lld\n", static_cast<long long>(ft.step()), static_cast<long long>(gen));
        std::fflush(stdout);
      }
    }
    std::printf("final %016llx\n", static_cast<unsigned long long>(hash_of(*net)));
    std::printf("stats %s\n", ft.stats_json().c_str());
    std::fflush(stdout);
    return 0;
  });
}
