// ddprun --fault-tolerance: a failed worker is restarted alone, with a new replica id, while its
// siblings keep running (same pids); --max-restarts bounds it; the store keeper serves a real
// c10d store that outlives any worker; PET_FAULT_TOLERANCE turns it on; without it restart mode
// is what it was; under the c10d rendezvous the loss of a whole node leaves the others running.
#include <signal.h>

#include <fstream>
#include <regex>

#include "support/ddprun_fixtures.h"
#include "support/ft_jobs.h"

namespace {

using namespace ddprun_tests;
using ddp::testing::RdzvAgent;

std::string worker() { return bin_path("ft_store_worker"); }

// The "ft-env KEY=VALUE ..." lines the worker prints, in order.
std::vector<std::map<std::string, std::string>> ft_env_lines(const std::string& out) {
  std::vector<std::map<std::string, std::string>> result;
  for (const std::string& line : lines_of(out)) {
    const size_t at = line.find("ft-env ");
    if (at == std::string::npos) continue;
    auto& variables = result.emplace_back();
    std::istringstream words(line.substr(at + 7));
    for (std::string word; words >> word;) {
      const size_t equals = word.find('=');
      variables[word.substr(0, equals)] = word.substr(equals + 1);
    }
  }
  return result;
}

void touch(const std::string& path) { std::ofstream(path) << "\n"; }

// The pid of ddp_ft_store as ddprun announced it, or -1.
int keeper_pid(const std::string& err) {
  std::smatch match;
  static const std::regex kKeeper(R"(ddp_ft_store, pid (\d+)\))");
  return std::regex_search(err, match, kKeeper) ? std::stoi(match[1]) : -1;
}

RunOptions background_options(EnvAssignments env = {}) {
  RunOptions options = run_options(std::move(env));
  options.timeout = 60s;
  return options;
}

TEST(FaultTolerance, KilledWorkerIsRestartedAloneWhileItsSiblingsKeepTheirPids) {
  TempDir dir;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--fault-tolerance", "--nproc-per-node", "3", "--max-restarts", "2", worker(),
                   "--dir", dir.path()}),
      background_options());
  const int rank0 = wait_for_pid_file(dir.file("pid.0.0"), 30s);
  const int rank1 = wait_for_pid_file(dir.file("pid.1.0"), 30s);
  const int rank2 = wait_for_pid_file(dir.file("pid.2.0"), 30s);
  ASSERT_GT(rank0, 0);
  ASSERT_GT(rank1, 0);
  ASSERT_GT(rank2, 0);
  ASSERT_EQ(::kill(rank1, SIGKILL), 0);
  const int rank1_again = wait_for_pid_file(dir.file("pid.1.1"), 30s);
  EXPECT_GT(rank1_again, 0) << "rank 1 was not restarted";
  EXPECT_NE(rank1_again, rank1);
  // Nobody else was touched.
  EXPECT_TRUE(ddp::testing::process_alive(rank0));
  EXPECT_TRUE(ddp::testing::process_alive(rank2));
  touch(dir.file("finish"));
  ProcessResult result = ddp::testing::wait_background(job, 30s);
  ASSERT_EQ(result.exit_code, 0) << result.describe();

  // One line says who failed, how, and what took its place.
  static const std::regex kLine(
      R"(ddprun: fault tolerance: rank 1 \(local rank 1, pid (\d+), replica (node0-[0-9a-f]{8})/1/inc0\) failed: )"
      R"(killed by signal 9 \(SIGKILL\); restarting it alone as replica (node0-[0-9a-f]{8})/1/inc1 \(restart 1 of 2\); )"
      R"(2 other worker\(s\) of this node go on)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.err, match, kLine)) << result.describe();
  EXPECT_EQ(std::stoi(match[1]), rank1);
  EXPECT_EQ(match[2], match[3]);
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 1u) << result.describe();
  EXPECT_EQ(result.err.find("stopped rank"), std::string::npos) << "nobody may be stopped: " << result.describe();

  // Four incarnations joined one store, which outlived the one that was killed.
  const auto env = ft_env_lines(result.out);
  ASSERT_EQ(env.size(), 4u) << result.describe();
  for (const auto& vars : env) {
    EXPECT_EQ(vars.at("DDP_FAULT_TOLERANCE"), "1");
    EXPECT_EQ(vars.at("DDP_FT_INITIAL_REPLICAS"), "3");
    EXPECT_EQ(vars.at("DDP_FT_DEADLINE_MS"), "5000");
    EXPECT_EQ(vars.at("DDP_FT_STORE"), env[0].at("DDP_FT_STORE"));
  }
  EXPECT_EQ(env.back().at("RANK"), "1");
  EXPECT_EQ(env.back().at("DDP_FT_REPLICA_ID"), std::string(match[3]) + "/1/inc1");
  EXPECT_TRUE(std::regex_match(env[0].at("DDP_FT_STORE"), std::regex(R"(tcp://127\.0\.0\.1:\d+)")));
  EXPECT_EQ(count_of(result.out, "sees joined=4"), 3u) << result.describe();
  // The store goes with the job.
  const int keeper = keeper_pid(result.err);
  ASSERT_GT(keeper, 0) << result.describe();
  EXPECT_TRUE(wait_until_dead(keeper)) << "ddp_ft_store outlived ddprun";
}

