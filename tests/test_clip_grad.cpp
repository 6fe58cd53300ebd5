// ddp::clip_grad_norm_ on real ranks (support/ranks.h, support/fsdp_trainers.h):
// under every strategy it clips as DDP followed by LibTorch's own
// torch::nn::utils::clip_grad_norm_ does, at 2 and 3 ranks, for the 2-norm
// and the largest magnitude, with bf16 parameters too; LibTorch's function on
// FSDP's shards does not; a non-finite total norm is seen by every rank alike.
#include "support/fsdp_nets.h"
#include "support/fsdp_trainers.h"
#include "support/ranks.h"

#include <ddp/clip_grad.h>
#include <ddp/error.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace ddp::testing;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Small enough that every step of the test model clips (its gradients' norms
// are about 0.05 to 0.15), so the bound is what shapes the trajectory.
constexpr double kMaxNorm = 0.01;

std::string text_of(const std::vector<double>& norms) {
  std::string text;
  for (double n : norms) text += " " + std::to_string(n);
  return text;
}

std::string norm_name(double norm_type) { return norm_type == kInf ? "inf-norm" : "2-norm"; }

void expect_same_norms(const std::vector<double>& expected, const std::vector<double>& got, double tolerance,
                       const std::string& label) {
  ASSERT_EQ(expected.size(), got.size()) << label;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(got[i], expected[i], tolerance * std::max(1.0, std::abs(expected[i]))) << label << ", step " << i;
  }
}

void expect_every_strategy_clips_like_ddp(int world) {
  expect_all_succeeded(run_on_ranks(world, [world](const std::shared_ptr<ddp::ProcessGroup>& group) {
    for (double norm_type : {2.0, kInf}) {
      const std::string label = norm_name(norm_type) + " at " + std::to_string(world) + " ranks";
      // The reference: DDP, then LibTorch's clip on the averaged gradients.
      TrainSpec reference;
      reference.strategy = "ddp";
      // SGD: Adam divides by the gradient's own scale, which would hide most
      // of what clipping does.
      reference.optimizer = "sgd";
      reference.clip_max_norm = kMaxNorm;
      reference.clip_norm_type = norm_type;
      reference.clip_with_libtorch = true;
      const TrainResult expected = train(group, reference);
      // Every step clipped, and clipping changed where training went.
      for (double norm : expected.norms) EXPECT_GT(norm, 2 * kMaxNorm) << label << text_of(expected.norms);
      TrainSpec unclipped = reference;
      unclipped.clip_max_norm = 0;
      const auto free_running = train(group, unclipped).state;
      if (group->rank() == 0) EXPECT_GT(max_difference(expected.state, free_running), 1e-2) << label;

      for (const std::string strategy : {"ddp", "zero1", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard"}) {
        TrainSpec s = reference;
        s.strategy = strategy;
        s.clip_with_libtorch = false;
        const TrainResult got = train(group, s);
        expect_same_norms(expected.norms, got.norms, 1e-6, strategy + ", " + label);
        if (group->rank() == 0) EXPECT_LE(max_difference(expected.state, got.state), 1e-6) << strategy << ", " << label;
      }

      // What the docs warn about: LibTorch's clip on FSDP's shards sees only
      // this rank's part of the gradient, so its 2-norm is too small and the
      // ranks clip by different factors. (Its largest magnitude is right on
      // the rank that holds it, wrong on the others.)
      if (norm_type != 2.0) continue;
      TrainSpec wrong = reference;
      wrong.strategy = "fsdp-full";
      const TrainResult misclipped = train(group, wrong);
      ASSERT_FALSE(misclipped.norms.empty());
      EXPECT_LT(misclipped.norms[0], expected.norms[0] * (1 - 1e-3))
          << label << " on rank " << group->rank() << ": LibTorch's" << text_of(misclipped.norms) << " against"
          << text_of(expected.norms);
      if (group->rank() == 0) EXPECT_GT(max_difference(expected.state, misclipped.state), 1e-4) << label;
    }
  }));
}

TEST(ClipGradNorm, EveryStrategyClipsAsDdpWithLibTorchsClipAt2Ranks) { expect_every_strategy_clips_like_ddp(2); }
TEST(ClipGradNorm, EveryStrategyClipsAsDdpWithLibTorchsClipAt3Ranks) { expect_every_strategy_clips_like_ddp(3); }

// bf16 parameters, fp32 shards: clipping the shards' fp32 gradients across
// ranks equals clipping the whole gradient, which NO_SHARD holds on every
// rank and LibTorch's function clips correctly.
TEST(ClipGradNorm, MixedPrecisionShardsClipAsTheWholeGradient) {
  expect_all_succeeded(run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    for (double norm_type : {2.0, kInf}) {
      TrainSpec reference;
      reference.strategy = "fsdp-no-shard";
      reference.optimizer = "sgd";
      reference.param_dtype = at::kBFloat16;
      reference.clip_max_norm = kMaxNorm;
      reference.clip_norm_type = norm_type;
      reference.clip_with_libtorch = true;
      const TrainResult expected = train(group, reference);
      for (double norm : expected.norms) EXPECT_GT(norm, 2 * kMaxNorm) << text_of(expected.norms);
      for (const std::string strategy : {"fsdp-full", "fsdp-grad-op"}) {
        TrainSpec s = reference;
        s.strategy = strategy;
        s.clip_with_libtorch = false;
        const TrainResult got = train(group, s);
        const std::string label = strategy + " bf16, " + norm_name(norm_type);
        expect_same_norms(expected.norms, got.norms, 1e-6, label);
        if (group->rank() == 0) EXPECT_LE(max_difference(expected.state, got.state), 1e-6) << label;
      }
    }
  }));
}

