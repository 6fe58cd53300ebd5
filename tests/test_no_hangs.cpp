// Ranks that cannot go on together, on real processes (support/ranks.h): a
// peer that stops answering, a loss that is not finite on one rank, and
// Join for ranks with fewer batches.
#include <support/launch.h>
#include <support/ddp_models.h>
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

// Rank 1's loss turns NaN at step 2; all ranks act together. Returns how
// many steps were skipped.
int train_with_a_nan(const Group& group, ddp::NonFinitePolicy policy) {
  torch::manual_seed(2);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-2));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(5 + group->rank());
  int skipped = 0;
  for (int step = 0; step < 5; ++step) {
    at::Tensor x = at::randn({4, 10}, generator);
    at::Tensor y = at::randint(0, 4, {4}, generator, at::kLong);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(ddp_model.forward(x), y);
    if (step == 2 && group->rank() == 1) loss = loss * std::nan("");
    if (!ddp::check_loss_is_finite(loss, *group, policy, "step " + std::to_string(step))) {
      ++skipped;
      continue;
    }
    loss.backward();
    optimizer.step();
  }
  at::Tensor weights = flatten_parameters(*model);
  EXPECT_TRUE(at::isfinite(weights).all().item<bool>());
  expect_replicas_identical(group, weights);
  return skipped;
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

// Rank r has 3 + 2r batches; Join keeps the ranks together and the result
// equals one process averaging whatever gradients each step had.
void expect_join_matches_one_process(const Group& group) {
  const int world = group->size();
  torch::manual_seed(4);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
  at::Tensor initial = flatten_parameters(*model).clone();
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-2));
  auto batch_of = [](int rank, int k) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + k);
    return std::make_pair(at::randn({4, 10}, generator), at::randint(0, 4, {4}, generator, at::kLong));
  };
  auto batches_of = [](int rank) { return 3 + 2 * rank; };
  auto join = ddp_model.join();
  for (int k = 0; k < batches_of(group->rank()); ++k) {
    join.step();
    auto [x, y] = batch_of(group->rank(), k);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(ddp_model.forward(x), y).backward();
    optimizer.step();
  }
  join.finish();
  EXPECT_EQ(join.steps(), batches_of(group->rank()));
  EXPECT_EQ(join.shadowed_steps(), batches_of(world - 1) - batches_of(group->rank()));
  at::Tensor mine = flatten_parameters(*model);
  expect_replicas_identical(group, mine);
  if (group->rank() == 0) {
    // Step k: the sum of the losses of the ranks that still had batch k,
    // divided by the world size (absent ranks contribute zero gradients).
    Mlp reference;
    load_flat_parameters(*reference, initial);
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-2));
    for (int k = 0; k < batches_of(world - 1); ++k) {
      reference_optimizer.zero_grad();
      at::Tensor total = at::zeros({});
      for (int r = 0; r < world; ++r) {
        if (k >= batches_of(r)) continue;
        auto [x, y] = batch_of(r, k);
        total = total + torch::nn::functional::cross_entropy(reference->forward(x), y);
      }
      (total / world).backward();
      reference_optimizer.step();
    }
    EXPECT_LE((flatten_parameters(*reference) - mine).abs().max().item<double>(), 1e-6);
  }
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

