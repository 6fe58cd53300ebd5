// FSDP on real ranks, each test in one file (support/ranks.h): parameters
// unused on one rank only, errors raised on the communication threads, and a
// backward pass interrupted by an error.

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

// One FSDP unit of two Linear layers whose second one is skipped when
// `skip_second` is set: its parameters are then unused in that forward.
struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(fc1(x));
    return skip_second ? h : at::tanh(fc2(h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool skip_second = false;
};
TORCH_MODULE(TwoLayer);

// Units 'first' (144 parameters) and 'block' (544), the head in the root
// unit (68): three reduce-scatters of different sizes per step.
struct BranchyNetImpl : torch::nn::Module {
  BranchyNetImpl() {
    first = register_module("first", ddp::fsdp_unit(torch::nn::Linear(8, 16)));
    block = register_module("block", ddp::fsdp_unit(TwoLayer()));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = first->forward(x);
    if (throw_in_backward) {
      // Fires after the head's and the block's gradients, before first's.
      h.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom in backward"); });
    }
    return head(block->forward(at::relu(h)));
  }
  bool throw_in_backward = false;
  void skip_second(bool skip) { block->module()->skip_second = skip; }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> first;
  std::shared_ptr<ddp::FsdpUnitImpl<TwoLayer>> block;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BranchyNet);

// Rank r's rows of step `step`'s global batch (the same for every world size).
std::pair<at::Tensor, at::Tensor> batch(int64_t step, int rank, int world) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  at::Tensor x = at::randn({12, 8}, generator), y = at::randn({12, 4}, generator);
  at::Tensor rows = at::arange(rank, 12, world, at::kLong);
  return {x.index_select(0, rows), y.index_select(0, rows)};
}

// Rank 1 skips the block's second layer on even steps.
bool skips(int64_t step, int rank) { return rank == 1 && step % 2 == 0; }

constexpr int64_t kSteps = 6;

std::map<std::string, at::Tensor> by_name(const ddp::StateDict& state) {
  std::map<std::string, at::Tensor> map;
  for (const auto& [name, tensor] : state) map[name] = tensor;
  return map;
}

double max_difference(const ddp::StateDict& a, const ddp::StateDict& b) {
  auto ma = by_name(a), mb = by_name(b);
  EXPECT_EQ(ma.size(), mb.size());
  double diff = 0;
  for (const auto& [name, tensor] : ma) {
    auto it = mb.find(name);
    EXPECT_NE(it, mb.end()) << name;
    if (it == mb.end()) return 1e9;
    diff = std::max(diff, (tensor - it->second).abs().max().item<double>());
  }
  return diff;
}

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

// What an exception says, or "" when `f` does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Ranks that start different reduce-scatters (here: of different sizes) get
// ddp's error from wait(), naming the operation, the rank and the cause;
// Gloo does not abort the process on its I/O thread. The rank then ends with
// a plain non-zero exit.
TEST(FsdpRings, MismatchedReduceScattersRaiseAnErrorFromWaitNotAnAbort) {
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
  });
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
// if the optimizer saw them, the result equals DDP's and they stay as built.
void freeze(BranchyNet& net) {
  net->block->module()->fc1->weight.requires_grad_(false);
  net->head->bias.requires_grad_(false);
}

// Steps `first` to first + count - 1 of the common batches.
template <typename Model>
void run_steps(Model& model, torch::optim::Optimizer& optimizer, const std::shared_ptr<ddp::ProcessGroup>& group,
               int64_t first = 0, int64_t count = kSteps) {
  for (int64_t step = first; step < first + count; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    optimizer.zero_grad();
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    optimizer.step();
  }
}

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

// A parameter the graph reaches but whose gradient never comes: the block's
// second output (through fc2) is left out of rank 1's loss on even steps.
// The forward's graph cannot tell, so the block is completed with zeros at
// the end of backward, still in the common order.
struct TwoOutputBlockImpl : torch::nn::Module {
  TwoOutputBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(fc1(x));
    return {h, fc2(h)};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TwoOutputBlock);