// One rank's shard of the gradient holds a NaN or an infinity that no other
// rank sees: the total norm still says so on every rank, so every rank skips
// (gradients untouched) or every rank throws.
TEST(ClipGradNorm, ANonFiniteShardOnOneRankIsSeenByEveryRank) {
  expect_all_succeeded(run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(torch::nn::Linear(10, 33), torch::nn::ReLU(), torch::nn::Linear(33, 5));
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(net, group);
    auto backward = [&](double poison) {
      for (auto& p : model.parameters()) {
        if (p.grad().defined()) p.grad().zero_();
      }
      auto [x, y] = global_batch(0);
      torch::nn::functional::mse_loss(model.forward(x), y).backward();
      if (group->rank() == 1) model.parameters()[0].grad()[0] = poison;
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (double norm_type : {2.0, kInf}) {
      for (double poison : {nan, kInf}) {
        backward(poison);
        std::vector<at::Tensor> before;
        for (auto& p : model.parameters()) before.push_back(p.grad().clone());
        const double norm = ddp::clip_grad_norm_(model, kMaxNorm, norm_type, ddp::NonFinitePolicy::kSkipStep);
        if (std::isnan(poison)) EXPECT_TRUE(std::isnan(norm)) << norm_type << " " << norm;
        else EXPECT_EQ(norm, kInf) << norm_type;
        // Skipped: the gradients are as backward left them.
        for (size_t i = 0; i < before.size(); ++i) {
          EXPECT_TRUE(at::equal(before[i].nan_to_num(), model.parameters()[i].grad().nan_to_num()));
        }
        backward(poison);
        try {
          ddp::clip_grad_norm_(model, kMaxNorm, norm_type, ddp::NonFinitePolicy::kAbort);
          ADD_FAILURE() << "a non-finite norm passed under kAbort on rank " << group->rank();
        } catch (const ddp::Error& e) {
          EXPECT_NE(std::string(e.what()).find("total gradient norm is"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("every rank stops"), std::string::npos) << e.what();
        }
      }
    }
    // A finite gradient after all that clips normally on both ranks.
    backward(0.0);
    EXPECT_TRUE(std::isfinite(ddp::clip_grad_norm_(model, kMaxNorm)));
  }));
}

TEST(ClipGradNorm, AnOrderThatIsNotANormIsRefusedByName) {
  expect_all_succeeded(run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    torch::manual_seed(0);
    ddp::DistributedDataParallel<torch::nn::Linear> model(torch::nn::Linear(4, 2), group);
    model.forward(at::ones({3, 4})).sum().backward();
    for (double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
      try {
        ddp::clip_grad_norm_(model, 1.0, bad);
        ADD_FAILURE() << "norm_type " << bad << " was accepted";
      } catch (const ddp::Error& e) {
        EXPECT_NE(std::string(e.what()).find("norm_type"), std::string::npos) << e.what();
      }
    }
    try {
      ddp::clip_grad_norm_(model, -1.0);
      ADD_FAILURE() << "a negative max_norm was accepted";
    } catch (const ddp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_norm"), std::string::npos) << e.what();
    }
  }));
}

}  // namespace
