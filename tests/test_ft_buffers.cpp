// FaultTolerance keeps the managed module's buffers in step across replicas
// (FaultToleranceOptions::broadcast_buffers, issue 36): at every step
// boundary every member holds the generation's rank 0's buffers, as DDP's
// broadcast before each forward gives. Three tests/workers/ft_worker.cpp
// replicas with a BatchNorm1d (FT_BATCHNORM=1) over a TCPStore the test
// serves; each prints its buffers' hash right after start_step().

#include "support/ft_replica_job.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace ddp::testing;

// "buffers <step> gen <g> rank <r>/<n> hash <h>", printed right after start_step().
struct BufferLine {
  int64_t step = 0, gen = 0;
  int rank = 0, size = 0;
  std::string hash;
};

struct Worker : StepReplica {
  // `what`: "buffers" (right after start_step()) or "after" (after backward).
  std::vector<BufferLine> buffers(const std::string& what = "buffers") const {
    const std::regex re(what + R"( (\d+) gen (\d+) rank (\d+)/(\d+) hash ([0-9a-f]+))");
    std::vector<BufferLine> lines;
    std::stringstream in(read_file(out));
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (!std::regex_match(line, m, re)) continue;
      lines.push_back({std::stoll(m[1]), std::stoll(m[2]), std::stoi(m[3]), std::stoi(m[4]), m[5]});
    }
    return lines;
  }
};

class FtBuffers : public FtReplicaJob<Worker> {
 protected:
  FtBuffers() : FtReplicaJob("ft_worker") {}

  size_t start(const std::string& id, std::map<std::string, std::string> env, int deadline_ms = 3000) {
    env.emplace("FT_BATCHNORM", "1");
    return launch(id, with_ft_replica_env(std::move(env), store_->getPort(), id, deadline_ms));
  }

  // The buffers' hashes at the start of each committed attempt (step, generation) of `which`,
  // by member; committed attempts are those a step line names (its gen is the attempt's).
  std::map<std::pair<int64_t, int64_t>, std::map<std::string, std::string>> committed_buffers(
      const std::vector<size_t>& which) {
    std::set<std::pair<int64_t, int64_t>> committed;
    for (size_t i : which) {
      for (const auto& s : workers_[i].steps()) committed.insert({s.step, s.gen});
    }
    std::map<std::pair<int64_t, int64_t>, std::map<std::string, std::string>> by_attempt;
    for (size_t i : which) {
      for (const auto& b : workers_[i].buffers()) {
        if (committed.count({b.step, b.gen})) by_attempt[{b.step, b.gen}][workers_[i].id] = b.hash;
      }
    }
    return by_attempt;
  }
};

