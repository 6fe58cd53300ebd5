// ddprun --rdzv-backend etcd-v2: the agents meet in a real 3-member etcd cluster
// (support/etcd_cluster.h) that no ddprun hosts. Two agents form one round; MIN:MAX closes after
// the last call; a failure on one node stops the other's workers; the rendezvous survives an
// etcd member's death; and under --fault-tolerance the workers' store lives in the same cluster,
// so that losing the node that would have hosted a c10d store, and an etcd member, leaves the
// job running. Each test skips without /usr/bin/etcd.
#include <signal.h>

#include <fstream>
#include <regex>

#include "common/etcd_v2_client.h"
#include "support/ddprun_fixtures.h"
#include "support/etcd_cluster.h"
#include "support/ft_jobs.h"

namespace {

using namespace ddprun_tests;
using ddp::testing::EtcdCluster;
using ddp::testing::RdzvAgent;

#define SKIP_WITHOUT_ETCD()                                                                            \
  if (!ddp::testing::etcd_available()) GTEST_SKIP() << "no /usr/bin/etcd or /usr/bin/setpriv (apt-get install etcd-server util-linux)"

const std::string kPrintPlace =
    "echo \"RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE GROUP_RANK=$GROUP_RANK "
    "GROUP_WORLD_SIZE=$GROUP_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT "
    "STORE=${DDP_FT_STORE:-unset}\"";

class EtcdRendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ddp::testing::etcd_available()) return;
    cluster_ = std::make_unique<EtcdCluster>();
    const std::string problem = cluster_->wait_until_ready();
    ASSERT_EQ(problem, "");
  }
  void TearDown() override { ddp::testing::finish_agents(agents_); }

  RdzvAgent& start_agent(const std::string& endpoints, const std::vector<std::string>& flags,
                         const std::vector<std::string>& program) {
    std::vector<std::string> args = {"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", endpoints, "--rdzv-id", run_id_,
                                     "--monitor-interval", "0.1"};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), program.begin(), program.end());
    agents_.emplace_back();
    RunOptions options = run_options({{"OMP_NUM_THREADS", "1"}});
    options.timeout = 60s;
    agents_.back().process = ddp::testing::start_background(ddprun_argv(args), options);
    return agents_.back();
  }
  std::string everything() { return ddp::testing::describe_agents(agents_) + cluster_->logs(); }

  std::unique_ptr<EtcdCluster> cluster_;
  std::string run_id_ = "job-" + std::to_string(::getpid()) + "-" +
                        ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::deque<RdzvAgent> agents_;
};

TEST_F(EtcdRendezvousTest, TwoAgentsFormOneRoundAndLeaveNoKeysBehind) {
  SKIP_WITHOUT_ETCD();
  for (int i = 0; i < 2; ++i) {
    start_agent(cluster_->endpoint_list(), {"--nnodes", "2", "--nproc-per-node", "2"},
                {"/bin/sh", "-c", kPrintPlace});
  }
  std::map<int, std::map<std::string, std::string>> ranks;
  for (RdzvAgent& agent : agents_) {
    ProcessResult& result = agent.finish(30s);
    ASSERT_EQ(result.exit_code, 0) << everything();
    for (auto& [rank, vars] : env_by_rank(result.out)) ranks[rank] = vars;
  }
  ASSERT_EQ(ranks.size(), 4u) << everything();
  std::set<std::string> group_ranks;
  for (auto& [rank, vars] : ranks) {
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["WORLD_SIZE"], "4");
    EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["MASTER_ADDR"], ranks[0]["MASTER_ADDR"]);
    EXPECT_EQ(vars["MASTER_PORT"], ranks[0]["MASTER_PORT"]);
    EXPECT_EQ(vars["STORE"], "unset");
    group_ranks.insert(vars["GROUP_RANK"]);
  }
  EXPECT_EQ(group_ranks, (std::set<std::string>{"0", "1"}));
  EXPECT_NE(agents_[0].result.err.find("etcd-v2 rendezvous: node rank"), std::string::npos) << everything();
  // Node 0 tidied the job's keys away once both had ended.
  ddp::detail::EtcdV2Client client(cluster_->endpoints(), 5s);
  EXPECT_EQ(client.get("/ddprun/" + run_id_).error_code, ddp::detail::kEtcdKeyNotFound) << everything();
}

