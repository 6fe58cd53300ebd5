// Tests of the agent rendezvous across nodes (--rdzv-backend c10d), issue 13: several ddprun on
// one host, each a "node" with its own 127.0.0.x address, meeting in the store one of them hosts.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <deque>
#include <set>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

using ddp::testing::RdzvAgent;

class DdprunRendezvous : public ::testing::Test {
 protected:
  void SetUp() override { port_ = ddp::testing::free_port(); }
  void TearDown() override { ddp::testing::finish_agents(agents_); }

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

  // Starts one agent: --local-addr 127.0.0.<2+index>, then `flags`, then PROGRAM and its args.
  RdzvAgent& start_agent(const std::vector<std::string>& flags, const std::vector<std::string>& program,
                         bool first_hosts = true) {
    std::vector<std::string> args = {"--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint(), "--local-addr",
                                     "127.0.0." + std::to_string(2 + agents_.size())};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), program.begin(), program.end());
    agents_.emplace_back();
    agents_.back().process = ddp::testing::start_background(ddprun_argv(args), run_options({{"OMP_NUM_THREADS", "1"}}));
    // The first agent hosts the store, which makes it node 0; the others start once it does.
    if (agents_.size() == 1 && first_hosts) EXPECT_TRUE(wait_for_err(agents_.back(), "hosting the rendezvous store")) << everything();
    return agents_.back();
  }

  bool wait_for_err(const RdzvAgent& agent, const std::string& text, std::chrono::milliseconds timeout = 15s) {
    return ddp::testing::wait_for_err(agent, text, timeout);
  }

  std::string everything() { return ddp::testing::describe_agents(agents_); }

  int port_ = 0;
  std::deque<RdzvAgent> agents_;
};

// A worker in sh that prints its place in the world as a --print-env line, then runs `rest`.
std::vector<std::string> env_then(const std::string& rest) {
  return {"/bin/sh", "-c",
          "echo \"RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE GROUP_RANK=$GROUP_RANK "
          "GROUP_WORLD_SIZE=$GROUP_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT "
          "TORCHELASTIC_RESTART_COUNT=$TORCHELASTIC_RESTART_COUNT DDPRUN_ATTEMPT=$DDPRUN_ATTEMPT "
          "TORCHELASTIC_RUN_ID=$TORCHELASTIC_RUN_ID\"; " +
              rest};
}

TEST_F(DdprunRendezvous, ThreeAgentsGetNodeRanksAndAgreeOnTheWorld) {
  for (int n = 0; n < 3; ++n) {
    start_agent({"--nnodes", "3", "--nproc-per-node", "2", "--rdzv-id", "job-13"}, {probe(), "--print-env"});
  }
  std::set<std::string> group_ranks;
  std::set<int> ranks;
  std::set<std::string> masters;
  std::string master_of_node0;
  for (size_t n = 0; n < agents_.size(); ++n) {
    ProcessResult& r = agents_[n].finish();
    ASSERT_EQ(r.exit_code, 0) << everything();
    auto env = env_by_rank(r.out);
    ASSERT_EQ(env.size(), 2u) << everything();
    std::set<std::string> node_ranks_here;
    for (auto& [rank, vars] : env) {
      ranks.insert(rank);
      EXPECT_EQ(vars["RANK"], std::to_string(rank));
      EXPECT_EQ(vars["WORLD_SIZE"], "6");
      EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "3");
      EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "2");
      EXPECT_EQ(vars["ROLE_WORLD_SIZE"], "6");
      EXPECT_EQ(vars["GROUP_RANK"], std::to_string(rank / 2)) << "ranks follow node ranks";
      EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank % 2));
      EXPECT_EQ(vars["TORCHELASTIC_RUN_ID"], "job-13");
      EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
      masters.insert(vars["MASTER_ADDR"] + ":" + vars["MASTER_PORT"]);
      node_ranks_here.insert(vars["GROUP_RANK"]);
      if (vars["GROUP_RANK"] == "0") master_of_node0 = "127.0.0." + std::to_string(2 + n);
    }
    EXPECT_EQ(node_ranks_here.size(), 1u) << "one node rank per agent: " << r.describe();
    group_ranks.insert(*node_ranks_here.begin());
  }
  EXPECT_EQ(group_ranks, (std::set<std::string>{"0", "1", "2"})) << everything();
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3, 4, 5})) << everything();
  ASSERT_EQ(masters.size(), 1u) << "every worker has the same master: " << everything();
  // The master is node 0's --local-addr, on a port node 0 picked.
  EXPECT_EQ(masters.begin()->substr(0, masters.begin()->find(':')), master_of_node0) << everything();
  EXPECT_NE(agents_[0].result.err.find("hosting the rendezvous store on " + endpoint()), std::string::npos)
      << everything();
}

