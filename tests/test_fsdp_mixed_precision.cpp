// FSDP's mixed precision on real ranks (support/ranks.h): param_dtype with
// float32 master shards, output_dtype, the memory the gathered units take,
// frozen parameters and accumulation under casts.
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