TEST_F(EtcdRendezvousTest, MinMaxClosesAfterTheLastCall) {
  SKIP_WITHOUT_ETCD();
  RdzvAgent& agent = start_agent(cluster_->endpoint_list(),
                                 {"--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-conf", "last_call_timeout=1"},
                                 {"/bin/sh", "-c", kPrintPlace});
  ProcessResult& result = agent.finish(30s);
  ASSERT_EQ(result.exit_code, 0) << everything();
  EXPECT_NE(result.out.find("WORLD_SIZE=1 GROUP_RANK=0 GROUP_WORLD_SIZE=1"), std::string::npos) << everything();
  EXPECT_GE(result.seconds, 0.9) << "the round closed before the last call";
}

TEST_F(EtcdRendezvousTest, AFailureOnOneNodeStopsTheOthersWorkers) {
  SKIP_WITHOUT_ETCD();
  TempDir dir;
  // The second agent's worker fails once both started; the first one's must be stopped.
  start_agent(cluster_->endpoint_list(), {"--nnodes", "2", "--nproc-per-node", "1"},
              {"/bin/sh", "-c", "touch " + dir.file("started.$RANK") + "; sleep 60"});
  ASSERT_TRUE(ddp::testing::wait_for_err(agents_[0], "joining the etcd-v2 rendezvous", 20s)) << everything();
  start_agent(cluster_->endpoint_list(), {"--nnodes", "2", "--nproc-per-node", "1"},
              {"/bin/sh", "-c",
               "touch " + dir.file("started.$RANK") + "; while [ ! -e " + dir.file("started.0") + " ] || [ ! -e " +
                   dir.file("started.1") + " ]; do sleep 0.05; done; exit 3"});
  ProcessResult& failing = agents_[1].finish(30s);
  ProcessResult& stopped = agents_[0].finish(30s);
  EXPECT_EQ(failing.exit_code, 1) << everything();
  EXPECT_NE(failing.err.find("root cause"), std::string::npos) << everything();
  EXPECT_EQ(stopped.exit_code, 1) << everything();
  static const std::regex kStopped(
      R"(stopping the workers on this node: another node failed: rank (\d) on node \1 \([^,]+, pid \d+\): exit code 3)");
  EXPECT_TRUE(std::regex_search(stopped.err, kStopped))
      << everything();
  EXPECT_LT(stopped.seconds, 20.0) << "node 0's worker sleeps 60 s: it must have been stopped";
}

TEST_F(EtcdRendezvousTest, FormsAfterTheMemberTheFirstAgentUsedDies) {
  SKIP_WITHOUT_ETCD();
  // The first agent talks to member 0 first; it dies before the second agent joins.
  start_agent(cluster_->endpoint_list(), {"--nnodes", "2", "--nproc-per-node", "1"}, {"/bin/sh", "-c", kPrintPlace});
  ASSERT_TRUE(ddp::testing::wait_for_err(agents_[0], "joining the etcd-v2 rendezvous", 20s)) << everything();
  std::this_thread::sleep_for(500ms);
  cluster_->kill(0);
  start_agent(cluster_->endpoint_list(), {"--nnodes", "2", "--nproc-per-node", "1"}, {"/bin/sh", "-c", kPrintPlace});
  for (RdzvAgent& agent : agents_) EXPECT_EQ(agent.finish(40s).exit_code, 0) << everything();
  EXPECT_NE(agents_[0].result.out.find("WORLD_SIZE=2"), std::string::npos) << everything();
  EXPECT_NE(agents_[1].result.out.find("WORLD_SIZE=2"), std::string::npos) << everything();
}