TEST_F(DdprunRendezvous, AWorkerFailureOnNodeOneRestartsBothNodesWithOneBudget) {
  const std::string worker =
      "if [ \"$RANK\" = 3 ]; then sleep 1; echo \"error: rank 3 broke on attempt $TORCHELASTIC_RESTART_COUNT\" >&2; "
      "exit 7; fi; exec sleep 30";
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1"}, env_then(worker));
  }
  for (RdzvAgent& agent : agents_) agent.finish();
  for (size_t n = 0; n < agents_.size(); ++n) {
    SCOPED_TRACE("agent " + std::to_string(n));
    const ProcessResult& r = agents_[n].result;
    EXPECT_FALSE(r.timed_out) << everything();
    EXPECT_EQ(r.exit_code, 1) << everything();
    // Both nodes ran both attempts: one restart for the job, not one per node.
    EXPECT_EQ(workers_per_attempt(r.out), (std::map<int, int>{{0, 2}, {1, 2}})) << everything();
    EXPECT_EQ(count_of(r.err, "job failed after 1 restart(s)"), 1u) << everything();
    EXPECT_NE(r.err.find("restart 1 of 1 after rank 3 on node 1"), std::string::npos) << everything();
    EXPECT_EQ(r.err.find("restart 2"), std::string::npos) << everything();
    // The root cause across nodes: node, rank, host, exit code, last error line.
    EXPECT_NE(r.err.find("root cause (first failure of the last attempt, across all nodes):"), std::string::npos)
        << everything();
    EXPECT_NE(r.err.find("node: 1, rank: 3 (local rank 1), host: " + hostname()), std::string::npos) << everything();
    EXPECT_NE(r.err.find("exit: exit code 7"), std::string::npos) << everything();
    EXPECT_NE(r.err.find("last error line: error: rank 3 broke on attempt 1"), std::string::npos) << everything();
  }
  // Node 0's workers were stopped because of node 1's failure, on both attempts.
  EXPECT_EQ(count_of(agents_[0].result.err, "stopping the workers on this node: rank 3 on node 1"), 2u)
      << everything();
}

TEST_F(DdprunRendezvous, ASigkilledAgentIsNamedAsLostWithinTheBoundAndNothingIsLeft) {
  TempDir pids;
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "2", "--nproc-per-node", "2"},
                {probe(), "--pid-file", pids.path(), "--sleep", "60"});
  }
  std::vector<int> workers;
  for (int rank = 0; rank < 4; ++rank) {
    workers.push_back(wait_for_pid_file(pids.file("pid." + std::to_string(rank))));
    ASSERT_GT(workers.back(), 0) << everything();
  }
  ASSERT_TRUE(wait_for_err(agents_[1], "node rank 1 of 2")) << everything();
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(agents_[1].process.pid, SIGKILL), 0);
  ProcessResult& survivor = agents_[0].finish(30s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  agents_[1].finish(5s);
  EXPECT_EQ(survivor.exit_code, 1) << everything();
  // Named, with the bound: heartbeat_timeout (5 s) + the monitor interval (0.5 s), and the
  // time to stop the workers.
  EXPECT_NE(survivor.err.find("node 1 (" + hostname() + ", 127.0.0.3) lost: its ddprun has not answered for"),
            std::string::npos)
      << everything();
  EXPECT_NE(survivor.err.find("fewer than the minimum of 2"), std::string::npos) << everything();
  EXPECT_LT(seconds, 10.0) << everything();
  std::printf("[ measured ] SIGKILLed agent: the other exited after %.2f s (heartbeat timeout 5 s)\n", seconds);
  for (int pid : workers) EXPECT_TRUE(wait_until_dead(pid)) << "worker " << pid << " survived";
}

