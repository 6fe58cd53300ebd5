// FSDP's gradients on real ranks (support/ranks.h), each test in one file:
// parameters unused on one rank only, errors raised on the communication
// threads, a backward pass interrupted by an error, no_sync() accumulation,
// frozen parameters and per-unit resharding.
#include "support/fsdp_nets.h"
#include "support/ranks.h"
#include "support/torch_errors.h"

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

ddp::StateDict train_ddp(const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::DistributedDataParallel<BranchyNet> model(net, group, ddp::DDPOptions().find_unused_parameters(true));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    net->skip_second(skips(step, group->rank()));
    optimizer.zero_grad();
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    optimizer.step();
  }
  return ddp::state_dict(*net);
}

ddp::StateDict train_fsdp(const std::shared_ptr<ddp::ProcessGroup>& group, ddp::ShardingStrategy strategy) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, ddp::FSDPOptions().sharding_strategy(strategy));
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    net->skip_second(skips(step, group->rank()));
    optimizer.zero_grad();
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    optimizer.step();
  }
  return model.full_state_dict(/*rank0_only=*/false);
}

class UnusedOnOneRank : public ::testing::TestWithParam<std::tuple<ddp::ShardingStrategy, int>> {};

// The ranks' units become ready in different orders (rank 1's block waits for
// gradients that never come on even steps); the reduce-scatters must still be
// launched in one order on every rank, and the unused parameters count as
// zeros, as under DDP with find_unused_parameters.
TEST_P(UnusedOnOneRank, MatchesDdpWithFindUnusedParameters) {
  const auto [strategy, world] = GetParam();
  auto ranks = run_on_ranks(world, [strategy = strategy](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*BranchyNet());
    ddp::StateDict reference = train_ddp(group);
    ddp::StateDict sharded = train_fsdp(group, strategy);
    // Training moved the weights, so matching DDP means something.
    EXPECT_GT(max_difference(initial, reference), 1e-2);
    EXPECT_LE(max_difference(reference, sharded), 1e-5) << "rank " << group->rank();
    std::printf("rank %d compared %zu tensors\n", group->rank(), sharded.size());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared 8 tensors"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Fsdp, UnusedOnOneRank,
                         ::testing::Combine(::testing::Values(ddp::ShardingStrategy::kFullShard,
                                                              ddp::ShardingStrategy::kShardGradOp),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return ddp::to_string(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "_ranks";
                         });


// Ranks that start different reduce-scatters (here: of different sizes) get
// ddp's error from wait(), naming the operation, the rank and the cause;
// Gloo does not abort the process on its I/O thread. The rank then ends with
// a plain non-zero exit.
TEST(FsdpRings, MismatchedReduceScattersRaiseAnErrorFromWaitNotAnAbort) {
  // Gloo's rings (shared memory, ddp's choice on one host, has no rings: it
  // names mismatched collectives itself, tests/test_shm.cpp).
  RanksOptions options;
  options.env = {{"DDP_SHM", "0"}};
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    const int64_t part = group->rank() == 0 ? 4 : 3;
    at::Tensor input = at::ones({2 * part}), output = at::empty({part});
    auto work = group->reduce_scatter_async(output, input);
    std::string message = error_of([&] { group->wait(work, "reduce_scatter in the test"); });
    EXPECT_NE(message.find("reduce_scatter in the test failed on rank " + std::to_string(group->rank())),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("ranks started different collectives"), std::string::npos) << message;
    // Later ring operations fail at once rather than hang.
    at::Tensor again = at::empty({part});
    EXPECT_NE(error_of([&] { group->wait(group->reduce_scatter_async(again, input), "second"); }), "");
    throw std::runtime_error("rank " + std::to_string(group->rank()) + " stops: " + message);
  }, options);
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 1) << describe_ranks(ranks);
    EXPECT_EQ(r.term_signal, 0) << describe_ranks(ranks);
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find("ranks started different collectives"), std::string::npos) << r.err;
  }
}

