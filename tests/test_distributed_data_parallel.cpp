// DistributedDataParallel across real processes launched by ddprun.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <filesystem>
#include <regex>

namespace fs = std::filesystem;

using namespace ddp::testing;

namespace {

double max_abs_diff(const std::string& out) {
  std::smatch m;
  std::regex pattern("max_abs_diff=([0-9.eE+-]+)");
  if (!std::regex_search(out, m, pattern)) return 1e9;
  return std::stod(m[1]);
}

TEST(DistributedDataParallel, TwoRanksMatchOneProcessWithDoubleBatch) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"equivalence", "--steps", "10", "--batch", "4"}), one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, "REPLICAS identical"), 2) << r.out;
  EXPECT_LE(max_abs_diff(r.out), 1e-6) << r.out;
  EXPECT_NE(r.out.find("BUCKETS 1"), std::string::npos) << r.out;
}

TEST(DistributedDataParallel, ManySmallBucketsGiveTheSameResult) {
  // A cap of a few hundred bytes gives each layer its own bucket, so
  // all-reduces start while backward still computes earlier layers.
  auto r = run_process(under_ddprun(2, "ddp_worker", {"equivalence", "--steps", "10", "--batch", "4",
                                                      "--bucket-cap-mb", "0.0003"}),
                       one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_LE(max_abs_diff(r.out), 1e-6) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("BUCKETS ([0-9]+)"))) << r.out;
  EXPECT_EQ(std::stoi(m[1]), 3) << r.out;  // one per layer
}

TEST(DistributedDataParallel, ThreeRanksWithUnevenData) {
  auto r = run_process(under_ddprun(3, "ddp_worker", {"equivalence", "--steps", "8", "--batch", "3",
                                                      "--dataset", "50"}),
                       one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, "REPLICAS identical"), 3) << r.out;
  EXPECT_LE(max_abs_diff(r.out), 1e-6) << r.out;
}

TEST(DistributedDataParallel, MismatchedModelsFailOnEveryRank) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"mismatch"}), one_rank({{"DDP_TIMEOUT_SECONDS", "20"}}));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.out.find("NO ERROR"), std::string::npos) << r.describe();
  // The first rank to fail is reported by ddprun; its message names the
  // first differing parameter with both shapes.
  EXPECT_NE(r.err.find("parameter 'fc3.weight' has shape [4, 32] on rank 0 but [5, 32] on rank 1"),
            std::string::npos)
      << r.describe();
}

TEST(DistributedDataParallel, BothRanksReportAMismatchWhenLaunchedByHand) {
  std::string port = std::to_string(free_port());
  std::vector<BackgroundProcess> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.push_back(start_background({bin_path("ddp_worker"), "mismatch"},
                                     one_rank({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"},
                                               {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                                               {"DDP_TIMEOUT_SECONDS", "20"}})));
  }
  for (int rank = 0; rank < 2; ++rank) {
    auto r = wait_background(ranks[rank], std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, 1) << r.describe();
    EXPECT_NE(r.err.find("'fc3.weight'"), std::string::npos) << "rank " << rank << ": " << r.describe();
  }
}

TEST(DistributedDataParallel, ARankThatThrowsEndsTheJobQuickly) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"throw", "--rank", "1"}),
                       one_rank({}, std::chrono::seconds(60)));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_LT(r.seconds, 30) << r.describe();
  EXPECT_NE(r.err.find("deliberate failure on rank 1"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r.describe();
}

TEST(DistributedDataParallel, UnusedParametersAreNamed) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"unused"}), one_rank({{"DDP_TIMEOUT_SECONDS", "20"}}));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("'unused.weight'"), std::string::npos) << r.describe();
}

TEST(DistributedDataParallel, BuffersFollowRankZeroBeforeEachForward) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"buffers"}), one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, "BUFFERS synchronised"), 2) << r.out;
}

}  // namespace

namespace {

double number_after(const std::string& out, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(key + "([0-9.eE+-]+)"))) return 1e9;
  return std::stod(m[1]);
}

struct OptionCase {
  std::vector<std::string> flags;
  std::string name;
};