struct AuxNetImpl : torch::nn::Module {
  AuxNetImpl() {
    first = register_module("first", ddp::fsdp_unit(torch::nn::Linear(8, 16)));
    block = register_module("block", ddp::fsdp_unit(TwoOutputBlock()));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    auto [h, aux] = block->forward(at::relu(first->forward(x)));
    return {head(h), aux};
  }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> first;
  std::shared_ptr<ddp::FsdpUnitImpl<TwoOutputBlock>> block;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(AuxNet);

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

namespace {

// FSDPOptions::reduce_dtype: gradients reduce-scattered (all-reduced under
// NO_SHARD) in float16 or bfloat16 equal DDP's with the matching compression
// hook: the same arithmetic (divide by the world size, cast, sum in the low
// dtype, cast back). SGD keeps the weights a linear image of the gradients,
// so a rounding difference stays as small as it was made.
template <typename Model>
void train_sgd(Model& model, std::vector<at::Tensor> params, const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.05));
  run_steps(model, optimizer, group);
}

ddp::StateDict sgd_ddp(const std::shared_ptr<ddp::ProcessGroup>& group, std::shared_ptr<ddp::CommHook> hook) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::DistributedDataParallel<BranchyNet> model(net, group, ddp::DDPOptions().comm_hook(std::move(hook)));
  train_sgd(model, model->parameters(), group);
  return ddp::state_dict(*net);
}

ddp::StateDict sgd_fsdp(const std::shared_ptr<ddp::ProcessGroup>& group, ddp::ShardingStrategy strategy,
                        std::optional<at::ScalarType> reduce_dtype) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(
      net, group, ddp::FSDPOptions().sharding_strategy(strategy).reduce_dtype(reduce_dtype));
  train_sgd(model, model.parameters(), group);
  for (const auto& shard : model.parameters()) EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
  return model.full_state_dict(/*rank0_only=*/false);
}

class ReduceDtype : public ::testing::TestWithParam<int> {};

