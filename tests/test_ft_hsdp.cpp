// Fault-tolerant HSDP (include/ddp/fault_tolerant_hsdp.h, issue 36): replica
// groups of 2 processes shard a model with FSDP; the groups replicate each
// other through one fault-tolerant quorum per shard index. The jobs run under
// ddprun --fault-tolerance --ft-replica-size 2, with this binary as the
// worker: started with FT_HSDP_WORKER set, it trains instead of running the
// tests (worker_main below), so each test's assertions and the ranks' code
// sit in this one file.

#include <ddp/ddp.h>
#include <ddp/fault_tolerant_hsdp.h>

#include "support/ddprun_fixtures.h"
#include "launch/test_seams.h"
#include "support/ft_worker_common.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <map>
#include <numeric>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using ddp::testing::env_int;
using ddprun_tests::count_of;
using ddprun_tests::ddprun;
using ddprun_tests::TempDir;

std::string env_text(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---- the worker ---------------------------------------------------------------
// FT_HSDP_MODE "ft" (FaultTolerantHSDP, under ddprun --fault-tolerance) or
// "plain" (HSDP on a 2 x 2 mesh, under plain ddprun: the reference);
// FT_HSDP_STEPS committed steps; FT_HSDP_OUT a directory for the final
// weights; FT_HSDP_DIE_LOCAL_RANK / FT_HSDP_DIE_AT_STEP: that worker's first
// incarnation SIGKILLs itself after that step's forward (FT_HSDP_DIE_WHERE
// "stopped": SIGSTOPs itself there; "before_vote": SIGKILLs itself between
// its group's agreement on joiners and its quorum's vote).

torch::nn::Sequential make_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                               torch::nn::ReLU(), torch::nn::Linear(32, 4));
}

struct Data {
  at::Tensor x, y;
};

Data make_data() {
  torch::manual_seed(11);
  return {torch::randn({256, 16}), torch::randint(0, 4, {256}, at::kLong)};
}

void save_final(ddp::FullyShardedDataParallel<torch::nn::Sequential>& model, bool writer, uint64_t* hash) {
  const ddp::StateDict full = model.full_state_dict(/*rank0_only=*/false);
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : full) tensors.push_back(tensor);
  *hash = ddp::testing::hash_of(tensors);
  if (writer && !env_text("FT_HSDP_OUT").empty()) torch::save(tensors, env_text("FT_HSDP_OUT") + "/final.pt");
}

