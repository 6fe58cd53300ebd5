// examples/lm under ddprun at 2 ranks: it trains with DDP and with
// Streaming DiLoCo, logging a held-out loss per --eval-every steps that
// falls, and refuses DiLoCo's flags without --diloco. Under ddprun --nnodes
// 1:2, a DiLoCo job that loses a node goes on at one replica from its
// sharded snapshot.

#include <support/ddprun_fixtures.h>
#include <support/launch.h>
#include <support/rdzv_agents.h>
#include <support/subprocess.h>

#include <gtest/gtest.h>

#include <signal.h>

#include <deque>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

using ddp::testing::one_rank;
using ddp::testing::run_process;
using ddp::testing::under_ddprun;

namespace {

struct Line {
  long long step = 0;
  double eval_loss = 0;
  long long syncs = 0;
};

std::vector<Line> read_metrics(const std::string& path) {
  std::vector<Line> lines;
  std::ifstream in(path);
  std::string text;
  const std::regex pattern(R"(\"step\": (\d+),.*\"eval_loss\": ([0-9.]+),.*\"syncs\": (\d+))");
  while (std::getline(in, text)) {
    std::smatch m;
    if (std::regex_search(text, m, pattern)) lines.push_back({std::stoll(m[1]), std::stod(m[2]), std::stoll(m[3])});
  }
  return lines;
}

std::vector<Line> train(const std::vector<std::string>& extra) {
  const std::string dir = ddp::testing::make_temp_dir("ddp_lm");
  const std::string metrics = dir + "/metrics.jsonl";
  std::vector<std::string> args = {"--steps", "40", "--eval-every", "20", "--corpus-mb", "1", "--width", "32",
                                   "--layers", "1", "--metrics", metrics};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = run_process(under_ddprun(2, "lm_train", args), one_rank({}, std::chrono::seconds(120)));
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  auto lines = read_metrics(metrics);
  std::filesystem::remove_all(dir);
  return lines;
}

}  // namespace

TEST(LmExample, DdpLogsAFallingHeldOutLoss) {
  auto lines = train({});
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1].step, 40);
  EXPECT_LT(lines[1].eval_loss, lines[0].eval_loss);
  EXPECT_LT(lines[0].eval_loss, 5.55) << "no better than uniform over 256 bytes (ln 256 = 5.55)";
  EXPECT_EQ(lines[1].syncs, 40);
}

TEST(LmExample, StreamingDiLoCoSyncsFragmentsAndLearns) {
  auto lines = train({"--diloco", "10", "--streaming", "2", "--overlap", "2", "--outer-dtype", "bf16"});
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_LT(lines[1].eval_loss, lines[0].eval_loss);
  EXPECT_LT(lines[0].eval_loss, 5.55);
  // 2 fragments, each synced every 10 steps: 8 syncs in 40 steps.
  EXPECT_EQ(lines[1].syncs, 8);
}

// The same job sharded: FSDP over both ranks, and HSDP (one node of two
// ranks: sharded within it) follow DDP's held-out losses.
TEST(LmExample, FsdpAndHsdpFollowDdp) {
  const auto ddp_lines = train({});
  ASSERT_EQ(ddp_lines.size(), 2u);
  for (const char* strategy : {"fsdp", "hsdp"}) {
    const auto lines = train({"--strategy", strategy});
    ASSERT_EQ(lines.size(), 2u) << strategy;
    for (size_t i = 0; i < lines.size(); ++i) {
      EXPECT_NEAR(lines[i].eval_loss, ddp_lines[i].eval_loss, 1e-3) << strategy << " at step " << lines[i].step;
    }
  }
  auto r = run_process({ddp::testing::bin_path("lm_train"), "--strategy", "fsdp", "--diloco", "10"}, one_rank({}));
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_NE(r.err.find("shards the model instead of DDP"), std::string::npos) << r.err;
}

TEST(LmExample, DiLoCoFlagsWithoutDiLoCoAreAUsageError) {
  auto r = run_process({ddp::testing::bin_path("lm_train"), "--streaming", "2"}, one_rank({}));
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_NE(r.err.find("need --diloco H"), std::string::npos) << r.err;
}

// The slow-links benchmark's "DDP + PowerSGD" row: compressed from step 10,
// the loss still falls; and PowerSGD is DDP's, not DiLoCo's.
TEST(LmExample, DdpWithPowerSgdLearnsAndRefusesDiLoCo) {
  auto lines = train({"--powersgd", "2"});
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_LT(lines[1].eval_loss, lines[0].eval_loss);
  EXPECT_LT(lines[0].eval_loss, 5.55);
  auto r = run_process({ddp::testing::bin_path("lm_train"), "--powersgd", "2", "--diloco", "10"}, one_rank({}));
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_NE(r.err.find("--powersgd compresses DDP's gradients"), std::string::npos) << r.err;
}