// Tolerances. At 2 ranks each element's sum is one rounding of a + b in
// both, so the weights must be bit-identical to DDP's with the hook. At 3
// ranks Gloo's all-reduce and FSDP's ring (or Gloo's all-reduce of a unit's
// buffer, chunked differently from DDP's bucket) associate (a + b) + c
// differently, which can round an element by one unit in the last place of
// the low dtype: the weights may then differ by up to 2 epsilon(dtype) of
// how far training moved them (epsilon: 2^-10 for float16, 2^-7 for
// bfloat16), the same bound that the compression itself must keep to.
TEST_P(ReduceDtype, Fp16AndBf16MatchDdpsCompressionHooks) {
  const int world = GetParam();
  auto ranks = run_on_ranks(world, [world](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*BranchyNet());
    ddp::StateDict exact = sgd_ddp(group, nullptr);
    const double moved = max_difference(initial, exact);
    EXPECT_GT(moved, 1e-2);
    struct Case {
      at::ScalarType dtype;
      std::shared_ptr<ddp::CommHook> hook;
      double epsilon;
    };
    double fp16_effect = 0;
    for (const Case& c : {Case{at::kHalf, ddp::fp16_compress_hook(), 1.0 / 1024},
                          Case{at::kBFloat16, ddp::bf16_compress_hook(), 1.0 / 128}}) {
      const double tolerance = 2 * c.epsilon * moved;
      ddp::StateDict compressed = sgd_ddp(group, c.hook);
      const double effect = max_difference(exact, compressed);
      EXPECT_GT(effect, 0) << c.dtype << ": the rounding must show";
      EXPECT_LE(effect, tolerance) << c.dtype;
      for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kNoShard}) {
        ddp::StateDict sharded = sgd_fsdp(group, strategy, c.dtype);
        const double difference = max_difference(compressed, sharded);
        if (world == 2) {
          EXPECT_EQ(difference, 0.0) << c.dtype << " " << ddp::to_string(strategy) << " rank " << group->rank();
        } else {
          EXPECT_LE(difference, tolerance) << c.dtype << " " << ddp::to_string(strategy) << " rank " << group->rank();
        }
        EXPECT_GT(max_difference(exact, sharded), 0) << c.dtype << " " << ddp::to_string(strategy);
        std::printf("rank %d %s %s: against the hook %.3g, compression %.3g, tolerance %.3g\n", group->rank(),
                    c10::toString(c.dtype), ddp::to_string(strategy).c_str(), difference, effect, tolerance);
      }
      if (c.dtype == at::kHalf) fp16_effect = effect;
      else EXPECT_GT(effect, fp16_effect) << "bf16 keeps fewer mantissa bits than fp16";
    }
    // The parameters' own dtype: no rounding at all.
    EXPECT_LE(max_difference(exact, sgd_fsdp(group, ddp::ShardingStrategy::kFullShard, at::kFloat)), 1e-6);
    std::printf("rank %d compared reduce dtypes\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared reduce dtypes"), std::string::npos) << r.out;
  // Rank 0's measurements, in this test's output.
  std::istringstream lines(ranks.front().out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("against the hook") != std::string::npos) std::printf("%s\n", line.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Fsdp, ReduceDtype, ::testing::Values(2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

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

}  // namespace

namespace {

// FSDPOptions::param_dtype: the shards (what the optimizer steps) stay
// float32 master weights; each unit is gathered and computes in bfloat16, on
// inputs cast to bfloat16; its bfloat16 gradients are reduced in reduce_dtype
// and land in the shard's float32 gradient.
ddp::FSDPOptions mixed_options(ddp::ShardingStrategy strategy) {
  return ddp::FSDPOptions()
      .sharding_strategy(strategy)
      .param_dtype(at::kBFloat16)
      .reduce_dtype(at::kFloat)
      .output_dtype(at::kFloat);
}

// DDP under the same casts, written out: float32 master weights stepped by
// SGD; each step a bfloat16 copy of them (a second model) runs forward on
// the input cast to bfloat16, its result is cast to float32 for the loss,
// and each bfloat16 gradient is cast to float32, divided by the world size
// and all-reduced (sum) into the master's gradient.
ddp::StateDict sgd_under_casts(const std::shared_ptr<ddp::ProcessGroup>& group) {
  torch::manual_seed(0);
  BranchyNet master;
  torch::manual_seed(0);
  BranchyNet low;
  low->to(at::kBFloat16);
  std::vector<at::Tensor> master_params = master->parameters(), low_params = low->parameters();
  EXPECT_EQ(master_params.size(), low_params.size());
  torch::optim::SGD optimizer(master_params, torch::optim::SGDOptions(0.05));
  for (int64_t step = 0; step < kSteps; ++step) {
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < low_params.size(); ++i) low_params[i].copy_(master_params[i]);
    }
    auto [x, y] = batch(step, group->rank(), group->size());
    optimizer.zero_grad();
    low->zero_grad();
    at::Tensor out = low->forward(x.to(at::kBFloat16)).to(at::kFloat);
    torch::nn::functional::mse_loss(out, y).backward();
    for (size_t i = 0; i < low_params.size(); ++i) {
      EXPECT_EQ(low_params[i].grad().scalar_type(), at::kBFloat16);
      at::Tensor grad = low_params[i].grad().to(at::kFloat).div_(group->size());
      group->all_reduce(grad);
      master_params[i].mutable_grad() = grad;
    }
    optimizer.step();
  }
  return ddp::state_dict(*master);
}

// FSDP with `options` (param_dtype bfloat16, output_dtype float32), SGD as
// above, checking the dtypes on the way.
ddp::StateDict sgd_fsdp_mixed(const std::shared_ptr<ddp::ProcessGroup>& group, const ddp::FSDPOptions& options) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, options);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, group->rank(), group->size());
    optimizer.zero_grad();
    at::Tensor out = model.forward(x);
    EXPECT_EQ(out.scalar_type(), at::kFloat) << "output_dtype";
    // The root unit stays gathered from forward to backward under every
    // strategy: the head's parameters, as the module holds them, are the
    // gathered bfloat16 ones.
    for (const auto& p : net->head->named_parameters()) {
      EXPECT_EQ(p.value().scalar_type(), at::kBFloat16) << "head." << p.key() << " while gathered";
    }
    torch::nn::functional::mse_loss(out, y).backward();
    for (const auto& shard : model.parameters()) {
      EXPECT_EQ(shard.scalar_type(), at::kFloat) << "the shard is the float32 master";
      EXPECT_TRUE(shard.grad().defined());
      if (shard.grad().defined()) EXPECT_EQ(shard.grad().scalar_type(), at::kFloat) << "the shard's gradient";
    }
    optimizer.step();
  }
  return model.full_state_dict(/*rank0_only=*/false);
}