int train_fault_tolerant(const Data& data, int64_t steps) {
  ddp::FaultTolerantHSDP ft;
  ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_net(), ft.shard_group(),
                                                              ft.fsdp_options(ddp::FSDPOptions().min_num_params(1)));
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
  ddp::FaultTolerantSampler sampler(data.x.size(0), 4, /*seed=*/3);
  ft.manage(model, &optimizer, &sampler);
  const bool first_incarnation = env_text("DDP_FT_REPLICA_ID").find("/inc0") != std::string::npos;
  const bool dies = first_incarnation && env_int("LOCAL_RANK", -1) == env_int("FT_HSDP_DIE_LOCAL_RANK", -1);
  const int64_t die_at = env_int("FT_HSDP_DIE_AT_STEP", -1);
  const bool dies_before_vote = env_text("FT_HSDP_DIE_WHERE") == "before_vote";
  if (dies && dies_before_vote) {
    ddp::detail::test_seams().ft_hsdp_before_vote = [&ft, die_at] {
      if (ft.quorum().step() == die_at) ::raise(SIGKILL);
    };
  }
  // A restarted process of this local rank comes to its first step late, so
  // its group's other process asks to join well before it.
  if (!first_incarnation && env_int("LOCAL_RANK", -1) == env_int("FT_HSDP_LATE_JOINER", -1)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  const int64_t step_ms = env_int("FT_HSDP_STEP_MS", 20);
  // With FT_HSDP_END_WITH_REPLICAS, training goes on past FT_HSDP_STEPS until
  // a step commits with that many groups (a restarted group is back): every
  // process sees the same count at a commit, so all stop at the same step.
  const int end_with = env_int("FT_HSDP_END_WITH_REPLICAS", 0);
  int replicas_at_last_commit = 0;
  while (ft.quorum().step() < steps || replicas_at_last_commit < end_with) {
    ft.start_step();
    std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    at::Tensor index = torch::tensor(sampler.batch(ft.data_rank(), ft.data_size()), at::kLong);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model.forward(data.x.index_select(0, index)),
                                                     data.y.index_select(0, index));
    if (dies && !dies_before_vote && ft.quorum().step() == die_at) {
      std::fflush(stdout);
      ::raise(env_text("FT_HSDP_DIE_WHERE") == "stopped" ? SIGSTOP : SIGKILL);
    }
    loss.backward();
    if (ft.should_commit()) {
      optimizer.step();
      replicas_at_last_commit = ft.replicas();
      std::printf("hsdp step %lld replica %d/%d shard %d id %s t %lld\n",
                  static_cast<long long>(ft.quorum().step() - 1), ft.replica_rank(), ft.replicas(), ft.shard_index(),
                  ft.quorum().replica_id().c_str(), static_cast<long long>(now_ms()));
    } else {
      std::printf("hsdp skipped at step %lld id %s\n", static_cast<long long>(ft.quorum().step()),
                  ft.quorum().replica_id().c_str());
    }
    std::fflush(stdout);
  }
  uint64_t hash = 0;
  save_final(model, ft.data_rank() == 0, &hash);
  std::printf("hsdp final %016llx heal_bytes_received %lld\n", static_cast<unsigned long long>(hash),
              static_cast<long long>(ft.quorum().stats().heal_bytes_received));
  std::fflush(stdout);
  return 0;
}

int train_plain(const Data& data, int64_t steps) {
  auto group = ddp::init_process_group();
  ddp::DeviceMesh mesh(group, {2, 2}, {"replicate", "shard"});
  ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_net(), mesh, ddp::FSDPOptions().min_num_params(1));
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
  ddp::FaultTolerantSampler sampler(data.x.size(0), 4, /*seed=*/3);
  for (int64_t step = 0; step < steps; ++step) {
    at::Tensor index = torch::tensor(sampler.batch(group->rank(), group->size()), at::kLong);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model.forward(data.x.index_select(0, index)), data.y.index_select(0, index))
        .backward();
    optimizer.step();
    sampler.advance(group->size());
  }
  uint64_t hash = 0;
  save_final(model, group->rank() == 0, &hash);
  std::printf("hsdp final %016llx\n", static_cast<unsigned long long>(hash));
  return 0;
}

int worker_main() {
  try {
    const Data data = make_data();
    const int64_t steps = env_int("FT_HSDP_STEPS", 20);
    return env_text("FT_HSDP_MODE") == "plain" ? train_plain(data, steps) : train_fault_tolerant(data, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ft_hsdp worker: %s\n", e.what());
    return 1;
  }
}

// Before gtest's main: a worker never runs the tests.
[[maybe_unused]] const bool kRanAsWorker = [] {
  if (std::getenv("FT_HSDP_WORKER") != nullptr) std::exit(worker_main());
  return false;
}();

// ---- the tests ----------------------------------------------------------------

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

ddp::testing::RunOptions job_options(const std::string& mode, const std::string& out,
                                     std::vector<std::pair<std::string, std::string>> more = {}) {
  ddp::testing::RunOptions options;
  options.env = {{"FT_HSDP_WORKER", "1"}, {"FT_HSDP_MODE", mode}, {"FT_HSDP_OUT", out}, {"OMP_NUM_THREADS", "1"}};
  options.env.insert(options.env.end(), more.begin(), more.end());
  options.timeout = 90s;
  return options;
}

at::Tensor final_weights(const std::string& dir) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, dir + "/final.pt");
  std::vector<at::Tensor> flat;
  for (auto& t : tensors) flat.push_back(t.flatten());
  return at::cat(flat);
}

