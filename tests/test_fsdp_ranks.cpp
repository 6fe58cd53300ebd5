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

#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>

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
