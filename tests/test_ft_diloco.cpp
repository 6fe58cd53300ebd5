// DiLoCo under FaultTolerance (include/ddp/diloco.h, issue 38 item 5 with
// issue 36) with real processes: tests/workers/ft_diloco_worker.cpp replicas
// over a c10d TCPStore that the test serves (as ddprun --fault-tolerance's
// keeper would), talking over real sockets on localhost. And the progress
// file that ddprun gives each fault-tolerant worker (issue 36, "Start-up
// failures"): created at the first committed step.

#include "support/ft_replica_job.h"
#include "support/subprocess.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

using namespace ddp::testing;

// An ft_diloco_worker replica (FTD_MODE=ft) or a replica of DiLoCo over a Gloo group (group).
struct Replica : ReplicaProcess {
  // sync index -> (skipped so far, hash)
  std::map<int64_t, std::pair<int64_t, std::string>> syncs() const {
    static const std::regex re(R"(sync (\d+) skipped (\d+) hash ([0-9a-f]+))");
    std::map<int64_t, std::pair<int64_t, std::string>> found;
    std::stringstream in(read_file(out));
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (std::regex_match(line, m, re)) found[std::stoll(m[1])] = {std::stoll(m[2]), m[3]};
    }
    return found;
  }
};

class FtDiLoCo : public FtReplicaJob<Replica> {
 protected:
  FtDiLoCo() : FtReplicaJob("ft_diloco_worker") {}

  // A replica with `name` (its output files; under fault tolerance also its
  // replica id) and the environment on top of the test's own.
  size_t start(const std::string& name, std::map<std::string, std::string> env) {
    if (env["FTD_MODE"] != "group") {
      env["FTD_MODE"] = "ft";
      env = with_ft_replica_env(std::move(env), store_->getPort(), name, /*deadline_ms=*/3000);
    }
    return launch(name, std::move(env));
  }

  // Waits for replicas `which` to exit within `seconds`; here each must also exit 0.
  void wait_exit(const std::vector<size_t>& which, double seconds) {
    ASSERT_TRUE(exit_within(which, seconds)) << "replicas did not finish in " << seconds << " s\n" << logs();
    for (size_t i : which) {
      EXPECT_TRUE(WIFEXITED(workers_[i].status) && WEXITSTATUS(workers_[i].status) == 0)
          << "replica " << i << " status " << workers_[i].status << "\n" << logs();
    }
  }
};

// ddprun tells a worker that failed at start-up from one that trained by
// this file: none before the first commit, there after it.
TEST_F(FtDiLoCo, ProgressFileAppearsAtTheFirstCommittedStep) {
  const std::string before = (dir_ / "progress.0").string();
  start("solo", {{"DDP_FT_INITIAL_REPLICAS", "1"}, {"FTD_STEPS", "0"}, {"DDP_FT_PROGRESS_FILE", before}});
  wait_exit({0}, 60);
  EXPECT_FALSE(fs::exists(before)) << "made before any committed step";
  const std::string after = (dir_ / "progress.1").string();
  new_store();
  start("solo2", {{"DDP_FT_INITIAL_REPLICAS", "1"}, {"FTD_STEPS", "10"}, {"DDP_FT_PROGRESS_FILE", after}});
  wait_exit({1}, 60);
  EXPECT_TRUE(fs::exists(after)) << "not made at the first committed step\n" << logs();
}