// The same through FSDP: rank 1 runs one forward more than rank 0, so its
// all-gathers no longer line up with rank 0's. Training then fails on both
// ranks with ddp's error (no SIGABRT), and the process exits non-zero.
TEST(FsdpRings, AForwardOnOneRankOnlyFailsWithAnErrorOnEveryRank) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    BranchyNet net;
    ddp::FullyShardedDataParallel<BranchyNet> model(net, group);
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
    auto [x, y] = batch(0, group->rank(), group->size());
    if (group->rank() == 1) {
      at::NoGradGuard no_grad;
      model.forward(x);  // on rank 1 only: a bug in the user's program
    }
    std::string message = error_of([&] {
      for (int step = 0; step < 3; ++step) {
        optimizer.zero_grad();
        torch::nn::functional::mse_loss(model.forward(x), y).backward();
        optimizer.step();
      }
    });
    EXPECT_NE(message.find("FSDP all_gather of parameters failed on rank " + std::to_string(group->rank())),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("ranks started different collectives"), std::string::npos) << message;
    throw std::runtime_error(message);
  });
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 1) << describe_ranks(ranks);
    EXPECT_EQ(r.term_signal, 0) << describe_ranks(ranks);
    EXPECT_FALSE(r.timed_out) << describe_ranks(ranks);
  }
}

// A backward that threw part-way (after some reduce-scatters had started)
// makes the next forward raise, as DDP's reducer does, instead of training on
// with half-reduced gradients.
TEST(FsdpInterruptedBackward, TheNextForwardRaisesAClearError) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    BranchyNet net;
    ddp::FullyShardedDataParallel<BranchyNet> model(net, group);
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
    auto [x, y] = batch(0, group->rank(), group->size());
    // One good step first.
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    optimizer.step();
    optimizer.zero_grad();
    net->throw_in_backward = true;
    at::Tensor loss = torch::nn::functional::mse_loss(model.forward(x), y);
    EXPECT_NE(error_of([&] { loss.backward(); }).find("boom in backward"), std::string::npos);
    net->throw_in_backward = false;
    std::string message = error_of([&] { model.forward(x); });
    EXPECT_NE(message.find("the previous backward pass through FullyShardedDataParallel on rank " +
                           std::to_string(group->rank()) + " did not finish"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("restart the job"), std::string::npos) << message;
    std::printf("rank %d saw: %s\n", group->rank(), message.c_str());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("did not finish"), std::string::npos) << r.out;
}

// Two micro-batches per step, the first without synchronisation: the
// gradients are those of DDP's no_sync() accumulation (SGD with momentum,
// which would notice a factor). Inside no_sync() no reduce-scatter runs: the
// shards have no gradient yet, and the unit's full gradient is held locally.
enum class SkipSync { kGuard, kSetter };

ddp::StateDict accumulate_ddp(const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::DistributedDataParallel<BranchyNet> model(net, group);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    auto halves_x = x.tensor_split(2), halves_y = y.tensor_split(2);
    optimizer.zero_grad();
    {
      auto guard = model.no_sync();
      torch::nn::functional::mse_loss(model.forward(halves_x[0]), halves_y[0]).backward();
    }
    torch::nn::functional::mse_loss(model.forward(halves_x[1]), halves_y[1]).backward();
    optimizer.step();
  }
  return ddp::state_dict(*net);
}

ddp::StateDict accumulate_fsdp(const std::shared_ptr<ddp::ProcessGroup>& group, ddp::ShardingStrategy strategy,
                               SkipSync how) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, ddp::FSDPOptions().sharding_strategy(strategy));
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    auto halves_x = x.tensor_split(2), halves_y = y.tensor_split(2);
    optimizer.zero_grad();
    if (how == SkipSync::kGuard) {
      auto guard = model.no_sync();
      torch::nn::functional::mse_loss(model.forward(halves_x[0]), halves_y[0]).backward();
    } else {
      model.set_requires_gradient_sync(false);
      torch::nn::functional::mse_loss(model.forward(halves_x[0]), halves_y[0]).backward();
      model.set_requires_gradient_sync(true);
    }
    for (const auto& shard : model.parameters()) EXPECT_FALSE(shard.grad().defined()) << "reduced inside no_sync";
    // The three units' full gradients: 144 + 544 + 68 floats, padded.
    EXPECT_GE(model.memory().gradient_bytes, (144 + 544 + 68) * 4);
    torch::nn::functional::mse_loss(model.forward(halves_x[1]), halves_y[1]).backward();
    for (const auto& shard : model.parameters()) EXPECT_TRUE(shard.grad().defined());
    optimizer.step();
  }
  return model.full_state_dict(/*rank0_only=*/false);
}