TEST_F(EtcdRendezvousTest, FaultTolerantJobSurvivesLosingNodeZeroAndAnEtcdMember) {
  SKIP_WITHOUT_ETCD();
  TempDir dir;
  const std::vector<std::string> worker = {bin_path("ft_store_worker"), "--dir", dir.path()};
  // Node 0 would have hosted the c10d store (rank 0's); here nothing does.
  for (int i = 0; i < 2; ++i) {
    start_agent(cluster_->endpoint_list(), {"--nnodes", "2", "--nproc-per-node", "1", "--fault-tolerance"}, worker);
  }
  const int rank0 = wait_for_pid_file(dir.file("pid.0.0"), 30s);
  const int rank1 = wait_for_pid_file(dir.file("pid.1.0"), 30s);
  ASSERT_GT(rank0, 0) << everything();
  ASSERT_GT(rank1, 0) << everything();
  // Node ranks follow the order of joining: find node 0.
  const size_t node0 = agents_[0].err_so_far().find("node rank 0 of 2") != std::string::npos ? 0 : 1;
  ASSERT_NE(agents_[node0].err_so_far().find("node rank 0 of 2"), std::string::npos) << everything();
  ASSERT_EQ(::kill(agents_[node0].process.pid, SIGKILL), 0);  // the whole of node 0
  EXPECT_TRUE(wait_until_dead(rank0, 10s));
  cluster_->kill(0);
  std::ofstream(dir.file("finish")) << "\n";
  ProcessResult& result = agents_[1 - node0].finish(30s);
  EXPECT_EQ(result.exit_code, 0) << everything();
  // Rank 1 reached the store in etcd after both losses: it counts both joins.
  EXPECT_NE(result.out.find("rank 1 replica node1-"), std::string::npos) << everything();
  EXPECT_NE(result.out.find("sees joined=2"), std::string::npos) << everything();
  static const std::regex kStore(R"(DDP_FT_STORE=etcd://([^ ]+)/ddp-ft/)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.out, match, kStore)) << everything();
  EXPECT_EQ(match[1], cluster_->endpoint_list());
}

TEST_F(EtcdRendezvousTest, DdpWorkersTrainOnAfterLosingNodeZeroAndAnEtcdMember) {
  // The store-host loss of issue 36: three nodes of ddp's fault-tolerant training
  // (tests/workers/ft_worker.cpp) under --fault-tolerance --rdzv-backend etcd-v2; node 0 (whose
  // rank 0 would host a c10d store) dies whole, and so does an etcd member; the others finish.
  SKIP_WITHOUT_ETCD();
  if (!std::filesystem::exists(bin_path("ft_worker"))) GTEST_SKIP() << "ft_worker was not built";
  for (int i = 0; i < 3; ++i) {
    agents_.emplace_back();
    RunOptions options = run_options({{"OMP_NUM_THREADS", "1"}, {"FT_STEPS", "120"}, {"FT_STEP_MS", "20"}});
    options.timeout = 150s;
    agents_.back().process = ddp::testing::start_background(
        ddprun_argv({"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", cluster_->endpoint_list(), "--rdzv-id", run_id_,
                     "--nnodes", "3", "--nproc-per-node", "1", "--fault-tolerance", bin_path("ft_worker")}),
        options);
  }
  auto steps_so_far = [&] {
    long long least = 1LL << 40;
    for (RdzvAgent& agent : agents_) {
      least = std::min(least, ddp::testing::last_step_in(ddp::testing::read_text_file(agent.process.out_path)));
    }
    return least;
  };
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (steps_so_far() < 10 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  ASSERT_GE(steps_so_far(), 10) << everything();
  size_t node0 = 0;
  while (node0 < agents_.size() && agents_[node0].err_so_far().find("node rank 0 of 3") == std::string::npos) ++node0;
  ASSERT_LT(node0, agents_.size()) << everything();
  const int rank0 = ddp::testing::child_with_rank(agents_[node0].process.pid, "ft_worker", 0);
  ASSERT_GT(rank0, 0) << everything();
  const long long killed_at_us = std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
  ASSERT_EQ(::kill(agents_[node0].process.pid, SIGKILL), 0);
  EXPECT_TRUE(wait_until_dead(rank0, 10s));
  cluster_->kill(0);
  std::vector<std::string> finals;
  long long first_commit = -1;
  for (size_t i = 0; i < agents_.size(); ++i) {
    if (i == node0) continue;
    ProcessResult& result = agents_[i].finish(150s);
    EXPECT_EQ(result.exit_code, 0) << everything();
    for (const auto& [rank, hashes] : ddp::testing::finals_by_rank(result.out)) {
      finals.insert(finals.end(), hashes.begin(), hashes.end());
      const long long t = ddp::testing::first_step_after(result.out, rank, killed_at_us);
      if (t > 0 && (first_commit < 0 || t < first_commit)) first_commit = t;
    }
  }
  if (first_commit > 0) {
    std::printf("[measure] etcd-v2: the survivors' first commit %.0f ms after node 0's ddprun was SIGKILLed (an etcd "
                "member killed right after)\n",
                (first_commit - killed_at_us) / 1000.0);
  }
  EXPECT_GT(first_commit, 0) << "no survivor committed a step after the losses: " << everything();
  ASSERT_EQ(finals.size(), 2u) << everything();
  EXPECT_EQ(finals[0], finals[1]) << everything();
}

TEST_F(EtcdRendezvousTest, ALostNodeStartedAgainRejoinsAndHealsFromALivePeer) {
  // Under --fault-tolerance a node that comes back after the round formed joins the running
  // job: its worker becomes a replica again, healed from the survivor, and both end alike.
  SKIP_WITHOUT_ETCD();
  if (!std::filesystem::exists(bin_path("ft_worker"))) GTEST_SKIP() << "ft_worker was not built";
  auto start = [&] {
    agents_.emplace_back();
    RunOptions options = run_options({{"OMP_NUM_THREADS", "1"}, {"FT_STEPS", "150"}, {"FT_STEP_MS", "20"}});
    options.timeout = 150s;
    agents_.back().process = ddp::testing::start_background(
        ddprun_argv({"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", cluster_->endpoint_list(), "--rdzv-id", run_id_,
                     "--nnodes", "2", "--nproc-per-node", "1", "--fault-tolerance", bin_path("ft_worker")}),
        options);
  };
  start();
  start();
  auto step_of = [&](size_t i) {
    return ddp::testing::last_step_in(ddp::testing::read_text_file(agents_[i].process.out_path));
  };
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while ((step_of(0) < 10 || step_of(1) < 10) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_GE(std::min(step_of(0), step_of(1)), 10) << everything();
  // Node 1 goes whole, and comes back as a fresh ddprun.
  const size_t node1 = agents_[0].err_so_far().find("node rank 1 of 2") != std::string::npos ? 0 : 1;
  ASSERT_EQ(::kill(agents_[node1].process.pid, SIGKILL), 0);
  agents_[node1].finish(10s);
  start();
  ProcessResult& returned = agents_.back().finish(120s);
  ProcessResult& survivor = agents_[1 - node1].finish(60s);
  EXPECT_EQ(returned.exit_code, 0) << everything();
  EXPECT_EQ(survivor.exit_code, 0) << everything();
  EXPECT_NE(returned.err.find("joining the running job as node 2"), std::string::npos) << everything();
  const auto returned_finals = ddp::testing::finals_by_rank(returned.out);
  const auto survivor_finals = ddp::testing::finals_by_rank(survivor.out);
  ASSERT_EQ(returned_finals.size(), 1u) << everything();
  ASSERT_EQ(survivor_finals.size(), 1u) << everything();
  EXPECT_EQ(returned_finals.begin()->second, survivor_finals.begin()->second) << everything();
}

}  // namespace