// Without faults, DiLoCo under FaultTolerance follows DiLoCo over a Gloo
// group of the same replicas bit for bit: the same pseudo-gradients (each
// replica's data is chosen by its rank) summed by the same Gloo all-reduce,
// divided by the same count, the same outer step.
TEST_F(FtDiLoCo, WithoutFaultsFollowsDiLoCoOverAGroupBitForBit) {
  const std::string port = std::to_string(free_port());
  for (int r = 0; r < 3; ++r) {
    start("group" + std::to_string(r), {{"FTD_MODE", "group"}, {"RANK", std::to_string(r)}, {"WORLD_SIZE", "3"},
                                        {"MASTER_PORT", port}, {"FTD_SEED", std::to_string(7 + r)}, {"FTD_STEPS", "60"}});
  }
  // A fault-tolerant replica's rank is its order of arrival at the first quorum, whose rank 0
  // gives everyone its weights: all start from seed 7, the group's rank 0's (the group's
  // others start elsewhere and take rank 0's by the broadcast).
  for (int r = 0; r < 3; ++r) start("ft" + std::to_string(r), {{"FTD_SEED", "7"}, {"FTD_STEPS", "60"}});
  wait_exit({0, 1, 2, 3, 4, 5}, 120);
  if (HasFatalFailure()) return;
  const auto reference = workers_[0].syncs();
  ASSERT_EQ(reference.size(), 12u) << logs();
  for (size_t i = 1; i < 6; ++i) {
    EXPECT_EQ(workers_[i].syncs(), reference) << "replica " << i << "\n" << logs();
    EXPECT_EQ(workers_[i].final_hash(), workers_[0].final_hash());
  }
  // The trajectory moved: not a run of unchanged weights.
  EXPECT_NE(reference.begin()->second.second, reference.rbegin()->second.second);
}

// Three replicas; one is SIGKILLed mid-run. The two survivors go on without a
// restart, skip at most the sync in flight (both the same ones), and end with
// identical global weights; the killed one, restarted under a new replica id,
// heals from a live member at a round's start and ends with the same weights.
TEST_F(FtDiLoCo, SurvivorsGoOnAndARestartedReplicaHealsToTheSameWeights) {
  const std::map<std::string, std::string> env{{"FTD_STEPS", "150"}, {"FTD_STEP_MS", "15"}, {"FTD_H", "5"}};
  for (const char* name : {"a", "b", "c"}) start(name, env);
  ASSERT_TRUE(wait_until([&] { return workers_[2].syncs().count(6) > 0; }, 60)) << logs();
  kill(workers_[2].pid, SIGKILL);
  waitpid(workers_[2].pid, nullptr, 0);
  workers_[2].exited = true;
  const auto killed_at = workers_[2].syncs().rbegin()->first;
  start("c-restarted", env);
  wait_exit({0, 1, 3}, 120);
  if (HasFatalFailure()) return;
  const auto a = workers_[0].syncs(), b = workers_[1].syncs(), joiner = workers_[3].syncs();
  ASSERT_EQ(a.size(), 30u) << logs();
  EXPECT_EQ(a, b) << "the survivors' syncs differ (hash or skipped count)\n" << logs();
  // At most the sync in flight at the kill is skipped.
  EXPECT_LE(a.rbegin()->second.first, 1) << logs();
  EXPECT_GE(a.rbegin()->second.first, 0);
  // The joiner came in after the kill and follows the survivors from then on.
  ASSERT_FALSE(joiner.empty()) << logs();
  EXPECT_GT(joiner.begin()->first, killed_at);
  EXPECT_LT(joiner.begin()->first, 30) << "the restarted replica never trained a round\n" << logs();
  for (const auto& [index, entry] : joiner) EXPECT_EQ(entry, a.at(index)) << "sync " << index << "\n" << logs();
  EXPECT_EQ(workers_[3].final_hash(), workers_[0].final_hash());
  EXPECT_EQ(workers_[1].final_hash(), workers_[0].final_hash());
  const std::string out = read_file(workers_[3].out);
  EXPECT_NE(out.find("joined at "), std::string::npos);
  EXPECT_EQ(out.find("joined at 0\n"), std::string::npos) << "the restarted replica started from step 0: not healed";
  std::printf("[measure] killed after sync %lld; the restarted replica's first sync %lld; survivors skipped %lld\n",
              static_cast<long long>(killed_at), static_cast<long long>(joiner.begin()->first),
              static_cast<long long>(a.rbegin()->second.first));
}

}  // namespace
