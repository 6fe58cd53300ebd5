// FSDP's and ZeRO's checkpoints on real ranks (support/ranks.h): full state
// dicts (Python's layout) that move between strategies and world sizes,
// sharded state through a distributed checkpoint (exact at the same world
// size, resharded at another), and the refusal of mismatched state dicts.
// Steps at different world sizes run as phases over files in a RanksTempDir.
#include "support/fsdp_trainers.h"
#include "support/fsdp_nets.h"
#include "support/ranks.h"
#include "support/resume_checks.h"
#include "support/torch_errors.h"

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/distributed_checkpoint.h>
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
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#include <filesystem>

namespace {

using namespace ddp::testing;
namespace fs = std::filesystem;


// A full checkpoint (model and optimizer, the unwrapped model's layout) taken
// after 3 steps and loaded into a freshly built model resumes to the weights
// of 6 uninterrupted steps, under every strategy (NO_SHARD too, whose shard
// is the whole flat tensor). load_full_state_dict refuses a state dict with
// an entry missing, of another shape or extra, as load_state_dict does, and
// then leaves the model as it was.
TEST(FsdpFullCheckpoint, ResumesUnderEveryStrategyAndRefusesMismatchedStateDicts) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    for (auto strategy :
         {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kShardGradOp, ddp::ShardingStrategy::kNoShard}) {
      const auto options = ddp::FSDPOptions().sharding_strategy(strategy);
      ddp::StateDict straight, half, resumed;
      c10::IValue half_optim;
      {
        torch::manual_seed(0);
        ddp::FullyShardedDataParallel<BranchyNet> model(BranchyNet(), group, options);
        torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
        run_steps(model, optimizer, group, 0, 3);
        half = model.full_state_dict(/*rank0_only=*/false);
        half_optim = model.full_optim_state_dict(optimizer, /*rank0_only=*/false);
        run_steps(model, optimizer, group, 3, 3);
        straight = model.full_state_dict(/*rank0_only=*/false);
      }
      torch::manual_seed(5);  // other weights: the checkpoint must replace them
      ddp::FullyShardedDataParallel<BranchyNet> model(BranchyNet(), group, options);
      torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
      ddp::StateDict before = model.full_state_dict(/*rank0_only=*/false);

      ddp::StateDict missing(half.begin(), half.end() - 1);
      ddp::StateDict reshaped = half;
      reshaped.front().second = at::zeros({3});
      ddp::StateDict extra = half;
      extra.emplace_back("head.extra", at::zeros({1}));
      const std::string missing_name = half.back().first, reshaped_name = half.front().first;
      for (const auto& [state, expected] :
           {std::pair{missing, "has no entry '" + missing_name + "' that the model needs"},
            std::pair{reshaped, "entry '" + reshaped_name + "' has shape [3]"},
            std::pair{extra, std::string("has the entry 'head.extra' that the model lacks")}}) {
        std::string message = error_of([&, &state = state] { model.load_full_state_dict(state); });
        EXPECT_NE(message.find(expected), std::string::npos) << message;
        EXPECT_EQ(max_difference(before, model.full_state_dict(/*rank0_only=*/false)), 0.0) << expected;
      }

      model.load_full_state_dict(half);
      model.load_full_optim_state_dict(optimizer, half_optim);
      run_steps(model, optimizer, group, 3, 3);
      resumed = model.full_state_dict(/*rank0_only=*/false);
      EXPECT_EQ(max_difference(straight, resumed), 0.0) << ddp::to_string(strategy) << " rank " << group->rank();
    }
    std::printf("rank %d compared checkpoints\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared checkpoints"), std::string::npos) << r.out;
}