TEST(DistributedDataParallel, EveryEngineOptionKeepsTheEquivalence) {
  std::vector<OptionCase> cases = {
      {{"--bucket-view"}, "gradient_as_bucket_view"},
      {{"--bucket-view", "--bucket-cap-mb", "0.0003"}, "gradient_as_bucket_view, 3 buckets"},
      {{"--find-unused"}, "find_unused_parameters with every parameter used"},
      {{"--no-overlap"}, "all-reduce after backward"},
      {{"--no-rebuild"}, "no bucket rebuild"},
      {{"--bucket-cap-mb", "0.0003", "--no-rebuild"}, "3 buckets, no rebuild"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"equivalence", "--steps", "8", "--batch", "4"};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    auto r = run_process(under_ddprun(2, "ddp_worker", args), one_rank({}));
    ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.describe();
    EXPECT_LE(max_abs_diff(r.out), 1e-6) << c.name << ": " << r.out;
    EXPECT_EQ(count_of(r.out, "REPLICAS identical"), 2) << c.name << ": " << r.out;
  }
}

TEST(DistributedDataParallel, BucketViewGradientsLiveInTheBuckets) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"equivalence", "--bucket-view", "--bucket-cap-mb", "0.0003"}),
                       one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  // The optimizer's zero_grad() ran every step, and still every gradient
  // ends up in bucket memory.
  EXPECT_EQ(count_of(r.out, "GRADS IN BUCKETS 6 of 6"), 2) << r.out;
}

TEST(DistributedDataParallel, BucketsAreRebuiltOnceUnlessDisabled) {
  auto rebuilt = run_process(under_ddprun(2, "ddp_worker", {"equivalence", "--steps", "2"}), one_rank({}));
  ASSERT_EQ(rebuilt.exit_code, 0) << rebuilt.describe();
  EXPECT_EQ(count_of(rebuilt.out, "REBUILT 1"), 2) << rebuilt.out;
  auto kept = run_process(under_ddprun(2, "ddp_worker", {"equivalence", "--steps", "2", "--no-rebuild"}), one_rank({}));
  ASSERT_EQ(kept.exit_code, 0) << kept.describe();
  EXPECT_EQ(count_of(kept.out, "REBUILT 0"), 2) << kept.out;
}

TEST(DistributedDataParallel, NoSyncAccumulatesLocallyThenMatchesOneLargeBatch) {
  for (std::vector<std::string> args : {std::vector<std::string>{"no_sync", "--micro", "3"},
                                        std::vector<std::string>{"no_sync", "--micro", "2", "--bucket-view"}}) {
    auto r = run_process(under_ddprun(2, "ddp_worker", args), one_rank({}));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(count_of(r.out, "NO_SYNC local_grads_differ=1"), 2) << r.out;
    EXPECT_LE(number_after(r.out, "NO_SYNC max_abs_diff="), 1e-6) << r.out;
  }
}

TEST(DistributedDataParallel, FindUnusedParametersHandlesPerRankBranches) {
  for (std::vector<std::string> args : {std::vector<std::string>{"find_unused"},
                                        std::vector<std::string>{"find_unused", "--bucket-view"}}) {
    auto r = run_process(under_ddprun(2, "ddp_worker", args), one_rank({{"DDP_TIMEOUT_SECONDS", "30"}}));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(count_of(r.out, "FIND_UNUSED never_untouched=1 right_same=1 right_is_average=1"), 2) << r.out;
  }
}

TEST(DistributedDataParallel, GradientsFromNoSyncStepsAreAveragedEvenIfUnusedLater) {
  for (std::vector<std::string> args : {std::vector<std::string>{"nosync_unused"},
                                        std::vector<std::string>{"nosync_unused", "--bucket-view"}}) {
    auto r = run_process(under_ddprun(2, "ddp_worker", args), one_rank({{"DDP_TIMEOUT_SECONDS", "30"}}));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(count_of(r.out, "NOSYNC_UNUSED averaged=1"), 2) << r.out;
  }
}

TEST(DistributedDataParallel, CommunicationHooks) {
  auto exact = run_process(under_ddprun(2, "ddp_worker", {"hook_gradients"}), one_rank({}));
  ASSERT_EQ(exact.exit_code, 0) << exact.describe();
  EXPECT_LE(number_after(exact.out, "max_rel_err="), 1e-6) << exact.out;

  auto fp16 = run_process(under_ddprun(2, "ddp_worker", {"hook_gradients", "--hook", "fp16", "--tolerance", "2e-3"}),
                          one_rank({}));
  ASSERT_EQ(fp16.exit_code, 0) << fp16.describe();
  double fp16_error = number_after(fp16.out, "max_rel_err=");
  EXPECT_GT(fp16_error, 0) << "fp16 rounding must show: " << fp16.out;

  auto bf16 = run_process(under_ddprun(2, "ddp_worker", {"hook_gradients", "--hook", "bf16", "--tolerance", "2e-2"}),
                          one_rank({}));
  ASSERT_EQ(bf16.exit_code, 0) << bf16.describe();
  // bf16 keeps 8 mantissa bits to fp16's 11: a larger error than fp16's.
  EXPECT_GT(number_after(bf16.out, "max_rel_err="), fp16_error) << bf16.out;
}

}  // namespace

