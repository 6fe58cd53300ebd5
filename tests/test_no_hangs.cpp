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