TEST(FaultTolerance, MaxRestartsBoundsTheRestartsThenTheOthersFinish) {
  TempDir dir;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--fault-tolerance", "--nproc-per-node", "3", "--max-restarts", "2", worker(),
                   "--dir", dir.path(), "--fail-rank", "1", "3"}),
      background_options());
  RdzvAgent agent;
  agent.process = job;
  ASSERT_TRUE(ddp::testing::wait_for_err(agent, "not restarting it", 30s)) << agent.err_so_far();
  touch(dir.file("finish"));
  ProcessResult& result = agent.finish(30s);
  // The two that never failed finished: the job succeeds without the one given up.
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank 1"), 3u) << result.describe();
  EXPECT_EQ(count_of(result.err, "restarting it alone"), 2u) << result.describe();
  EXPECT_NE(result.err.find("failed: exit code 3 (its last step: 7); not restarting it (--max-restarts 2 used up); "
                            "2 other worker(s) of this node go on"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("/1/inc2) failed"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("/1/inc3"), std::string::npos) << result.describe();
  EXPECT_EQ(count_of(result.out, "sees joined=5"), 2u) << result.describe();
}

// The failure line names the furthest step the worker's last lines name, over both streams:
// an old membership line on stderr ("... at step 1") once hid the steps stdout printed since.
TEST(FaultTolerance, TheLastStepNamedIsTheFurthestOverStdoutAndStderr) {
  ProcessResult result = ddprun(
      {"--standalone", "--fault-tolerance", "--nproc-per-node", "1", "--max-restarts", "0", "sh", "-c",
       "echo 'ddp: membership: replica a left (crash) at step 1' >&2; echo 'step 11'; echo 'step 12'; sleep 0.3; "
       "exit 3"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("failed: exit code 3 (its last step: 12)"), std::string::npos) << result.describe();
}

TEST(FaultTolerance, ARestartedWorkersOutputGoesOnInItsRanksLog) {
  TempDir dir;
  TempDir logs;
  ProcessResult result = ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts", "1",
                                 "--log-dir", logs.path(), worker(), "--dir", dir.path(), "--fail-rank", "1", "5",
                                 "--finish-after", "3"},
                                background_options());
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  // Both incarnations of rank 1 in one file, the first one's lines kept.
  const std::string log = ddp::testing::read_text_file(logs.file("attempt_0/rank_1.log"));
  EXPECT_EQ(count_of(log, "ft-env RANK=1"), 2u) << log;
  EXPECT_NE(log.find("/1/inc0"), std::string::npos) << log;
  EXPECT_NE(log.find("/1/inc1"), std::string::npos) << log;
  EXPECT_EQ(count_of(log, "fails at step 7"), 2u) << log;
  EXPECT_EQ(count_of(ddp::testing::read_text_file(logs.file("attempt_0/rank_0.log")), "ft-env RANK=0"), 1u);
}

TEST(FaultTolerance, SigtermStopsEveryWorkerAndRestartsNone) {
  TempDir dir;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts", "5", worker(),
                   "--dir", dir.path()}),
      background_options());
  ASSERT_GT(wait_for_pid_file(dir.file("pid.0.0"), 30s), 0);
  ASSERT_GT(wait_for_pid_file(dir.file("pid.1.0"), 30s), 0);
  ASSERT_EQ(::kill(job.pid, SIGTERM), 0);
  ProcessResult result = ddp::testing::wait_background(job, 30s);
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.describe();
  EXPECT_EQ(result.err.find("restarting it alone"), std::string::npos) << result.describe();
  EXPECT_FALSE(std::filesystem::exists(dir.file("pid.0.1")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("pid.1.1")));
}

TEST(FaultTolerance, JobFailsWhenEveryWorkerFailedForGood) {
  TempDir dir;
  ProcessResult result = ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "1", "--max-restarts", "1",
                                 worker(), "--dir", dir.path(), "--fail-rank", "0", "4"},
                                background_options());
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank 0"), 2u) << result.describe();
  EXPECT_NE(result.err.find("root cause"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("exit code 4"), std::string::npos) << result.describe();
}