namespace {

TEST(NoHangs, APeerThatStopsAnsweringTimesOutWithTheOperationNamed) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"stall"}),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "3"}}, std::chrono::seconds(60)));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out.find("NO TIMEOUT"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("all_reduce failed on rank 0 of 2 (timeout 3 s)"), std::string::npos) << r.describe();
  EXPECT_LT(r.seconds, 30) << r.describe();
}

TEST(NoHangs, NonFiniteLossIsSkippedOnEveryRankTogether) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"nonfinite", "--policy", "skip"}), one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, "NONFINITE skipped=1 finite=1 identical=1"), 2) << r.out;
}

TEST(NoHangs, NonFiniteLossAbortsEveryRank) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"nonfinite", "--policy", "abort"}), one_rank({}));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("[rank0]: error: ddp: the loss is not finite on rank(s) 1 at step 2"), std::string::npos)
      << r.describe();
  EXPECT_NE(r.err.find("[rank1]: error: ddp: the loss is not finite on rank(s) 1 at step 2"), std::string::npos)
      << r.describe();
}

TEST(NoHangs, JoinLetsRanksWithFewerBatchesFinish) {
  for (int n : {2, 3}) {
    auto r = run_process(under_ddprun(n, "ddp_worker", {"join"}),
                         one_rank({{"DDP_TIMEOUT_SECONDS", "20"}}, std::chrono::seconds(60)));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_NE(r.out.find("JOIN rank 0 trained 3 shadowed " + std::to_string(2 * (n - 1))), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("JOIN identical=1"), std::string::npos) << r.out;
    EXPECT_LE(number_after(r.out, "JOIN identical=1 max_abs_diff="), 1e-6) << r.out;
  }
}

}  // namespace

namespace {

TEST(ZeroRedundancyOptimizer, MatchesTheFullOptimizerBitForBit) {
  struct Case {
    int ranks;
    std::string optimizer;
  };
  for (const Case& c : {Case{2, "adam"}, Case{2, "adamw"}, Case{2, "sgd"}, Case{3, "adam"}}) {
    auto r = run_process(under_ddprun(c.ranks, "ddp_worker", {"zero", "--optimizer", c.optimizer}), one_rank({}));
    ASSERT_EQ(r.exit_code, 0) << c.optimizer << " x" << c.ranks << ": " << r.describe();
    EXPECT_EQ(count_of(r.out, "same_weights=1 replicas=1"), c.ranks) << r.out;
    EXPECT_NE(r.out.find("ZERO consolidated 6 states, same_state=1"), std::string::npos) << r.out;
    // Each rank holds state only for the parameters it owns.
    std::regex owns("owns ([0-9]+) of 6 parameters, holds state for ([0-9]+)");
    int total = 0;
    for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), owns); it != std::sregex_iterator(); ++it) {
      EXPECT_EQ((*it)[1], (*it)[2]) << r.out;
      EXPECT_LT(std::stoi((*it)[1]), 6) << r.out;
      total += std::stoi((*it)[1]);
    }
    EXPECT_EQ(total, 6) << r.out;
  }
}

TEST(ZeroRedundancyOptimizer, ConsolidatedStateLoadsIntoPythonAdam) {
  auto dir = make_temp_dir("zero");
  auto r = run_process(under_ddprun(2, "ddp_worker", {"zero", "--save", dir + "/optimizer.pt"}), one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto py = run_process({DDP_PYTHON, "-c",
                         "import sys, torch\n"
                         "s = torch.load(sys.argv[1])\n"
                         "m = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))\n"
                         "opt = torch.optim.Adam(m.parameters(), lr=0.5)\n"
                         "opt.load_state_dict(s)\n"
                         "print('loaded', len(opt.state), 'states, step', float(opt.state[m[0].weight]['step']),"
                         " 'lr', opt.param_groups[0]['lr'])\n",
                         dir + "/optimizer.pt"});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_NE(py.out.find("loaded 6 states, step 6.0 lr 0.01"), std::string::npos) << py.out;
  fs::remove_all(dir);
}

}  // namespace