double max_abs(const ddp::StateDict& state) {
  double m = 0;
  for (const auto& [name, tensor] : state) m = std::max(m, tensor.abs().max().item<double>());
  return m;
}

// Tolerances. Both sides compute the same bfloat16 gradients from the same
// bfloat16 weights and reduce them in float32 after the same cast and
// division. At 2 ranks each reduced element is one rounding of a + b in
// both (all-reduce or reduce-scatter alike), so the weights must be
// bit-identical. At 3 ranks Gloo's all-reduce (per parameter here) and FSDP's
// ring reduce-scatter (or, under NO_SHARD, Gloo's all-reduce of a unit's
// flat gradient) may associate (a + b) + c differently: a reduced gradient
// can differ by about one float32 ulp, lr times that in the update, and the
// rounding of w - lr * g by one ulp of w more. Over kSteps steps that is
// within kSteps * 2 * 2^-23 * (max |w| + how far the weights moved): about
// 6e-7 here, a thousandth of what the bfloat16 compute changes (~7e-4,
// checked below, so the comparison would notice a missing cast).
void expect_mixed_equals_ddp_under_casts(int world) {
  auto ranks = run_on_ranks(world, [world](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*BranchyNet());
    ddp::StateDict exact = sgd_ddp(group, nullptr);  // float32 throughout
    ddp::StateDict reference = sgd_under_casts(group);
    const double moved = max_difference(initial, reference);
    EXPECT_GT(moved, 1e-2);
    const double tolerance = kSteps * 2 * std::ldexp(1.0, -23) * (max_abs(reference) + moved);
    const double cast_effect = max_difference(exact, reference);
    EXPECT_GT(cast_effect, 100 * tolerance) << "bfloat16 compute must show against float32";
    for (auto strategy :
         {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kShardGradOp, ddp::ShardingStrategy::kNoShard}) {
      ddp::StateDict sharded = sgd_fsdp_mixed(group, mixed_options(strategy));
      for (const auto& [name, tensor] : sharded) EXPECT_EQ(tensor.scalar_type(), at::kFloat) << name;
      const double difference = max_difference(reference, sharded);
      if (world == 2) {
        EXPECT_EQ(difference, 0.0) << ddp::to_string(strategy) << " rank " << group->rank();
      } else {
        EXPECT_LE(difference, tolerance) << ddp::to_string(strategy) << " rank " << group->rank();
      }
      const double from_fp32 = max_difference(exact, sharded);
      EXPECT_GT(from_fp32, 100 * tolerance) << ddp::to_string(strategy) << ": the casts must show";
      std::printf("rank %d %s: against the casts %.3g (tolerance %.3g), against float32 %.3g\n", group->rank(),
                  ddp::to_string(strategy).c_str(), difference, tolerance, from_fp32);
    }
    std::printf("rank %d compared mixed precision\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared mixed precision"), std::string::npos) << r.out;
  std::istringstream lines(ranks.front().out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("against the casts") != std::string::npos) std::printf("%s\n", line.c_str());
  }
}

TEST(MixedPrecision, Bf16ParamsWithFp32ReductionEqualDdpUnderTheSameCastsOn2Ranks) {
  expect_mixed_equals_ddp_under_casts(2);
}

TEST(MixedPrecision, Bf16ParamsWithFp32ReductionEqualDdpUnderTheSameCastsOn3Ranks) {
  expect_mixed_equals_ddp_under_casts(3);
}