TEST(FaultTolerance, PetFaultToleranceTurnsItOnAndPetFtDeadlineSetsTheDeadline) {
  TempDir dir;
  ProcessResult result =
      ddprun({"--standalone", "--nproc-per-node", "2", worker(), "--dir", dir.path(), "--finish-after", "0"},
             background_options({{"PET_FAULT_TOLERANCE", "1"}, {"PET_FT_DEADLINE", "2.5"}}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  const auto env = ft_env_lines(result.out);
  ASSERT_EQ(env.size(), 2u) << result.describe();
  std::set<std::string> ids;
  for (const auto& vars : env) {
    EXPECT_EQ(vars.at("DDP_FAULT_TOLERANCE"), "1");
    EXPECT_EQ(vars.at("DDP_FT_DEADLINE_MS"), "2500");
    EXPECT_EQ(vars.at("DDP_FT_INITIAL_REPLICAS"), "2");
    EXPECT_TRUE(std::regex_match(vars.at("DDP_FT_REPLICA_ID"),
                                 std::regex("node0-[0-9a-f]{8}/" + vars.at("RANK") + "/inc0")))
        << vars.at("DDP_FT_REPLICA_ID");
    ids.insert(vars.at("DDP_FT_REPLICA_ID"));
  }
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_EQ(count_of(result.out, "sees joined="), 2u) << result.describe();
}

TEST(FaultTolerance, StaticNodesOtherThanZeroReachTheStoreOnTheMastersNextPort) {
  // Node 1 of a static job hosts nothing; its workers are told where node 0's keeper is.
  ProcessResult result = ddprun({"--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port",
                                 "4000", "--fault-tolerance", "/bin/sh", "-c", "echo STORE=$DDP_FT_STORE"});
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.out.find("STORE=tcp://10.1.2.3:4001"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("ddp_ft_store"), std::string::npos) << "node 1 must not host the store";
}

TEST(FaultTolerance, EtcdV2AndFaultToleranceFlagsAreChecked) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1"}, "expected HOST:PORT[,HOST:PORT...]"},
      {{"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "a:1,,b:2"}, "expected HOST:PORT[,HOST:PORT...]"},
      {{"--rdzv-backend", "etcd-v2"}, "needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]"},
      {{"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "a:1", "--max-restarts", "1"},
       "--max-restarts with --rdzv-backend etcd-v2 needs --fault-tolerance"},
      {{"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "a:1", "--standalone"}, "--standalone runs a single node"},
      {{"--fault-tolerance", "--ft-deadline", "0"}, "expected a number of seconds > 0"},
      {{"--fault-tolerance", "--ft-store-port", "70000"}, "expected a port in 1..65535"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    args.push_back("/bin/true");
    ProcessResult result = ddprun(args);
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find(c.says), std::string::npos) << result.describe();
  }
}

TEST(FaultTolerance, WithoutItRestartModeIsUnchanged) {
  // Rank 1 kills itself on the first attempt: every worker is stopped and started again, and
  // none sees a fault-tolerance variable. Rank 1 waits (at most 10 s) for rank 0 to have said
  // its line first, or rank 0 could be stopped before its shell printed anything.
  TempDir dir;
  ProcessResult result = ddprun(
      {"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "/bin/sh", "-c",
       "echo \"FT=${DDP_FAULT_TOLERANCE:-unset} STORE=${DDP_FT_STORE:-unset} ID=${DDP_FT_REPLICA_ID:-unset} "
       "RC=$TORCHELASTIC_RESTART_COUNT\"; touch \"" + dir.file("said.$RANK.$TORCHELASTIC_RESTART_COUNT") + "\"; "
       "if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then "
       "for i in $(seq 100); do [ -e \"" + dir.file("said.0.0") + "\" ] && break; sleep 0.1; done; kill -9 $$; "
       "fi; sleep 1"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(count_of(result.out, "FT=unset STORE=unset ID=unset RC=0"), 2u) << result.describe();
  EXPECT_EQ(count_of(result.out, "FT=unset STORE=unset ID=unset RC=1"), 2u) << result.describe();
  EXPECT_NE(result.err.find("restarting all workers (restart 1 of 1)"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("stopped rank 0"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("fault tolerance"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("ddp_ft_store"), std::string::npos) << result.describe();
}

TEST(FaultTolerance, UnderC10dALostNodeLeavesTheOtherRunning) {
  TempDir dir;
  const int port = ddp::testing::free_port();
  const int store_port = ddp::testing::free_port();
  std::deque<RdzvAgent> agents;
  auto start = [&](const std::string& local_addr) -> RdzvAgent& {
    agents.emplace_back();
    agents.back().process = ddp::testing::start_background(
        ddprun_argv({"--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port), "--local-addr",
                     local_addr, "--nnodes", "2", "--nproc-per-node", "1", "--fault-tolerance", "--ft-store-port",
                     std::to_string(store_port), "--rdzv-conf", "heartbeat_timeout=1", "--monitor-interval", "0.2",
                     worker(), "--dir", dir.path()}),
        background_options());
    return agents.back();
  };
  RdzvAgent& host = start("127.0.0.2");
  ASSERT_TRUE(ddp::testing::wait_for_err(host, "hosting the rendezvous store", 30s)) << host.err_so_far();
  RdzvAgent& other = start("127.0.0.3");
  const int worker0 = wait_for_pid_file(dir.file("pid.0.0"), 30s);
  const int worker1 = wait_for_pid_file(dir.file("pid.1.0"), 30s);
  ASSERT_GT(worker0, 0) << ddp::testing::describe_agents(agents);
  ASSERT_GT(worker1, 0) << ddp::testing::describe_agents(agents);
  // The whole of node 1 goes: its ddprun, and with it its worker.
  ASSERT_EQ(::kill(other.process.pid, SIGKILL), 0);
  EXPECT_TRUE(wait_until_dead(worker1, 10s));
  // Longer than the heartbeat timeout: the store declares node 1 lost, and node 0 goes on.
  ASSERT_TRUE(ddp::testing::wait_for_err(host, "this node's workers go on", 15s)) << host.err_so_far();
  EXPECT_TRUE(ddp::testing::process_alive(worker0));
  touch(dir.file("finish"));
  ProcessResult& result = host.finish(30s);
  other.finish(1s);
  EXPECT_EQ(result.exit_code, 0) << ddp::testing::describe_agents(agents);
  EXPECT_NE(result.out.find("rank 0 replica node0-"), std::string::npos) << result.describe();
  EXPECT_NE(result.out.find("sees joined=2"), std::string::npos) << result.describe();
  ddp::testing::finish_agents(agents);
}

TEST(FaultTolerance, DdpWorkersRideOutACrashAndTheRestartedOneHealsBitForBit) {
  // ddp's own fault-tolerant training (tests/workers/ft_worker.cpp, include/ddp/fault_tolerance.h)
  // driven by ddprun alone: rank 1 is killed mid-training, ddprun starts it again as a new
  // replica, it heals from a live peer, and all three end with the same weights.
  if (!std::filesystem::exists(bin_path("ft_worker"))) GTEST_SKIP() << "ft_worker was not built";
  RunOptions options = background_options({{"FT_STEPS", "100"}, {"FT_STEP_MS", "20"}, {"OMP_NUM_THREADS", "1"}});
  options.timeout = 150s;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--fault-tolerance", "--nproc-per-node", "3", "--max-restarts", "1",
                   bin_path("ft_worker")}),
      options);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (ddp::testing::last_step_in(ddp::testing::read_text_file(job.out_path)) < 10 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_GE(ddp::testing::last_step_in(ddp::testing::read_text_file(job.out_path)), 10)
      << "no step 10 within 60 s:\n"
      << ddp::testing::read_text_file(job.out_path).substr(0, 4000) << ddp::testing::read_text_file(job.err_path);
  const int victim = ddp::testing::child_with_rank(job.pid, "ft_worker", 1);
  const int rank0 = ddp::testing::child_with_rank(job.pid, "ft_worker", 0);
  const int rank2 = ddp::testing::child_with_rank(job.pid, "ft_worker", 2);
  ASSERT_GT(victim, 0) << ddp::testing::read_text_file(job.err_path);
  ASSERT_GT(rank0, 0);
  ASSERT_GT(rank2, 0);
  const long long killed_at_us = std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ProcessResult result = ddp::testing::wait_background(job, 150s);
  // How long the survivors went without a committed step, and when the restarted one trained again.
  const long long recovered = ddp::testing::first_step_after(result.out, 0, killed_at_us);
  const long long rejoined = ddp::testing::first_step_after(result.out, 1, killed_at_us);
  if (recovered > 0 && rejoined > 0) {
    std::printf("[measure] under ddprun: rank 0's first commit %.0f ms after rank 1's SIGKILL; the restarted rank 1's "
                "first commit %.0f ms after it\n",
                (recovered - killed_at_us) / 1000.0, (rejoined - killed_at_us) / 1000.0);
  }
  EXPECT_GT(rejoined, 0) << "the restarted rank 1 never committed a step: " << result.describe();
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.err.find("fault tolerance: rank 1 (local rank 1, pid " + std::to_string(victim)),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("restarting it alone as replica"), std::string::npos) << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 1u) << "only rank 1 failed: " << result.describe();
  const auto finals = ddp::testing::finals_by_rank(result.out);
  ASSERT_EQ(finals.size(), 3u) << result.describe();
  for (const auto& [rank, hashes] : finals) {
    ASSERT_EQ(hashes.size(), 1u) << "rank " << rank;
    EXPECT_EQ(hashes[0], finals.at(0)[0]) << "rank " << rank << " ended with other weights: " << result.describe();
  }
}

}  // namespace
