// Ranks that cannot go on together, on real processes (support/ranks.h): a
// peer that stops answering, a loss that is not finite on one rank, and
// Join for ranks with fewer batches.
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

// Rank 1 stops answering (SIGSTOP) after joining; rank 0's next collective
// fails with the operation and the timeout named, then ends rank 1.
TEST(NoHangs, APeerThatStopsAnsweringTimesOutWithTheOperationNamed) {
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(60);
  auto ranks = run_on_ranks(
      2,
      [](const Group& group) {
        auto pids = group->all_gather(at::full({1}, static_cast<int64_t>(::getpid()), at::kLong));
        group->barrier();
        if (group->rank() == 1) std::raise(SIGSTOP);
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([&] {
          at::Tensor t = at::ones({4});
          group->all_reduce(t);
        });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_NE(error.find("all_reduce failed on rank 0 of 2 (timeout 3 s)"), std::string::npos) << error;
        EXPECT_LT(seconds, 30);
        ::kill(static_cast<pid_t>(pids[1].item<int64_t>()), SIGKILL);
        std::fflush(nullptr);
        std::_Exit(::testing::Test::HasFailure() ? 1 : 0);  // no shutdown with a dead peer
      },
      options);
  EXPECT_EQ(ranks[0].exit_code, 0) << describe_ranks(ranks);
  EXPECT_FALSE(ranks[0].timed_out) << describe_ranks(ranks);
  // Still stopped when rank 0 gave up.
  EXPECT_EQ(ranks[1].term_signal, SIGKILL) << describe_ranks(ranks);
}

TEST(NoHangs, NonFiniteLossIsSkippedOnEveryRankTogether) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    EXPECT_EQ(train_with_a_nan(group, ddp::parse_nonfinite_policy("skip")), 1);
  }));
}

TEST(NoHangs, NonFiniteLossAbortsEveryRank) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    const std::string error = error_of([&] { train_with_a_nan(group, ddp::parse_nonfinite_policy("abort")); });
    EXPECT_NE(error.find("ddp: the loss is not finite on rank(s) 1 at step 2"), std::string::npos) << error;
  }));
}

// The same check riding on the gradient all-reduce (DDPOptions::carry_loss):
// the same skip and abort on every rank, naming the rank and step, and no
// collective besides the gradient buckets' (one per step for this model).
TEST(NoHangs, NonFiniteLossRidingOnTheGradientsIsSkippedOnEveryRankWithoutACollectiveOfItsOwn) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    uint64_t riding = 0, separate = 0;
    EXPECT_EQ(train_with_a_nan(group, ddp::parse_nonfinite_policy("skip"), /*carry_loss=*/true, &riding), 1);
    EXPECT_EQ(train_with_a_nan(group, ddp::parse_nonfinite_policy("skip"), /*carry_loss=*/false, &separate), 1);
    // Riding: one bucket all-reduce per step (the NaN step's backward runs
    // too) and the bucket rebuild's broadcast after the first step. Apart:
    // 5 checks, 4 bucket all-reduces (the NaN step skips backward) and the
    // broadcast.
    EXPECT_EQ(riding, 6u);
    EXPECT_EQ(separate, 10u);
  }));
}

TEST(NoHangs, NonFiniteLossRidingOnTheGradientsAbortsEveryRank) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    const std::string error =
        error_of([&] { train_with_a_nan(group, ddp::parse_nonfinite_policy("abort"), /*carry_loss=*/true); });
    EXPECT_NE(error.find("ddp: the loss is not finite on rank(s) 1 at step 2"), std::string::npos) << error;
  }));
}

// The loss that rode on the gradients is every rank's loss averaged, the
// same on every rank, as an all-reduce of the losses gives it.
TEST(NoHangs, TheLossRidingOnTheGradientsIsTheAverageOverRanks) {
  expect_all_succeeded(run_on_ranks(3, [](const Group& group) {
    torch::manual_seed(2);
    Mlp model;
    ddp::DistributedDataParallel<Mlp> ddp_model(model, group, ddp::DDPOptions().carry_loss(true));
    auto generator = at::make_generator<at::CPUGeneratorImpl>(5 + group->rank());
    for (int step = 0; step < 3; ++step) {
      at::Tensor x = at::randn({4, 10}, generator);
      at::Tensor y = at::randint(0, 4, {4}, generator, at::kLong);
      auto loss = torch::nn::functional::cross_entropy(ddp_model.forward(x), y);
      ddp_model.note_loss(loss);
      loss.backward();
      at::Tensor mean = loss.detach().to(at::kDouble).reshape({1});
      group->all_reduce(mean);
      const auto& reduced = ddp_model.reduced_loss();
      EXPECT_TRUE(reduced.valid);
      EXPECT_TRUE(reduced.nonfinite_ranks.empty());
      EXPECT_NEAR(reduced.average, mean.item<double>() / 3, 1e-6) << "step " << step;
    }
    // Without a noted loss the next backward carries none, and saying so is an error.
    auto loss = torch::nn::functional::cross_entropy(ddp_model.forward(at::randn({4, 10}, generator)),
                                                     at::randint(0, 4, {4}, generator, at::kLong));
    loss.backward();
    EXPECT_FALSE(ddp_model.reduced_loss().valid);
    EXPECT_NE(error_of([&] { ddp::check_loss_is_finite(ddp_model.reduced_loss(), ddp::NonFinitePolicy::kSkipStep, "x"); })
                  .find("call model.note_loss(loss) before loss.backward()"),
              std::string::npos);
  }));
}

RanksOptions join_options() {
  RanksOptions options;
  options.collective_timeout_seconds = 20;
  return options;
}

TEST(NoHangs, JoinLetsRanksWithFewerBatchesFinish) {
  expect_all_succeeded(run_on_ranks(2, expect_join_matches_one_process, join_options()));
}

TEST(NoHangs, JoinLetsRanksWithFewerBatchesFinishAtThreeRanks) {
  expect_all_succeeded(run_on_ranks(3, expect_join_matches_one_process, join_options()));
}

}  // namespace