// output_dtype casts the floating-point results of the root's forward (each
// of a tuple's too); without it a bfloat16 forward returns bfloat16. The
// input, float32 here, is cast to param_dtype, or the bfloat16 Linear
// layers would refuse it.
TEST(MixedPrecision, OutputDtypeCastsTheResult) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    auto [x, y] = batch(0, group->rank(), group->size());
    struct Case {
      std::optional<at::ScalarType> param_dtype, output_dtype;
      at::ScalarType expected;
    };
    for (const Case& c : {Case{at::kBFloat16, at::kFloat, at::kFloat}, Case{at::kBFloat16, std::nullopt, at::kBFloat16},
                          Case{std::nullopt, at::kBFloat16, at::kBFloat16},
                          Case{std::nullopt, std::nullopt, at::kFloat}}) {
      torch::manual_seed(0);
      ddp::FullyShardedDataParallel<BranchyNet> model(
          BranchyNet(), group, ddp::FSDPOptions().param_dtype(c.param_dtype).output_dtype(c.output_dtype));
      at::Tensor out = model.forward(x);
      EXPECT_EQ(out.scalar_type(), c.expected) << c.param_dtype.value_or(at::kFloat) << " "
                                               << c.output_dtype.value_or(at::kFloat);
      torch::nn::functional::mse_loss(out.to(at::kFloat), y).backward();
      for (const auto& shard : model.parameters()) {
        EXPECT_TRUE(shard.grad().defined());
        if (shard.grad().defined()) EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
      }
    }
    {
      torch::manual_seed(0);
      ddp::FullyShardedDataParallel<AuxNet> model(
          AuxNet(), group, ddp::FSDPOptions().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
      auto [out, aux] = model.forward(x);
      EXPECT_EQ(out.scalar_type(), at::kFloat);
      EXPECT_EQ(aux.scalar_type(), at::kFloat);
      (torch::nn::functional::mse_loss(out, y) + aux.pow(2).mean()).backward();
      for (const auto& shard : model.parameters()) EXPECT_TRUE(shard.grad().defined());
    }
    std::printf("rank %d compared output dtypes\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared output dtypes"), std::string::npos) << r.out;
}

struct PeakRun {
  int64_t shard_bytes = 0;  // this rank's shards (float32 either way)
  int64_t peak = 0;         // peak_parameter_bytes over 3 training steps
  ddp::StateDict state;     // full_state_dict afterwards
  std::vector<at::Tensor> flats;  // each unit's shards from every rank, concatenated: the full flat tensor
};

PeakRun train_for_peak(const std::shared_ptr<ddp::ProcessGroup>& group, const ddp::FSDPOptions& options) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, options);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));
  PeakRun run;
  for (const auto& shard : model.parameters()) {
    EXPECT_EQ(shard.scalar_type(), at::kFloat);
    run.shard_bytes += shard.numel() * static_cast<int64_t>(shard.element_size());
  }
  EXPECT_GE(model.memory().peak_parameter_bytes, run.shard_bytes);
  model.reset_peak_memory();
  EXPECT_EQ(model.memory().peak_parameter_bytes, model.memory().parameter_bytes) << "after reset_peak_memory";
  run_steps(model, optimizer, group, 0, 3);
  const ddp::ShardedMemory memory = model.memory();
  EXPECT_EQ(memory.parameter_bytes, run.shard_bytes) << "between steps FULL_SHARD holds the shards only";
  run.peak = memory.peak_parameter_bytes;
  model.reset_peak_memory();
  EXPECT_EQ(model.memory().peak_parameter_bytes, run.shard_bytes) << "after reset_peak_memory";
  run.state = model.full_state_dict(/*rank0_only=*/false);
  for (const auto& shard : model.parameters()) run.flats.push_back(at::cat(group->all_gather(shard.detach())));
  return run;
}