// Every member's buffers are bit-identical at the start of every committed step: with 3
// members, after one is SIGKILLed (2), and after its restart joins (3 again). The running
// statistics move at every step (num_batches_tracked alone would change the hash). The attempt
// the kill broke leaves no trace in them: its redo starts from the buffers it started from.
TEST_F(FtBuffers, EqualOnEveryMemberAtEveryCommittedStepThroughACrashAndARejoin) {
  std::map<std::string, std::string> env{{"FT_STEPS", "45"}, {"FT_STEP_MS", "40"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  // Killed in its step's sleep, after the step's broadcast: the survivors skip an attempt whose
  // buffers they share.
  ASSERT_TRUE(wait_until([&] { return workers_[2].committed() >= 10; }, 40)) << logs();
  const size_t seen = workers_[2].buffers().size();
  const auto wait_end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (workers_[2].buffers().size() == seen && std::chrono::steady_clock::now() < wait_end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  kill(workers_[2].pid, SIGKILL);
  wait_exit({2}, 10);
  const int64_t killed_step = workers_[0].committed();
  ASSERT_TRUE(wait_until([&] { return workers_[0].committed() >= killed_step + 5; }, 20)) << logs();
  auto joiner_env = env;
  joiner_env["FT_SEED"] = "99";
  const size_t joiner = start("w2/inc1", joiner_env);
  wait_exit({0, 1, joiner}, 60);
  for (size_t i : {size_t(0), size_t(1), joiner}) ASSERT_EQ(workers_[i].status, 0) << logs();
  expect_same_weights({0, 1, 2, joiner});

  const auto by_attempt = committed_buffers({0, 1, 2, joiner});
  ASSERT_EQ(by_attempt.size(), 45u) << logs();
  std::map<int, int> attempts_of_size;
  std::set<std::string> distinct;
  int joiner_steps = 0;
  for (const auto& [attempt, hashes] : by_attempt) {
    const auto& [step, gen] = attempt;
    int size = 0;
    for (const auto& s : workers_[0].steps()) {
      if (s.step == step) size = s.size;
    }
    // Every member of the attempt printed its buffers, and they are equal.
    ASSERT_EQ(static_cast<int>(hashes.size()), size) << "step " << step << " gen " << gen << "\n" << logs();
    attempts_of_size[size] += 1;
    for (const auto& [id, hash] : hashes) {
      EXPECT_EQ(hash, hashes.begin()->second)
          << "step " << step << " gen " << gen << ": " << id << " differs from " << hashes.begin()->first;
    }
    joiner_steps += hashes.count("w2/inc1") > 0;
    distinct.insert(hashes.begin()->second);
  }
  EXPECT_GE(attempts_of_size[3], 10) << logs();
  EXPECT_GE(attempts_of_size[2], 5) << logs();
  EXPECT_GE(joiner_steps, 1) << logs();
  EXPECT_EQ(distinct.size(), by_attempt.size()) << "the buffers did not move at every step";

  // The skipped attempts whose broadcast completed (the survivors printed equal buffers): the
  // redo starts from the same buffers, though the attempt's forward had updated them.
  std::map<std::pair<int64_t, int64_t>, std::set<std::string>> skipped;
  for (size_t i : {0, 1}) {
    for (const auto& b : workers_[i].buffers()) {
      if (!by_attempt.count({b.step, b.gen})) skipped[{b.step, b.gen}].insert(b.hash);
    }
  }
  int redone = 0;
  for (const auto& [attempt, hashes] : skipped) {
    if (hashes.size() != 1) continue;
    for (const auto& [committed, by_member] : by_attempt) {
      if (committed.first != attempt.first) continue;
      EXPECT_EQ(by_member.begin()->second, *hashes.begin())
          << "step " << attempt.first << ": its redo in gen " << committed.second
          << " does not start from the buffers of the skipped attempt in gen " << attempt.second;
      redone += 1;
    }
  }
  std::printf("[ measured ] %zu skipped attempt(s), %d with shared buffers compared with their redo\n",
              skipped.size(), redone);
  EXPECT_GE(redone, 1) << logs();

  // DDP's semantics: a step starts from what rank 0's forward made of the buffers in the step
  // before (its own batch's statistics), within a generation.
  std::map<std::pair<int64_t, int64_t>, std::string> rank0_after;
  for (size_t i : {size_t(0), size_t(1), size_t(2), joiner}) {
    for (const auto& b : workers_[i].buffers("after")) {
      if (b.rank == 0 && by_attempt.count({b.step, b.gen})) rank0_after[{b.step, b.gen}] = b.hash;
    }
  }
  int followed = 0;
  for (const auto& [attempt, hashes] : by_attempt) {
    auto before = rank0_after.find({attempt.first - 1, attempt.second});
    if (before == rank0_after.end()) continue;
    EXPECT_EQ(hashes.begin()->second, before->second)
        << "step " << attempt.first << " gen " << attempt.second << " does not start from rank 0's buffers";
    followed += 1;
  }
  EXPECT_GE(followed, 35) << logs();
}

// The control: with broadcast_buffers(false) each member's statistics follow its own batches and
// drift apart from the first step on, while the weights stay equal (BatchNorm's training-mode
// forward does not read its running statistics). So the test above sees the broadcast at work.
TEST_F(FtBuffers, WithoutTheBroadcastMembersBuffersDriftApart) {
  std::map<std::string, std::string> env{{"FT_STEPS", "12"}, {"FT_STEP_MS", "5"}, {"FT_BROADCAST_BUFFERS", "0"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  wait_exit({0, 1, 2}, 60);
  for (size_t i : {0, 1, 2}) ASSERT_EQ(workers_[i].status, 0) << logs();
  expect_same_weights({0, 1, 2});
  int differing = 0;
  for (const auto& [attempt, hashes] : committed_buffers({0, 1, 2})) {
    std::set<std::string> values;
    for (const auto& [id, hash] : hashes) values.insert(hash);
    differing += values.size() > 1;
  }
  // Step 0 starts from equal (initial) statistics; every later one differs.
  EXPECT_EQ(differing, 11) << logs();
}

// The broadcast is under the step's deadline: the generation's rank 0 stops itself before a
// step, so the others can only be waiting in the buffers' broadcast (nothing else of the step
// can run without rank 0's data). They abort the attempt after the deadline, not Gloo's longer
// timeout, skip it identically, go on at 2 with equal buffers; the woken member is fenced out.
TEST_F(FtBuffers, RankZeroStoppedBeforeTheBroadcastCostsTheDeadlineNotAHang) {
  const int deadline_ms = 1500;
  std::map<std::string, std::string> env{{"FT_STEPS", "20"}, {"FT_STEP_MS", "10"},
                                         {"FT_STOP_RANK0_BEFORE_STEP", "8"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env, deadline_ms);
  size_t stopped = 3;
  int64_t stopped_at = 0;
  ASSERT_TRUE(wait_until(
      [&] {
        for (size_t i : {0, 1, 2}) {
          if (read_file(workers_[i].out).find("stopping before step 8") != std::string::npos) {
            stopped = i;
            stopped_at = now_us();
            return true;
          }
        }
        return false;
      },
      40))
      << logs();
  std::vector<size_t> survivors;
  for (size_t i : {0, 1, 2}) {
    if (i != stopped) survivors.push_back(i);
  }
  const int64_t recovered_at =
      first_step_time(workers_[survivors[0]], [](const StepLine& s) { return s.step == 8 && s.size == 2; }, 30);
  ASSERT_GE(recovered_at, 0) << logs();
  const double ms = (recovered_at - stopped_at) / 1000.0;
  std::printf("[ measured ] rank 0 stopped before the broadcast -> step 8 committed at 2: %.0f ms (deadline %d ms)\n",
              ms, deadline_ms);
  // Not before the deadline, and well before Gloo's own timeout (2 x deadline + 5 s), which
  // bounds the broadcast when the deadline does not (seen: 8047 ms).
  EXPECT_GT(ms, deadline_ms - 300.0) << logs();
  EXPECT_LT(ms, deadline_ms + 1500.0) << logs();
  kill(workers_[stopped].pid, SIGCONT);
  wait_exit({stopped}, 20);
  EXPECT_TRUE(WIFEXITED(workers_[stopped].status) && WEXITSTATUS(workers_[stopped].status) == 3) << logs();
  wait_exit(survivors, 60);
  for (size_t i : survivors) ASSERT_EQ(workers_[i].status, 0) << logs();
  EXPECT_EQ(workers_[survivors[0]].skipped(), workers_[survivors[1]].skipped());
  EXPECT_FALSE(workers_[survivors[0]].skipped().empty()) << logs();
  expect_same_weights(survivors);
  const auto by_attempt = committed_buffers({0, 1, 2});
  EXPECT_EQ(by_attempt.size(), 20u) << logs();
  for (const auto& [attempt, hashes] : by_attempt) {
    for (const auto& [id, hash] : hashes) {
      EXPECT_EQ(hash, hashes.begin()->second) << "step " << attempt.first << " gen " << attempt.second;
    }
  }
}

}  // namespace
