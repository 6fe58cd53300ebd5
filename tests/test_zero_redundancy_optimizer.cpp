// ZeroRedundancyOptimizer (ZeRO-1) on real processes (support/ranks.h):
// each rank steps its shard, yet the weights and the consolidated optimizer
// state equal the full optimizer's, bit for bit.
#include <support/launch.h>
#include <support/ddp_models.h>
#include <support/ddp_scenarios.h>
#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;

TEST(ZeroRedundancyOptimizer, MatchesTheFullOptimizerBitForBit) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (const std::string kind : {"adam", "adamw", "sgd"}) expect_zero_matches_full_optimizer(group, kind);
  }));
}

TEST(ZeroRedundancyOptimizer, MatchesTheFullOptimizerBitForBitAtThreeRanks) {
  expect_all_succeeded(
      run_on_ranks(3, [](const Group& group) { expect_zero_matches_full_optimizer(group, "adam"); }));
}

TEST(ZeroRedundancyOptimizer, ConsolidatedStateLoadsIntoPythonAdam) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&](const Group& group) {
    auto consolidated = expect_zero_matches_full_optimizer(group, "adam");
    if (group->rank() == 0) ddp::save_value(consolidated, dir / "optimizer.pt");
  });
  expect_all_succeeded(ranks);
  auto py = run_process({DDP_PYTHON, "-c",
                         "import sys, torch\n"
                         "s = torch.load(sys.argv[1])\n"
                         "m = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))\n"
                         "opt = torch.optim.Adam(m.parameters(), lr=0.5)\n"
                         "opt.load_state_dict(s)\n"
                         "print('loaded', len(opt.state), 'states, step', float(opt.state[m[0].weight]['step']),"
                         " 'lr', opt.param_groups[0]['lr'])\n",
                         dir / "optimizer.pt"});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_NE(py.out.find("loaded 6 states, step 6.0 lr 0.01"), std::string::npos) << py.out;
}

}  // namespace