// Under FULL_SHARD at 2 ranks the gathered units take 2 bytes per element in
// bfloat16 against 4 in float32; the shards are float32 in both. So the
// peak's gathered part (peak - shard bytes) halves exactly. It holds at
// least the block (544 elements) and the root unit (68, gathered from
// forward to backward) at once, and at most every unit (756 in all).
TEST(MixedPrecision, GatheredParametersTakeHalfTheMemory) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    const auto full_shard = ddp::FSDPOptions().sharding_strategy(ddp::ShardingStrategy::kFullShard);
    PeakRun fp32 = train_for_peak(group, full_shard);
    PeakRun bf16 = train_for_peak(group, mixed_options(ddp::ShardingStrategy::kFullShard));
    EXPECT_EQ(fp32.shard_bytes, (144 + 544 + 68) / 2 * 4);
    EXPECT_EQ(bf16.shard_bytes, fp32.shard_bytes);
    const int64_t gathered_fp32 = fp32.peak - fp32.shard_bytes, gathered_bf16 = bf16.peak - bf16.shard_bytes;
    EXPECT_GE(gathered_fp32, (544 + 68) * 4);
    EXPECT_LE(gathered_fp32, (144 + 544 + 68) * 4);
    EXPECT_EQ(2 * gathered_bf16, gathered_fp32) << "fp32 peak " << fp32.peak << ", bf16 peak " << bf16.peak;
    EXPECT_EQ(fp32.peak - bf16.peak, gathered_fp32 / 2);

    // The full state dict after training under param_dtype is the float32
    // master weights, the shards' values exactly, not rounded to bfloat16.
    auto state = by_name(bf16.state);
    const std::vector<std::vector<std::string>> unit_params = {
        {"first.weight", "first.bias"},
        {"block.fc1.weight", "block.fc1.bias", "block.fc2.weight", "block.fc2.bias"},
        {"head.weight", "head.bias"}};
    bool rounded_everywhere = true;
    for (const auto& [name, tensor] : bf16.state) {
      EXPECT_EQ(tensor.scalar_type(), at::kFloat) << name;
      if (tensor.scalar_type() != at::kFloat) continue;
      if (!at::equal(tensor, tensor.to(at::kBFloat16).to(at::kFloat))) rounded_everywhere = false;
    }
    EXPECT_FALSE(rounded_everywhere) << "full_state_dict rounded to bfloat16";
    int matched = 0;
    for (const auto& flat : bf16.flats) {
      for (const auto& names : unit_params) {
        std::vector<at::Tensor> parts;
        for (const auto& name : names) parts.push_back(state.at(name).reshape({-1}));
        at::Tensor expected = at::cat(parts);
        if (expected.numel() != flat.numel()) continue;  // 144, 544 and 68: no padding at 2 ranks
        EXPECT_TRUE(at::equal(flat, expected)) << names.front() << "'s unit: full_state_dict is not the shards";
        ++matched;
      }
    }
    EXPECT_EQ(matched, 3);
    std::printf("rank %d peaks: fp32 %lld, bf16 %lld, shards %lld\n", group->rank(), static_cast<long long>(fp32.peak),
                static_cast<long long>(bf16.peak), static_cast<long long>(fp32.shard_bytes));
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("peaks: fp32"), std::string::npos) << r.out;
  std::istringstream lines(ranks.front().out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("peaks: fp32") != std::string::npos) std::printf("%s\n", line.c_str());
  }
}

// A CommHook that records each bucket it gets and reduces it as the default
// hook does.
class RecordingHook : public ddp::CommHook {
 public:
  struct Call {
    size_t index;
    bool scatters, is_last;
    int64_t buffer_numel, shard_numel;
    at::ScalarType buffer_dtype, shard_dtype;
  };
  c10::intrusive_ptr<c10::ivalue::Future> run(ddp::ProcessGroup& group, ddp::GradBucket& bucket) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const bool scatters = bucket.scatters();
      calls_.push_back(Call{bucket.index(), scatters, bucket.is_last(), bucket.buffer().numel(),
                            scatters ? bucket.shard().numel() : 0, bucket.buffer().scalar_type(),
                            scatters ? bucket.shard().scalar_type() : at::kFloat});
    }
    return inner_->run(group, bucket);
  }
  std::vector<Call> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(calls_, {});
  }

 private:
  std::shared_ptr<ddp::CommHook> inner_ = ddp::allreduce_hook();
  std::mutex mutex_;
  std::vector<Call> calls_;
};

ddp::StateDict sgd_fsdp_with(const std::shared_ptr<ddp::ProcessGroup>& group, const ddp::FSDPOptions& options) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, options);
  train_sgd(model, model.parameters(), group);
  for (const auto& shard : model.parameters()) EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
  return model.full_state_dict(/*rank0_only=*/false);
}