TEST_F(DdprunRendezvous, WhenTheStoresHostIsSigkilledTheOthersStopWithinTheBound) {
  TempDir pids;
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "2", "--nproc-per-node", "2"}, {probe(), "--pid-file", pids.path(), "--sleep", "60"});
  }
  std::vector<int> workers;
  for (int rank = 0; rank < 4; ++rank) {
    workers.push_back(wait_for_pid_file(pids.file("pid." + std::to_string(rank))));
    ASSERT_GT(workers.back(), 0) << everything();
  }
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(agents_[0].process.pid, SIGKILL), 0);  // it hosts the store
  ProcessResult& survivor = agents_[1].finish(30s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  agents_[0].finish(5s);
  EXPECT_EQ(survivor.exit_code, 1) << everything();
  EXPECT_NE(survivor.err.find("lost the rendezvous store at " + endpoint()), std::string::npos) << everything();
  EXPECT_LT(seconds, 10.0) << everything();
  std::printf("[ measured ] SIGKILLed store host: the other agent exited after %.2f s\n", seconds);
  for (int pid : workers) EXPECT_TRUE(wait_until_dead(pid)) << "worker " << pid << " survived";
}

TEST_F(DdprunRendezvous, AGracefullyStoppedAgentLeavesAndTheElasticJobGoesOn) {
  const std::string worker = "if [ \"$WORLD_SIZE\" = 4 ]; then exec sleep 60; fi; exit 0";
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-conf", "last_call_timeout=10"}, env_then(worker));
  }
  ASSERT_TRUE(wait_for_err(agents_[1], "node rank 1 of 2")) << everything();
  std::this_thread::sleep_for(300ms);
  const auto stopped_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(agents_[1].process.pid, SIGTERM), 0);
  ProcessResult& survivor = agents_[0].finish(30s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped_at).count();
  ProcessResult& leaver = agents_[1].finish(5s);
  EXPECT_EQ(leaver.exit_code, 128 + SIGTERM) << everything();
  EXPECT_EQ(survivor.exit_code, 0) << everything();
  EXPECT_NE(survivor.err.find("node 1 (" + hostname() + ", 127.0.0.3) left: its ddprun was asked to stop (SIGTERM)"),
            std::string::npos)
      << everything();
  // Leaving is announced, not found out by a missed heartbeat.
  EXPECT_LT(seconds, 3.0) << everything();
}