struct Commit {
  int64_t step;
  std::string rank_label;  // "[rankN]"
  std::string id;
  int64_t t_ms;
};

std::vector<Commit> commits_of(const std::string& out) {
  static const std::regex kLine(R"(\[rank(\d+)\]: hsdp step (\d+) replica \d+/\d+ shard \d+ id (\S+) t (\d+))");
  std::vector<Commit> commits;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), kLine); it != std::sregex_iterator(); ++it) {
    commits.push_back({std::stoll((*it)[2]), (*it)[1].str(), (*it)[3].str(), std::stoll((*it)[4])});
  }
  return commits;
}

std::set<std::string> final_hashes(const std::string& out) {
  static const std::regex kFinal(R"(hsdp final ([0-9a-f]+))");
  std::set<std::string> hashes;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), kFinal); it != std::sregex_iterator(); ++it) {
    hashes.insert((*it)[1].str());
  }
  return hashes;
}

TEST(FaultTolerantHsdp, WithoutFaultsTrainsAsHsdpOnATwoByTwoMesh) {
  TempDir plain_out, ft_out;
  auto plain = ddprun({"--standalone", "--nproc-per-node", "4", self_exe()}, job_options("plain", plain_out.path()));
  ASSERT_EQ(plain.exit_code, 0) << plain.describe();
  auto ft = ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "4", "--ft-replica-size", "2",
                    self_exe()},
                   job_options("ft", ft_out.path(), {{"FT_HSDP_STEP_MS", "0"}}));
  ASSERT_EQ(ft.exit_code, 0) << ft.describe();
  // 20 steps committed by each of the 4 processes, none skipped; 2 replicas of 2 shards.
  EXPECT_EQ(commits_of(ft.out).size(), 80u) << ft.describe();
  EXPECT_EQ(count_of(ft.out, "hsdp skipped"), 0u) << ft.describe();
  EXPECT_EQ(count_of(ft.out, "replica 0/2 shard 0"), 20u) << ft.describe();
  EXPECT_EQ(count_of(ft.out, "replica 1/2 shard 1"), 20u) << ft.describe();
  // Every process of both jobs ends with the same full weights as the others of its job...
  EXPECT_EQ(final_hashes(ft.out).size(), 1u) << ft.describe();
  EXPECT_EQ(final_hashes(plain.out).size(), 1u) << plain.describe();
  // ...and the two jobs' weights agree: the quorums' averaging is HSDP's.
  const at::Tensor expected = final_weights(plain_out.path());
  const at::Tensor actual = final_weights(ft_out.path());
  ASSERT_EQ(expected.sizes(), actual.sizes());
  EXPECT_TRUE(at::allclose(actual, expected, /*rtol=*/1e-5, /*atol=*/1e-6))
      << "largest difference " << (actual - expected).abs().max().item<double>();
}

