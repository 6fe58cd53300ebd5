// FullyShardedDataParallel and ZeroRedundancyOptimizer against DDP on real
// ranks (support/ranks.h, support/fsdp_trainers.h): the same weights after
// several optimizer steps under every strategy, model, optimizer and world
// size, and only shards held between steps.
#include "support/fsdp_trainers.h"
#include "support/fsdp_nets.h"
#include "support/ranks.h"

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
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
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
namespace {

using namespace ddp::testing;

const std::vector<std::string> kStrategies = {"zero1", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard"};

TrainSpec spec(std::string strategy) {
  TrainSpec s;
  s.strategy = std::move(strategy);
  return s;
}

// Compared on rank 0, which holds the full state dicts.
void expect_same_weights(const std::shared_ptr<ddp::ProcessGroup>& group, const ddp::StateDict& a,
                         const ddp::StateDict& b, const std::string& label) {
  if (group->rank() == 0) EXPECT_LE(max_difference(a, b), 1e-5) << label;
}

void expect_every_strategy_matches_ddp(int world) {
  expect_all_succeeded(run_on_ranks(world, [world](const std::shared_ptr<ddp::ProcessGroup>& group) {
    for (const std::string model : {"seq", "wrapped"}) {
      TrainSpec reference = spec("ddp");
      reference.model = model;
      TrainSpec initial = reference;
      initial.steps = 0;
      const auto trained = train(group, reference).state;
      const auto untrained = train(group, initial).state;
      // Training moved the weights, so matching DDP means something.
      if (group->rank() == 0) EXPECT_GT(max_difference(trained, untrained), 1e-2) << model;
      for (const auto& strategy : kStrategies) {
        TrainSpec s = reference;
        s.strategy = strategy;
        const auto result = train(group, s);
        expect_same_weights(group, trained, result.state,
                            model + " " + strategy + " at " + std::to_string(world) + " ranks");
        if (strategy.rfind("fsdp", 0) == 0) {
          // The units the model asked for: three size-based groups of the
          // Sequential, or the two wrapped submodules plus the root's head.
          EXPECT_EQ(result.units, model == "seq" ? " '0' '1-2' '3-4'" : " 'middle' 'first' ''") << strategy;
        }
      }
    }
  }));
}

TEST(FullyShardedDataParallel, EveryStrategyMatchesDdpAtTwoRanks) { expect_every_strategy_matches_ddp(2); }

// Three ranks: unit sizes 363, 578 and 90 do not divide evenly, so shards
// carry padding.
TEST(FullyShardedDataParallel, EveryStrategyMatchesDdpAtThreeRanksWithUnevenShards) {
  expect_every_strategy_matches_ddp(3);
}

TEST(FullyShardedDataParallel, AdamWAndSgdWithMomentumMatchDdp) {
  expect_all_succeeded(run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    for (const std::string optimizer : {"adamw", "sgd"}) {
      TrainSpec reference = spec("ddp");
      reference.optimizer = optimizer;
      const auto trained = train(group, reference).state;
      for (const auto& strategy : kStrategies) {
        TrainSpec s = reference;
        s.strategy = strategy;
        expect_same_weights(group, trained, train(group, s).state, optimizer + " " + strategy);
      }
    }
  }));
}

// Four ranks: three steps around the ring in every reduce-scatter and
// all-gather.
TEST(FullyShardedDataParallel, FourRanksMatchDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    expect_same_weights(group, train(group, spec("ddp")).state, train(group, spec("fsdp-full")).state, "");
  }));
}

// Two backward passes before each step: each one's gradients are
// reduce-scattered and added into the shards' gradients. SGD, unlike Adam,
// would notice gradients off by a constant factor.
TEST(FullyShardedDataParallel, GradientAccumulationOverMicroBatchesMatchesDdp) {
  expect_all_succeeded(run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    TrainSpec reference = spec("ddp");
    reference.optimizer = "sgd";
    const auto trained = train(group, reference).state;
    for (const std::string strategy : {"fsdp-full", "fsdp-grad-op"}) {
      TrainSpec s = reference;
      s.strategy = strategy;
      s.micro_batches = 2;
      expect_same_weights(group, trained, train(group, s).state, strategy);
    }
  }));
}

// N ranks with b rows each against one process, no wrapper, with all N·b
// rows (SGD: the gradients must be averages, not sums).
TEST(FullyShardedDataParallel, MatchesOneProcessWithTheWholeBatch) {
  expect_all_succeeded(run_on_ranks(3, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    TrainSpec sharded = spec("fsdp-full");
    sharded.optimizer = "sgd";
    TrainSpec single = sharded;
    single.strategy = "single";
    const auto result = train(group, sharded).state;
    expect_same_weights(group, train(nullptr, single).state, result, "");
  }));
}

// 1031 parameters padded to 1032: each of 2 ranks keeps 516 floats of
// parameters and of gradients. FULL_SHARD frees every unit after its forward;
// SHARD_GRAD_OP keeps all 1032 gathered until backward.
TEST(FullyShardedDataParallel, HoldsOnlyShardsBetweenSteps) {
  expect_all_succeeded(run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    struct Case {
      std::string strategy;
      int64_t after_forward;
      int64_t between_steps;
    };
    for (const Case& c : {Case{"fsdp-full", 516 * 4, 516 * 4}, Case{"fsdp-grad-op", 516 * 4 + 1032 * 4, 516 * 4},
                          Case{"fsdp-no-shard", 1032 * 4, 1032 * 4}}) {
      const auto result = train(group, spec(c.strategy));
      EXPECT_EQ(result.bytes_after_forward, c.after_forward) << c.strategy;
      EXPECT_EQ(result.between_steps.parameter_bytes, c.between_steps) << c.strategy;
      EXPECT_EQ(result.between_steps.gradient_bytes, c.between_steps) << "gradient bytes: " << c.strategy;
    }
  }));
}

}  // namespace
