// FaultTolerance's per-step vote and beats (src/fault/fault_tolerance.cpp): one small
// all-reduce over the group decides "commit" with no store operation, and a member whose vote's
// answer was lost learns the verdict from the store, where the members that got the answer
// publish it when the generation ends. Three ft_worker replicas under ddprun --fault-tolerance,
// real processes over real sockets; the seams (tests/workers/ft_vote_seams.cpp) drop one
// member's answer, and delay the others' publishing. The members' beats go over their liveness
// connections, so a stalled store makes nobody look hung.
#include <signal.h>

#include <regex>
#include <thread>

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

namespace {

// The store keeper's pid, from ddprun's "(ddp_ft_store, pid N)" line; -1 until it is printed.
int keeper_pid(const std::string& err) {
  std::smatch match;
  static const std::regex kKeeper(R"(ddp_ft_store, pid (\d+)\))");
  return std::regex_search(err, match, kKeeper) ? std::stoi(match[1]) : -1;
}

// Three ft_worker replicas under ddprun --fault-tolerance (150 steps of 20 ms, one restart),
// started in the background; returns once one of them printed step 10.
BackgroundProcess start_job_at_step_ten(EnvAssignments env) {
  env.emplace_back("FT_STEPS", "150");
  env.emplace_back("FT_STEP_MS", "20");
  env.emplace_back("OMP_NUM_THREADS", "1");
  RunOptions options = run_options(std::move(env));
  options.timeout = 120s;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--fault-tolerance", "--nproc-per-node", "3", "--max-restarts", "1",
                   bin_path("ft_worker")}),
      options);
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (ddp::testing::last_step_in(ddp::testing::read_text_file(job.out_path)) < 10 &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(20ms);
  }
  return job;
}

}  // namespace

// The store itself stops answering for 2.5 s (its keeper SIGSTOPped; longer than the heartbeat
// timeout) and rank 2 is killed meanwhile: once the store answers again, the survivors form the
// next generation together, ddprun's restarted rank 2 heals, and all end with equal weights.
TEST(FtBeats, AStoreStalledLongerThanTheHeartbeatTimeoutWhileAMemberDiesEndsNoOther) {
  BackgroundProcess job = start_job_at_step_ten({});
  const int keeper = keeper_pid(ddp::testing::read_text_file(job.err_path));
  const int victim = ddp::testing::child_with_rank(job.pid, "ft_worker", 2);
  ASSERT_GT(keeper, 0) << ddp::testing::read_text_file(job.err_path);
  ASSERT_GT(victim, 0) << ddp::testing::read_text_file(job.err_path);
  ASSERT_EQ(::kill(keeper, SIGSTOP), 0);
  std::this_thread::sleep_for(1500ms);
  ::kill(victim, SIGKILL);
  std::this_thread::sleep_for(1000ms);
  ASSERT_EQ(::kill(keeper, SIGCONT), 0);
  ProcessResult result = ddp::testing::wait_background(job, 120s);
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.err.find("fenced"), std::string::npos) << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 1u) << "only rank 2 failed: " << result.describe();
  EXPECT_EQ(result.err.find("no heartbeat"), std::string::npos) << "a member was taken for hung: "
                                                                << result.describe();
  expect_equal_finals(result);
}

// Members' beats travel over their liveness connections, not through the store. Rank 2 is
// killed, and rank 1's own store operations then stall for 2.5 s (both its connections; what
// an etcd member that dies as the leader does to its clients): rank 1 comes to the next quorum
// late. Its beats keep coming to rank 0, so rank 0 waits for it (up to the deadline) instead of
// taking it for hung. With heartbeats in the store, rank 1's stopped with its store, and rank 0
// left it out as "no heartbeat for 1000 ms (hung)": a healthy member fenced out.
TEST(FtBeats, AMemberWhoseStoreStallsIsNotTakenForHungWhileItsBeatsCome) {
  BackgroundProcess job = start_job_at_step_ten({{"FT_TEST_STALL_STORE_MS", "2500"}, {"FT_TEST_STALL_RANK", "1"}});
  const int victim = ddp::testing::child_with_rank(job.pid, "ft_worker", 2);
  ASSERT_GT(victim, 0) << ddp::testing::read_text_file(job.err_path);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ProcessResult result = ddp::testing::wait_background(job, 120s);
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.err.find("fenced"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("no heartbeat"), std::string::npos) << "rank 1 was taken for hung: " << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 1u) << "only rank 2 failed: " << result.describe();
  // The survivors' change waited for rank 1: about the stall, not the 5 s deadline.
  // (ddprun's restart of rank 2 may join in the same change.)
  static const std::regex kChange(
      R"(\[rank0\]: ddp: membership: replica \S+ left \(crash: connection closed\)[^\n]*; recovered in (\d+) ms; 3 -> [23] replicas)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.err, match, kChange)) << result.describe();
  EXPECT_GT(std::stoi(match[1]), 2000) << result.describe();
  EXPECT_LT(std::stoi(match[1]), 5000) << result.describe();
  expect_equal_finals(result);
}