// Local rank 3 (shard 1 of the second group, "/2/") dies at step 8 where
// `where` says; ddprun restarts local ranks 2 and 3 together, the restarted
// rank 3 coming to its first step 500 ms after rank 2; the first group
// ("/0/", local ranks 0 and 1) trains on. What every such run must show.
void expect_the_group_drops_out_and_heals_back_in(const std::string& where, int64_t max_gap_ms = 1500) {
  TempDir out;
  auto job = ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "4", "--ft-replica-size", "2",
                     "--max-restarts", "2", "--ft-deadline", "2", self_exe()},
                    job_options("ft", out.path(),
                                {{"FT_HSDP_STEPS", "40"}, {"FT_HSDP_END_WITH_REPLICAS", "2"},
                                 {"FT_HSDP_DIE_LOCAL_RANK", "3"}, {"FT_HSDP_DIE_AT_STEP", "8"},
                                 {"FT_HSDP_DIE_WHERE", where}, {"FT_HSDP_LATE_JOINER", "3"}}));
  ASSERT_EQ(job.exit_code, 0) << job.describe();
  EXPECT_NE(job.err.find("restarting its replica group (local ranks 2-3)"), std::string::npos) << job.describe();
  const std::vector<Commit> commits = commits_of(job.out);
  // The first group's two processes committed every step (40 and more,
  // until the restarted group was back), and dropped the same attempt: the
  // one the lost process was in, and no other (the restarted group entered
  // both quorums at the same commit).
  std::map<std::string, std::vector<int64_t>> steps_of;
  for (const Commit& c : commits) steps_of[c.rank_label].push_back(c.step);
  const int64_t last = steps_of["0"].empty() ? -1 : steps_of["0"].back();
  EXPECT_GE(last, 39) << job.describe();
  for (const std::string rank : {"0", "1"}) {
    std::vector<int64_t> every(static_cast<size_t>(last + 1));
    std::iota(every.begin(), every.end(), 0);
    EXPECT_EQ(steps_of[rank], every) << "rank " << rank << "\n" << job.describe();
    EXPECT_EQ(count_of(job.out, "[rank" + rank + "]: hsdp skipped at step 8 id"), 1u) << job.describe();
    EXPECT_EQ(count_of(job.out, "[rank" + rank + "]: hsdp skipped"), 1u) << job.describe();
  }
  // The second group's new incarnation committed the job's last step with
  // the others, both of its processes healed from the first group's, each
  // its own shard, and all four processes end with the same full weights.
  bool rejoined = false;
  for (const Commit& c : commits) rejoined = rejoined || (c.id.find("/2/inc1") != std::string::npos && c.step == last);
  EXPECT_TRUE(rejoined) << job.describe();
  const std::regex kHealed(R"(replica \S+/2/inc1 joined at step \d+, healed from \S+/0/inc0 \((\d+) bytes\))");
  EXPECT_EQ(std::distance(std::sregex_iterator(job.err.begin(), job.err.end(), kHealed), std::sregex_iterator()), 2)
      << job.describe();
  EXPECT_EQ(final_hashes(job.out).size(), 1u) << job.describe();
  EXPECT_EQ(count_of(job.out, "hsdp final"), 4u) << job.describe();
  // The survivors' commit of step 8 came within max_gap_ms of step 7's.
  int64_t before = 0, after = 0;
  for (const Commit& c : commits) {
    if (c.rank_label != "0") continue;
    if (c.step == 7) before = c.t_ms;
    if (c.step == 8) after = c.t_ms;
  }
  ASSERT_GT(before, 0);
  ASSERT_GT(after, 0);
  EXPECT_LT(after - before, max_gap_ms) << job.describe();
}

TEST(FaultTolerantHsdp, AProcessLostMidStepTakesItsReplicaGroupOutWhichComesBackAndHeals) {
  expect_the_group_drops_out_and_heals_back_in("after_forward");
}

// A hung process (SIGSTOP): its sibling's shard group names it stopped (or
// gives up at the 2 s deadline) and leaves, ddprun kills the whole group,
// the stopped process too, and starts it again; the first group's first
// commit after it comes within the deadline and a second.
TEST(FaultTolerantHsdp, AHungProcessTakesItsReplicaGroupOutWithinTheDeadline) {
  expect_the_group_drops_out_and_heals_back_in("stopped", 3000);
}

// Between its group's two quorums' votes: the quorum of shard 0 commits the
// step (both its members voted), shard 1's skips it; every process must drop it.
TEST(FaultTolerantHsdp, AProcessLostBetweenItsGroupsTwoVotesCostsEveryProcessTheSameStep) {
  expect_the_group_drops_out_and_heals_back_in("before_vote");
}

}  // namespace