// A full checkpoint (model and optimizer, Python's layout) written by
// FULL_SHARD at 2 ranks resumes under other strategies at 3 ranks and alone,
// and lands exactly where uninterrupted DDP does.
TEST(FullyShardedDataParallel, FullCheckpointResumesUnderAnyStrategyAndWorldSize) {
  RanksTempDir dir;
  auto resume = [&dir](std::vector<std::string> strategies) {
    return [&dir, strategies](const Group& group) {
      for (const auto& strategy : strategies) {
        TrainSpec s;
        s.strategy = strategy;
        s.load_full = dir / "half";
        expect_resumes_to(group, s, dir / "ddp6.pt", strategy);
      }
    };
  };
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         auto reference = train(group, TrainSpec{});
         if (group->rank() == 0) ddp::save_state_dict(reference.state, dir / "ddp6.pt");
         TrainSpec first;
         first.strategy = "fsdp-full";
         first.steps = 3;
         first.save_full = dir / "half";
         train(group, first);
       }},
      {3, resume({"fsdp-grad-op", "zero1"})},
      {1, resume({"ddp"})},
      {2, resume({"fsdp-full"})},
  });
  expect_phases_succeeded(phases, 4);
  // Python reads both files into the unwrapped model and torch.optim.Adam.
  auto py = run_process({DDP_PYTHON, "-c",
                         "import sys, torch\n"
                         "m = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.ReLU(), torch.nn.Linear(33, 17),\n"
                         "                        torch.nn.Tanh(), torch.nn.Linear(17, 5))\n"
                         "m.load_state_dict(torch.load(sys.argv[1] + '.model.pt'))\n"
                         "o = torch.optim.Adam(m.parameters(), lr=1e-2)\n"
                         "o.load_state_dict(torch.load(sys.argv[1] + '.optim.pt'))\n"
                         "print('steps', int(o.state[m[0].weight]['step']))\n",
                         dir / "half"});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_NE(py.out.find("steps 3"), std::string::npos) << py.out;
}

// One-element shards and one-element parameters: the optimizer state is
// still split per element, not mistaken for a per-parameter scalar.
TEST(FullyShardedDataParallel, FullCheckpointOfTinyUnitsResumesAtAnotherWorldSize) {
  RanksTempDir dir;
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         TrainSpec reference;
         reference.model = "tiny";
         auto trained = train(group, reference);
         if (group->rank() == 0) ddp::save_state_dict(trained.state, dir / "ddp6.pt");
         TrainSpec first = reference;
         first.strategy = "fsdp-full";
         first.steps = 3;
         first.save_full = dir / "half";
         train(group, first);
       }},
      {3,
       [&dir](const Group& group) {
         TrainSpec s;
         s.model = "tiny";
         s.strategy = "fsdp-full";
         s.load_full = dir / "half";
         expect_resumes_to(group, s, dir / "ddp6.pt", "tiny units, 2 ranks then 3");
       }},
  });
  expect_phases_succeeded(phases, 2);
}

// FULL_SHARD's sharded state (this rank's shards of every unit and of Adam's
// moments, no gather) round-trips through a distributed checkpoint: every
// rank writes its own files, and the same world size resumes bit for bit
// where uninterrupted DDP lands; 3 ranks reshard it and land there too.
TEST(FullyShardedDataParallel, ShardedCheckpointResumesExactlyAtTheSameWorldSizeAndReshardsAtAnother) {
  RanksTempDir dir;
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         auto reference = train(group, TrainSpec{});
         if (group->rank() == 0) ddp::save_state_dict(reference.state, dir / "ddp6.pt");
         TrainSpec first;
         first.strategy = "fsdp-full";
         first.steps = 3;
         first.save_dcp = dir / "shards";
         train(group, first);
       }},
      {2,
       [&dir](const Group& group) {
         // DCP numbers ranks from 1: shard-00001-model-... is rank 0's.
         char prefix[32];
         std::snprintf(prefix, sizeof prefix, "shard-%05d-model-", group->rank() + 1);
         int files = 0;
         for (const auto& entry : fs::directory_iterator(dir / "shards")) {
           if (entry.path().filename().string().rfind(prefix, 0) == 0) ++files;
         }
         EXPECT_GT(files, 0) << "no file of rank " << group->rank() << " (" << prefix << "*)";
         EXPECT_FALSE(fs::exists(dir / "shards.partial"));
         TrainSpec s;
         s.strategy = "fsdp-full";
         s.init_seed = 5;
         s.load_dcp = dir / "shards";
         s.first_step = 3;
         s.steps = 3;
         const auto resumed = train(group, s).state;
         if (group->rank() == 0) EXPECT_EQ(max_difference(ddp::load_state_dict(dir / "ddp6.pt"), resumed), 0.0);
       }},
      {3,
       [&dir](const Group& group) {
         TrainSpec s;
         s.strategy = "fsdp-full";
         s.load_dcp = dir / "shards";
         expect_resumes_to(group, s, dir / "ddp6.pt", "FULL_SHARD at 2 ranks, resharded");
       }},
  });
  expect_phases_succeeded(phases, 3);
}

}  // namespace