// FSDPOptions::comm_hook: the compression hooks on FSDP's reduce-scatter do
// what reduce_dtype does (divide, cast, sum in the low dtype, cast back), bit
// for bit at 2 ranks. A hook of one's own is called once per unit per
// synchronised backward (none inside no_sync()), in launch order, with the
// shard to scatter into under FULL_SHARD and none under NO_SHARD. A hook and
// a reduce_dtype together are refused.
TEST(FsdpCommHook, Fp16HookOnReduceScatterEqualsReduceDtypeFp16) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    const int world = group->size();
    const auto full_shard = ddp::FSDPOptions().sharding_strategy(ddp::ShardingStrategy::kFullShard);
    ddp::StateDict exact = sgd_fsdp_with(group, full_shard);
    for (const auto& [hook, dtype] : {std::pair{ddp::fp16_compress_hook(), at::kHalf},
                                      std::pair{ddp::bf16_compress_hook(), at::kBFloat16}}) {
      ddp::StateDict hooked = sgd_fsdp_with(group, ddp::FSDPOptions(full_shard).comm_hook(hook));
      ddp::StateDict reduced = sgd_fsdp_with(group, ddp::FSDPOptions(full_shard).reduce_dtype(dtype));
      EXPECT_EQ(max_difference(reduced, hooked), 0.0) << dtype << " rank " << group->rank();
      EXPECT_GT(max_difference(exact, hooked), 0.0) << dtype << ": the compression must show";
    }

    for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kNoShard}) {
      const std::string name = ddp::to_string(strategy);
      auto hook = std::make_shared<RecordingHook>();
      torch::manual_seed(0);
      BranchyNet net;
      ddp::FullyShardedDataParallel<BranchyNet> model(
          net, group, ddp::FSDPOptions().sharding_strategy(strategy).comm_hook(hook));
      const size_t units = model.unit_names().size();
      EXPECT_EQ(units, 3u);
      torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));
      auto expect_one_call_per_unit = [&](const std::string& when) {
        auto calls = hook->take();
        ASSERT_EQ(calls.size(), units) << name << " " << when;
        for (size_t i = 0; i < calls.size(); ++i) {
          const auto& call = calls[i];
          EXPECT_EQ(call.index, i) << name << " " << when;
          EXPECT_EQ(call.is_last, i + 1 == calls.size()) << name << " " << when << " bucket " << i;
          EXPECT_EQ(call.buffer_dtype, at::kFloat) << name;
          EXPECT_EQ(call.scatters, strategy != ddp::ShardingStrategy::kNoShard) << name << " bucket " << i;
          if (call.scatters) {
            EXPECT_EQ(call.shard_numel * world, call.buffer_numel) << name << " bucket " << i;
            EXPECT_EQ(call.shard_dtype, at::kFloat) << name;
          }
        }
      };
      for (int64_t step = 0; step < kSteps; ++step) {
        auto [x, y] = batch(step, group->rank(), group->size());
        optimizer.zero_grad();
        torch::nn::functional::mse_loss(model.forward(x), y).backward();
        expect_one_call_per_unit("step " + std::to_string(step));
        optimizer.step();
      }
      // The default hook's arithmetic is the engine's own.
      EXPECT_EQ(max_difference(sgd_fsdp_with(group, ddp::FSDPOptions().sharding_strategy(strategy)),
                               model.full_state_dict(/*rank0_only=*/false)),
                0.0)
          << name;
      auto [x, y] = batch(0, group->rank(), group->size());
      {
        auto guard = model.no_sync();
        torch::nn::functional::mse_loss(model.forward(x), y).backward();
      }
      EXPECT_TRUE(hook->take().empty()) << name << ": no_sync() backward called the hook";
      torch::nn::functional::mse_loss(model.forward(x), y).backward();
      expect_one_call_per_unit("after no_sync");
    }

    std::string message = error_of([&] {
      torch::manual_seed(0);
      ddp::FullyShardedDataParallel<BranchyNet> model(
          BranchyNet(), group, ddp::FSDPOptions().comm_hook(ddp::fp16_compress_hook()).reduce_dtype(at::kHalf));
    });
    EXPECT_NE(message, "") << "comm_hook with reduce_dtype accepted";
    EXPECT_NE(message.find("reduce_dtype"), std::string::npos) << message;
    EXPECT_THROW(
        {
          torch::manual_seed(0);
          ddp::FullyShardedDataParallel<BranchyNet> model(
              BranchyNet(), group,
              ddp::FSDPOptions().comm_hook(ddp::bf16_compress_hook()).reduce_dtype(at::kBFloat16));
        },
        ddp::Error);
    std::printf("rank %d compared comm hooks\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared comm hooks"), std::string::npos) << r.out;
}

}  // namespace