TEST_F(DdprunRendezvous, AnElasticJobGoesOnWithoutALostNodeAtTheSmallerWorldSize) {
  // 4 ranks wait forever; the world of 2 that remains after the loss finishes at once.
  const std::string worker = "if [ \"$WORLD_SIZE\" = 4 ]; then exec sleep 60; fi; exit 0";
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-conf", "heartbeat_timeout=2,last_call_timeout=10",
                 "--monitor-interval", "0.2"},
                env_then(worker));
  }
  ASSERT_TRUE(wait_for_err(agents_[1], "node rank 1 of 2")) << everything();
  ASSERT_TRUE(wait_for_err(agents_[0], "node rank 0 of 2")) << everything();
  std::this_thread::sleep_for(300ms);
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(agents_[1].process.pid, SIGKILL), 0);
  ProcessResult& survivor = agents_[0].finish(30s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  agents_[1].finish(5s);
  ASSERT_EQ(survivor.exit_code, 0) << everything();
  std::vector<std::map<std::string, std::string>> lines = env_lines(survivor.out);
  ASSERT_EQ(lines.size(), 4u) << everything();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(lines[i]["WORLD_SIZE"], "4");
    EXPECT_EQ(lines[i]["DDPRUN_ATTEMPT"], "0");
  }
  for (int i = 2; i < 4; ++i) {
    EXPECT_EQ(lines[i]["WORLD_SIZE"], "2");
    EXPECT_EQ(lines[i]["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(lines[i]["DDPRUN_ATTEMPT"], "1");
    // A change of membership is not a restart after a failure (as in torchrun).
    EXPECT_EQ(lines[i]["TORCHELASTIC_RESTART_COUNT"], "0");
  }
  EXPECT_NE(survivor.err.find("node 1 (" + hostname() + ", 127.0.0.3) lost"), std::string::npos) << everything();
  EXPECT_NE(survivor.err.find("continuing with 1 node(s)"), std::string::npos) << everything();
  EXPECT_LT(seconds, 2 + 0.2 + 4.0) << everything();
  std::printf("[ measured ] elastic 1:2, SIGKILLed agent: the survivor finished alone %.2f s after the kill "
              "(heartbeat timeout 2 s)\n",
              seconds);
}

TEST_F(DdprunRendezvous, ANodeJoiningARunningJobEntersAtTheNextAttempt) {
  // One node's world waits; the world of two finishes.
  const std::string worker = "if [ \"$GROUP_WORLD_SIZE\" = 1 ]; then exec sleep 60; fi; exit 0";
  const std::vector<std::string> flags = {"--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-conf",
                                          "last_call_timeout=0.3"};
  start_agent(flags, env_then(worker));
  ASSERT_TRUE(wait_for_err(agents_[0], "node rank 0 of 1")) << everything();
  start_agent(flags, env_then(worker));
  for (RdzvAgent& agent : agents_) agent.finish();
  for (RdzvAgent& agent : agents_) ASSERT_EQ(agent.result.exit_code, 0) << everything();
  auto first = env_lines(agents_[0].result.out);
  ASSERT_EQ(first.size(), 4u) << everything();
  EXPECT_EQ(first[0]["WORLD_SIZE"], "2");
  EXPECT_EQ(first[2]["WORLD_SIZE"], "4");
  EXPECT_EQ(first[2]["GROUP_RANK"], "0") << "the node that was there keeps node rank 0";
  auto second = env_lines(agents_[1].result.out);
  ASSERT_EQ(second.size(), 2u) << everything();
  for (auto& vars : second) {
    EXPECT_EQ(vars["WORLD_SIZE"], "4");
    EXPECT_EQ(vars["GROUP_RANK"], "1");
    EXPECT_EQ(vars["DDPRUN_ATTEMPT"], "1");
    EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
  }
  EXPECT_NE(agents_[0].result.err.find("is waiting to join"), std::string::npos) << everything();
}

// The refusal names the newcomer's own run id only: the store's would let a stranger rejoin.
TEST_F(DdprunRendezvous, AnAgentOfAnotherRunIdIsRefusedWithoutLearningTheStoresId) {
  start_agent({"--nnodes", "2", "--rdzv-id", "run-a", "--rdzv-conf", "join_timeout=3"}, {probe()});
  ASSERT_TRUE(wait_for_err(agents_[0], "hosting the rendezvous store")) << everything();
  start_agent({"--nnodes", "2", "--rdzv-id", "run-b"}, {probe()});
  ProcessResult& intruder = agents_[1].finish();
  EXPECT_EQ(intruder.exit_code, 1) << everything();
  EXPECT_NE(intruder.err.find("refused this node (run id 'run-b'): its run id is not the store's"), std::string::npos)
      << everything();
  EXPECT_EQ(intruder.err.find("run-a"), std::string::npos) << everything();
  // The first agent waits out its join timeout for a second node and says so.
  ProcessResult& host = agents_[0].finish();
  EXPECT_EQ(host.exit_code, 1) << everything();
  EXPECT_NE(host.err.find("only 1 of the minimum 2 node(s) joined the rendezvous within the join timeout of 3 s"),
            std::string::npos)
      << everything();
  EXPECT_LT(host.seconds, 10.0) << everything();
}

TEST_F(DdprunRendezvous, AnAgentWhoseStoreNeverAppearsGivesUpAfterTheJoinTimeout) {
  // Nothing listens there and the store is not ours to host (127.0.0.1 is, so use a port
  // some other agent "hosts": a plain listening socket that never answers would hang a
  // client without deadlines).
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port_));
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  RdzvAgent& agent = start_agent({"--nnodes", "2", "--rdzv-conf", "join_timeout=2"}, {probe()}, false);
  ProcessResult& r = agent.finish();
  close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find(endpoint()), std::string::npos) << r.describe();
  EXPECT_LT(r.seconds, 2 + 6.0) << r.describe();
}

