// FaultTolerance's per-step vote (src/fault/fault_tolerance.cpp, should_commit): one small
// all-reduce over the group decides "commit" with no store operation, and a member whose vote's
// answer was lost learns the verdict from the store, where the members that got the answer
// publish it when the generation ends. Three ft_worker replicas under ddprun --fault-tolerance,
// real processes over real sockets; the seams (tests/workers/ft_vote_seams.cpp) drop one
// member's answer, and delay the others' publishing.
#include <regex>

#include "support/ddprun_fixtures.h"
#include "support/ft_jobs.h"

namespace {

using namespace ddprun_tests;

struct StatsLine {
  long long committed = -1;
  long long skipped = -1;
  double store_ops_per_step = -1;
};

// The "stats {...}" line of each rank's last incarnation.
std::map<int, StatsLine> stats_by_rank(const std::string& out) {
  static const std::regex kStats(
      R"(\[rank(\d+)\]: stats \{"ft_committed_steps": (\d+), "ft_skipped_steps": (\d+),.*"ft_store_ops_per_step": ([0-9.]+)\})");
  std::map<int, StatsLine> stats;
  for (std::sregex_iterator it(out.begin(), out.end(), kStats), end; it != end; ++it) {
    stats[std::stoi((*it)[1])] = {std::stoll((*it)[2]), std::stoll((*it)[3]), std::stod((*it)[4])};
  }
  return stats;
}

ProcessResult run_job(EnvAssignments env, const std::string& max_restarts = "0") {
  env.emplace_back("OMP_NUM_THREADS", "1");
  RunOptions options = run_options(std::move(env));
  options.timeout = 120s;
  return ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "3", "--max-restarts", max_restarts,
                 bin_path("ft_worker")},
                options);
}

void expect_equal_finals(const ProcessResult& result) {
  const auto finals = ddp::testing::finals_by_rank(result.out);
  ASSERT_EQ(finals.size(), 3u) << result.describe();
  for (const auto& [rank, hashes] : finals) {
    ASSERT_FALSE(hashes.empty()) << "rank " << rank;
    EXPECT_EQ(hashes.back(), finals.at(0).back()) << "rank " << rank << " ended with other weights: "
                                                  << result.describe();
  }
}

// Without a fault, a step costs the store nothing: the vote is the group's own all-reduce.
TEST(FtVote, AFaultFreeStepTouchesNoStore) {
  ProcessResult result = run_job({{"FT_STEPS", "40"}, {"FT_STEP_MS", "0"}});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  expect_equal_finals(result);
  const auto stats = stats_by_rank(result.out);
  ASSERT_EQ(stats.size(), 3u) << result.describe();
  for (const auto& [rank, s] : stats) {
    EXPECT_EQ(s.committed, 40) << "rank " << rank;
    EXPECT_EQ(s.skipped, 0) << "rank " << rank;
    EXPECT_EQ(s.store_ops_per_step, 0.0) << "rank " << rank << ": " << result.describe();
  }
}

// Rank 1's answer to step 10's vote is lost after the others got theirs and committed. It must
// not guess: it asks the store, where the others publish "commit" when the generation it broke
// ends, so it commits step 10 too. Nobody is fenced out, nobody restarts, the job ends with
// equal weights, and only the others' step 11 (their group broke under them) is skipped.
TEST(FtVote, AMemberWhoseAnswerIsLostLearnsTheCommitFromTheStore) {
  ProcessResult result = run_job({{"FT_STEPS", "30"}, {"FT_STEP_MS", "5"}, {"FT_TEST_LOSE_VOTE_AT", "10"}});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.err.find("fenced:"), std::string::npos) << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 0u) << "no worker may fail: " << result.describe();
  expect_equal_finals(result);
  // Rank 1 committed step 10 (in the generation whose vote it lost).
  EXPECT_NE(result.out.find("[rank1]: step 10 gen 1 "), std::string::npos) << result.describe();
  const auto stats = stats_by_rank(result.out);
  ASSERT_EQ(stats.size(), 3u) << result.describe();
  for (const auto& [rank, s] : stats) {
    EXPECT_EQ(s.committed, 30) << "rank " << rank;
    EXPECT_LE(s.skipped, 1) << "rank " << rank;
  }
  EXPECT_EQ(stats.at(1).skipped, 0) << result.describe();
}

// The same loss, but the others publish their commit only after rank 1 stopped waiting (the
// grace is 500 ms; they take 2 s): rank 1 decided "skip" alone. The others find that when they
// publish, know they are a step ahead of the job, and leave (fenced out, exit 3) without making
// rank 1 wait for them; ddprun restarts them, they heal from rank 1, and all three end with
// equal weights.
TEST(FtVote, ACommitPublishedTooLateFencesItsMembersWhoHealFromTheOneThatSkipped) {
  // Rank 1, alone after step 10, holds at step 20 until a restarted member waits to join, and
  // 60 more steps of 50 ms leave the other time to join too before the job ends.
  ProcessResult result = run_job({{"FT_STEPS", "80"},
                                  {"FT_STEP_MS", "50"},
                                  {"FT_ADMIT_AT", "20"},
                                  {"FT_TEST_LOSE_VOTE_AT", "10"},
                                  {"FT_TEST_PUBLISH_DELAY_MS", "2000"}},
                                 "2");
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(count_of(result.err, "one step ahead of the job's"), 2u) << result.describe();
  EXPECT_NE(result.err.find("rank 0 (local rank 0"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("rank 2 (local rank 2"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("rank 1 (local rank 1"), std::string::npos) << "rank 1 never failed: "
                                                                        << result.describe();
  expect_equal_finals(result);
}

}  // namespace