// Python's DCP reads a DiLoCo job's sharded snapshot: 2 replicas, one sync at
// step 4 (H = 4, no mixing), a snapshot right after it. "model.*" is the
// global copy, and both replicas' local weights equal it (the script checks).
TEST(LmExample, PythonReadsADiLoCoSnapshot) {
  const std::string dir = ddp::testing::make_temp_dir("ddp_lm_dcp");
  auto r = run_process(under_ddprun(2, "lm_train",
                                    {"--steps", "4", "--eval-every", "4", "--corpus-mb", "1", "--width", "32", "--layers",
                                     "1", "--diloco", "4", "--snapshot-dir", dir, "--snapshot-every", "4"}),
                       one_rank({}, std::chrono::seconds(120)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ddp::testing::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  auto py = run_process({DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tests/python/dcp_read_diloco.py",
                         dir + "/sharded_step_000000000004", "2"},
                        options);
  EXPECT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_NE(py.out.find("max |global - local| after the sync: 0.0"), std::string::npos) << py.describe();
  std::filesystem::remove_all(dir);
}

// Issue 38, item 5: two ddprun agents (nodes) of an elastic job, --nnodes 1:2,
// one lm_train rank each, DiLoCo across them with a sharded snapshot every 8
// steps. Node 1 is SIGKILLed once a snapshot exists: its replica drops out,
// ddprun goes on with node 0 alone, and lm_train resumes there from the
// newest snapshot (written at 2 replicas) at 1 replica and trains to the end.
TEST(LmExample, DiLoCoJobLosingANodeGoesOnAtOneReplicaFromItsShardedSnapshot) {
  const std::string dir = ddp::testing::make_temp_dir("ddp_lm_elastic");
  const std::string snapshots = dir + "/snapshots";
  const std::string endpoint = "127.0.0.1:" + std::to_string(ddp::testing::free_port());
  std::deque<ddp::testing::RdzvAgent> agents;
  auto options = ddprun_tests::run_options({{"OMP_NUM_THREADS", "1"}});
  options.timeout = std::chrono::seconds(150);
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> args = {"--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--local-addr",
                                     "127.0.0." + std::to_string(2 + node), "--nnodes", "1:2", "--nproc-per-node", "1",
                                     "--max-restarts", "3", "--monitor-interval", "0.2", "--rdzv-conf",
                                     "heartbeat_timeout=2,last_call_timeout=5",
                                     ddp::testing::bin_path("lm_train"), "--steps", "400", "--eval-every", "400",
                                     "--corpus-mb", "1", "--width", "32", "--layers", "1", "--diloco", "4",
                                     "--snapshot-dir", snapshots, "--snapshot-every", "8"};
    agents.emplace_back();
    agents.back().process = ddp::testing::start_background(ddprun_tests::ddprun_argv(args), options);
    if (node == 0) ASSERT_TRUE(ddp::testing::wait_for_err(agents.back(), "hosting the rendezvous store"));
  }
  const auto describe = [&] { return ddp::testing::describe_agents(agents); };
  // Both replicas trained together: a snapshot of the 2-replica job is there.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool snapshot = false;
  while (!snapshot && std::chrono::steady_clock::now() < deadline) {
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator(snapshots, ignored)) {
      snapshot = snapshot || entry.path().filename().string().rfind("sharded_step_", 0) == 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(snapshot) << describe();
  ASSERT_EQ(::kill(agents[1].process.pid, SIGKILL), 0);
  ddp::testing::ProcessResult& survivor = agents[0].finish(std::chrono::seconds(120));
  agents[1].finish(std::chrono::seconds(5));
  EXPECT_EQ(survivor.exit_code, 0) << describe();
  EXPECT_NE(survivor.err.find("continuing with 1 node(s)"), std::string::npos) << describe();
  const std::string everything = survivor.out + survivor.err;
  std::smatch resumed;
  ASSERT_TRUE(std::regex_search(everything, resumed,
                                std::regex(R"(resumed from the snapshot of step (\d+) at 1 ranks)")))
      << describe();
  EXPECT_GE(std::stoll(resumed[1]), 8);
  EXPECT_NE(everything.find("step 400 "), std::string::npos) << describe();
  ddp::testing::finish_agents(agents);
  std::filesystem::remove_all(dir);
}