namespace {

// Review fixes around param_dtype.
//
// Frozen parameters (in a unit and in the root) compute in param_dtype like
// the rest, so a bf16 forward does not meet a float32 weight; state dicts
// and the module after the wrapper is gone keep them exactly as built.
TEST(MixedPrecision, FrozenParametersComputeInParamDtypeAndKeepTheirOwnValues) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kNoShard}) {
      torch::manual_seed(0);
      BranchyNet net;
      freeze(net);
      const at::Tensor frozen_weight = net->block->module()->fc1->weight.detach().clone();
      const at::Tensor frozen_bias = net->head->bias.detach().clone();
      {
        ddp::FullyShardedDataParallel<BranchyNet> model(
            net, group,
            ddp::FSDPOptions().sharding_strategy(strategy).param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)
                .output_dtype(at::kFloat));
        EXPECT_EQ(net->head->bias.scalar_type(), at::kBFloat16) << ddp::to_string(strategy);
        torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        run_steps(model, optimizer, group);
        auto state = by_name(model.full_state_dict(/*rank0_only=*/false));
        EXPECT_EQ(state.at("block.fc1.weight").scalar_type(), at::kFloat);
        EXPECT_TRUE(state.at("block.fc1.weight").equal(frozen_weight)) << ddp::to_string(strategy);
        EXPECT_TRUE(state.at("head.bias").equal(frozen_bias)) << ddp::to_string(strategy);
      }
      EXPECT_EQ(net->head->bias.scalar_type(), at::kFloat);
      EXPECT_TRUE(net->head->bias.equal(frozen_bias)) << ddp::to_string(strategy);
      EXPECT_TRUE(net->block->module()->fc1->weight.equal(frozen_weight)) << ddp::to_string(strategy);
      EXPECT_EQ(net->first->module()->weight.scalar_type(), at::kFloat) << "the wrapper gives the module its dtype back";
    }
    std::printf("rank %d checked frozen parameters under param_dtype\n", group->rank());
  });
  expect_all_succeeded(ranks);
}

// Two backward passes through one forward (retain_graph) accumulate twice
// the gradient of one, under every strategy, with and without param_dtype:
// the second pass finds the root unit gathered again.
TEST(MixedPrecision, TwoBackwardPassesThroughOneForwardAccumulate) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kShardGradOp,
                          ddp::ShardingStrategy::kNoShard}) {
      for (bool bf16 : {false, true}) {
        auto options = ddp::FSDPOptions().sharding_strategy(strategy);
        if (bf16) options.param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat);
        auto [x, y] = batch(0, group->rank(), group->size());
        std::vector<at::Tensor> once, twice;
        for (int passes : {1, 2}) {
          torch::manual_seed(0);
          BranchyNet net;
          ddp::FullyShardedDataParallel<BranchyNet> model(net, group, options);
          at::Tensor loss = torch::nn::functional::mse_loss(model.forward(x), y);
          for (int p = 0; p < passes; ++p) loss.backward({}, /*retain_graph=*/true);
          for (const auto& shard : model.parameters()) (passes == 1 ? once : twice).push_back(shard.grad().clone());
        }
        const std::string what = ddp::to_string(strategy) + (bf16 ? " bf16" : "");
        ASSERT_EQ(once.size(), twice.size()) << what;
        for (size_t i = 0; i < once.size(); ++i) {
          EXPECT_TRUE(twice[i].allclose(2 * once[i], 1e-6, 1e-7)) << what << " shard " << i;
        }
      }
    }
    std::printf("rank %d checked retain_graph\n", group->rank());
  });
  expect_all_succeeded(ranks);
}

}  // namespace
