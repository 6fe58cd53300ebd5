// Fixed-size mode with spares (FaultToleranceOptions::fixed_size, issue 36):
// the first N members take part in each step's average, the others compute
// and receive every step but add zeros. So the job trains, bit for bit, as a
// job of N replicas; a lost participant's place goes to a spare at the next
// step; and without a spare the group waits for a joiner instead of
// shrinking the global batch. tests/workers/ft_worker.cpp replicas over a
// TCPStore the test serves (FT_FIXED_SIZE sets the mode).

#include "support/ft_replica_job.h"

#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ddp::testing;

class FtSpares : public FtReplicaJob<StepReplica> {
 protected:
  FtSpares() : FtReplicaJob("ft_worker") {}

  size_t start(const std::string& id, std::map<std::string, std::string> env) {
    return launch(id, with_ft_replica_env(std::move(env), store_->getPort(), id, /*deadline_ms=*/3000));
  }

  // The final weights of a fault-free job of 2 replicas (no spare) training `steps` steps: what
  // every job below must end with.
  std::string reference_hash(const std::string& steps) {
    new_store();
    const size_t a = start("ref-a", {{"FT_STEPS", steps}, {"FT_STEP_MS", "5"}, {"DDP_FT_INITIAL_REPLICAS", "2"}});
    const size_t b = start("ref-b", {{"FT_STEPS", steps}, {"FT_STEP_MS", "5"}, {"DDP_FT_INITIAL_REPLICAS", "2"}});
    EXPECT_TRUE(exit_within({a}, 60));
    EXPECT_TRUE(exit_within({b}, 60));
    EXPECT_EQ(workers_[a].final_hash(), workers_[b].final_hash());
    const std::string hash = workers_[a].final_hash();
    new_store();
    return hash;
  }

  // Every committed step line of `which` averaged over 2 participants (the global batch
  // never changed size).
  void expect_two_taking_part(const std::vector<size_t>& which) {
    for (size_t i : which) {
      for (const auto& s : workers_[i].steps()) {
        EXPECT_EQ(s.size, 2) << workers_[i].id << " step " << s.step;
        EXPECT_EQ(s.window.size(), 16u) << workers_[i].id << " step " << s.step;
      }
    }
  }
};

TEST_F(FtSpares, ASpareAddsNothingSoThreeReplicasTrainAsTwo) {
  const std::string expected = reference_hash("30");
  ASSERT_FALSE(expected.empty());
  std::vector<size_t> all;
  for (const char* id : {"r0", "r1", "r2"}) {
    all.push_back(start(id, {{"FT_STEPS", "30"}, {"FT_STEP_MS", "5"}, {"FT_FIXED_SIZE", "2"}}));
  }
  for (size_t i : all) ASSERT_TRUE(exit_within({i}, 60)) << read_file(workers_[i].err);
  std::set<int> ranks;
  for (size_t i : all) {
    EXPECT_EQ(workers_[i].final_hash(), expected) << workers_[i].id << "\n" << read_file(workers_[i].err);
    ranks.insert(workers_[i].steps().front().rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));  // rank 2 of 2 participants: the spare
  expect_two_taking_part(all);
  expect_same_weights(all);  // the spare holds the participants' weights at every step
}

TEST_F(FtSpares, ALostParticipantsPlaceGoesToTheSpareAndTheTrajectoryStaysTheSame) {
  const std::string expected = reference_hash("40");
  ASSERT_FALSE(expected.empty());
  std::vector<size_t> all;
  for (const char* id : {"r0", "r1", "r2"}) {
    all.push_back(start(id, {{"FT_STEPS", "40"}, {"FT_STEP_MS", "30"}, {"FT_FIXED_SIZE", "2"}}));
  }
  ASSERT_TRUE(wait_until([&] { return workers_[all[0]].committed() >= 10; }, 60));
  // SIGKILL the member that is rank 0, a participant.
  size_t victim = workers_.size();
  for (size_t i : all) {
    const auto steps = workers_[i].steps();
    if (!steps.empty() && steps.back().rank == 0) victim = i;
  }
  ASSERT_LT(victim, workers_.size());
  kill(-workers_[victim].pid, SIGKILL);
  ASSERT_TRUE(exit_within({victim}, 10));
  std::vector<size_t> survivors;
  for (size_t i : all) {
    if (i != victim) survivors.push_back(i);
  }
  for (size_t i : survivors) ASSERT_TRUE(exit_within({i}, 60)) << read_file(workers_[i].err);
  for (size_t i : survivors) {
    EXPECT_EQ(workers_[i].final_hash(), expected) << workers_[i].id << "\n" << read_file(workers_[i].err);
    EXPECT_EQ(workers_[i].skipped().size(), 1u) << workers_[i].id << "\n" << read_file(workers_[i].out);
    // After the kill, both survivors take part: the spare became a participant.
    EXPECT_LT(workers_[i].steps().back().rank, 2) << workers_[i].id;
    EXPECT_NE(read_file(workers_[i].err).find("3 -> 2 replicas (2 taking part, 0 spare)"), std::string::npos)
        << read_file(workers_[i].err);
  }
  expect_two_taking_part(survivors);
}

TEST_F(FtSpares, WithoutASpareTheGroupWaitsForAJoinerRatherThanShrinkTheBatch) {
  const std::string expected = reference_hash("40");
  ASSERT_FALSE(expected.empty());
  const std::map<std::string, std::string> env{
      {"FT_STEPS", "40"}, {"FT_STEP_MS", "30"}, {"FT_FIXED_SIZE", "2"}, {"DDP_FT_INITIAL_REPLICAS", "2"}};
  const size_t a = start("r0", env);
  const size_t b = start("r1", env);
  ASSERT_TRUE(wait_until([&] { return workers_[a].committed() >= 10; }, 60));
  kill(-workers_[b].pid, SIGKILL);
  ASSERT_TRUE(exit_within({b}, 10));
  // The survivor commits nothing while it is alone.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int64_t before = workers_[a].committed();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(workers_[a].committed(), before) << read_file(workers_[a].out);
  // A joiner is let in, heals, and the two train on as if nobody had been lost.
  const size_t c = start("r1-inc1", env);
  ASSERT_TRUE(exit_within({a}, 60)) << read_file(workers_[a].err);
  ASSERT_TRUE(exit_within({c}, 60)) << read_file(workers_[c].err);
  EXPECT_EQ(workers_[a].final_hash(), expected) << read_file(workers_[a].err);
  EXPECT_EQ(workers_[c].final_hash(), expected) << read_file(workers_[c].err);
  expect_two_taking_part({a, c});
}

}  // namespace