class NoSync : public ::testing::TestWithParam<std::tuple<ddp::ShardingStrategy, int>> {};

TEST_P(NoSync, AccumulationMatchesDdpNoSync) {
  const auto [strategy, world] = GetParam();
  auto ranks = run_on_ranks(world, [strategy = strategy](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*BranchyNet());
    ddp::StateDict reference = accumulate_ddp(group);
    EXPECT_GT(max_difference(initial, reference), 1e-2);
    for (SkipSync how : {SkipSync::kGuard, SkipSync::kSetter}) {
      ddp::StateDict sharded = accumulate_fsdp(group, strategy, how);
      EXPECT_LE(max_difference(reference, sharded), 1e-5) << "rank " << group->rank();
    }
    std::printf("rank %d compared no_sync\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared no_sync"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Fsdp, NoSync,
                         ::testing::Combine(::testing::Values(ddp::ShardingStrategy::kFullShard,
                                                              ddp::ShardingStrategy::kShardGradOp,
                                                              ddp::ShardingStrategy::kNoShard),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return ddp::to_string(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "_ranks";
                         });

// Frozen parameters inside units (the block's fc1.weight) and in the root
// unit (head.bias): trained with AdamW's weight decay, which would move them
// if the optimizer saw them, the result equals DDP's and they stay as built
// (freeze() is in support/fsdp_nets.h).

template <typename Model>
void train_frozen(Model& model, std::vector<at::Tensor> params, const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  run_steps(model, optimizer, group);
}

class FrozenInUnit : public ::testing::TestWithParam<std::tuple<ddp::ShardingStrategy, int>> {};

TEST_P(FrozenInUnit, MatchesDdpAndStaysUnchanged) {
  const auto [strategy, world] = GetParam();
  auto ranks = run_on_ranks(world, [strategy = strategy](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*BranchyNet());
    ddp::StateDict reference, sharded;
    {
      torch::manual_seed(0);
      BranchyNet net;
      freeze(net);
      ddp::DistributedDataParallel<BranchyNet> model(net, group);
      train_frozen(model, model->parameters(), group);
      reference = ddp::state_dict(*net);
    }
    {
      torch::manual_seed(0);
      BranchyNet net;
      freeze(net);
      ddp::FullyShardedDataParallel<BranchyNet> model(net, group, ddp::FSDPOptions().sharding_strategy(strategy));
      // Frozen tensors are not the optimizer's: one shard per unit.
      EXPECT_EQ(model.parameters().size(), 3u);
      train_frozen(model, model.parameters(), group);
      sharded = model.full_state_dict(/*rank0_only=*/false);
    }
    EXPECT_GT(max_difference(initial, reference), 1e-2);
    EXPECT_LE(max_difference(reference, sharded), 1e-5) << "rank " << group->rank();
    auto start = by_name(initial), end = by_name(sharded);
    EXPECT_TRUE(at::equal(start.at("block.fc1.weight"), end.at("block.fc1.weight")));
    EXPECT_TRUE(at::equal(start.at("head.bias"), end.at("head.bias")));
    std::printf("rank %d compared frozen\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared frozen"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Fsdp, FrozenInUnit,
                         ::testing::Combine(::testing::Values(ddp::ShardingStrategy::kFullShard,
                                                              ddp::ShardingStrategy::kShardGradOp),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return ddp::to_string(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "_ranks";
                         });

// reshard_after_forward per unit: FULL_SHARD keeping the block gathered
// until its backward, SHARD_GRAD_OP freeing 'first' after its forward. Both
// match DDP, and after forward exactly that unit's full parameters (544 or
// 144 floats) are held more, or less, than under the strategy alone.
ddp::StateDict train_resharded(const std::shared_ptr<ddp::ProcessGroup>& group, ddp::FSDPOptions options,
                               int64_t* bytes_after_forward) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, options);
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    net->skip_second(skips(step, group->rank()));
    optimizer.zero_grad();
    at::Tensor out = model.forward(x);
    if (step == 1) *bytes_after_forward = model.memory().parameter_bytes;
    torch::nn::functional::mse_loss(out, y).backward();
    optimizer.step();
  }
  return model.full_state_dict(/*rank0_only=*/false);
}

TEST(FsdpReshardAfterForward, PerUnitMatchesDdpAndKeepsOnlyThatUnitGathered) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    ddp::StateDict reference = train_ddp(group);  // rank 1 skips a layer on even steps here too
    struct Case {
      ddp::ShardingStrategy strategy;
      std::string unit;
      bool reshard;
      int64_t extra_bytes;  // held after forward, against the strategy's default
    };
    for (const Case& c : {Case{ddp::ShardingStrategy::kFullShard, "block", false, 544 * 4},
                          Case{ddp::ShardingStrategy::kShardGradOp, "first", true, -144 * 4}}) {
      int64_t plain = 0, changed = 0;
      auto options = ddp::FSDPOptions().sharding_strategy(c.strategy);
      train_resharded(group, options, &plain);
      ddp::StateDict sharded = train_resharded(group, options.reshard_after_forward({{c.unit, c.reshard}}), &changed);
      EXPECT_LE(max_difference(reference, sharded), 1e-5) << ddp::to_string(c.strategy) << " " << c.unit;
      EXPECT_EQ(changed - plain, c.extra_bytes) << ddp::to_string(c.strategy) << " " << c.unit;
    }
    std::string message = error_of([&] {
      torch::manual_seed(0);
      ddp::FullyShardedDataParallel<BranchyNet> model(BranchyNet(), group,
                                                      ddp::FSDPOptions().reshard_after_forward({{"blok", false}}));
    });
    EXPECT_NE(message.find("names the unit 'blok', which this model does not have; its units are 'block' 'first' ''"),
              std::string::npos)
        << message;
    std::printf("rank %d compared reshard\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared reshard"), std::string::npos) << r.out;
}

// A parameter the graph reaches but whose gradient never comes: AuxNet's
// block's second output (through fc2) is left out of rank 1's loss on even
// steps. The forward's graph cannot tell, so the block is completed with
// zeros at the end of backward, still in the common order.
template <typename Model>
void train_aux(Model& model, std::vector<at::Tensor> params, const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(1e-2));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    optimizer.zero_grad();
    auto [out, aux] = model.forward(x);
    at::Tensor loss = torch::nn::functional::mse_loss(out, y);
    if (!skips(step, group->rank())) loss = loss + aux.pow(2).mean();
    loss.backward();
    optimizer.step();
  }
}

TEST(FsdpUnusedAtTheEnd, AReachableParameterWithoutGradientOnOneRankMatchesDdp) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*AuxNet());
    ddp::StateDict reference;
    {
      torch::manual_seed(0);
      AuxNet net;
      ddp::DistributedDataParallel<AuxNet> model(net, group, ddp::DDPOptions().find_unused_parameters(true));
      train_aux(model, model->parameters(), group);
      reference = ddp::state_dict(*net);
    }
    EXPECT_GT(max_difference(initial, reference), 1e-2);
    for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kShardGradOp}) {
      torch::manual_seed(0);
      AuxNet net;
      ddp::FullyShardedDataParallel<AuxNet> model(net, group, ddp::FSDPOptions().sharding_strategy(strategy));
      train_aux(model, model.parameters(), group);
      EXPECT_LE(max_difference(reference, model.full_state_dict(/*rank0_only=*/false)), 1e-5)
          << ddp::to_string(strategy) << " rank " << group->rank();
    }
    std::printf("rank %d compared aux\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared aux"), std::string::npos) << r.out;
}

}  // namespace