TEST(DdprunRendezvousCommandLine, WithTheStaticBackendTheEndpointIsTheMaster) {
  const int port = ddp::testing::free_port();
  ProcessResult result = ddprun({"--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port),
                                 probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto env = env_by_rank(result.out);
  EXPECT_EQ(env[0]["MASTER_ADDR"], "127.0.0.1") << result.describe();
  EXPECT_EQ(env[0]["MASTER_PORT"], std::to_string(port)) << result.describe();
  EXPECT_EQ(env[0]["DDPRUN_ATTEMPT"], "0") << result.describe();
}

TEST(DdprunRendezvousCommandLine, BadRendezvousFlagsExitWithCodeTwo) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nnodes", "3:2", "true"}, "'3:2' for --nnodes"},
      {{"--nnodes", "0:2", "true"}, "'0:2' for --nnodes"},
      {{"--nnodes", "1:x", "true"}, "'1:x' for --nnodes"},
      {{"--nnodes", "1:2", "true"}, "needs --rdzv-backend c10d"},
      {{"--rdzv-backend", "etcd", "true"}, "'etcd' for --rdzv-backend"},
      {{"--rdzv-backend", "c10d", "true"}, "needs --rdzv-endpoint"},
      {{"--rdzv-endpoint", "host:99999", "true"}, "'host:99999' for --rdzv-endpoint"},
      {{"--rdzv-conf", "bogus=1", "true"}, "unknown key 'bogus'"},
      {{"--rdzv-conf", "join_timeout=soon", "true"}, "'soon' for --rdzv-conf join_timeout"},
      {{"--monitor-interval", "0", "true"}, "'0' for --monitor-interval"},
      {{"--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1", "--standalone", "true"}, "--standalone"},
  };
  for (const auto& [args, expected] : cases) {
    ProcessResult result = ddprun(args);
    SCOPED_TRACE(expected);
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find(expected), std::string::npos) << result.describe();
    EXPECT_EQ(lines_of(result.err).size(), 1u) << result.describe();
  }
}

TEST(DdprunRendezvousCommandLine, HelpListsTheRendezvousFlagsWithTheirDefaults) {
  ProcessResult result = ddprun({"--help"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  const std::string& help = result.out;
  for (const auto& [name, default_text] : std::vector<std::pair<std::string, std::string>>{
           {"--rdzv-backend", "(default: static)"},
           {"--rdzv-endpoint", "(default: none; port 29400"},
           {"--rdzv-conf", "(default: 600)"},
           {"--local-addr", "(default: none"},
           {"--monitor-interval", "(default: 0.5)"}}) {
    const size_t at = help.find("  " + name + " ");
    ASSERT_NE(at, std::string::npos) << name << " missing from\n" << help;
    EXPECT_LT(help.find(default_text, at), help.find("\n  -", at + 1)) << name << " lacks " << default_text;
  }
  for (const std::string text : {"last_call_timeout", "heartbeat_timeout", "MIN:MAX", "SIGUSR1", "(default: 30)",
                                 "(default: 5)"}) {
    EXPECT_NE(help.find(text), std::string::npos) << text << " missing from\n" << help;
  }
}

}  // namespace
