// torchrun (python -m torch.distributed.run, torch 2.11) launching ddp programs (issue 11,
// item 1). torchrun serves its own TCPStore on MASTER_PORT and sets
// TORCHELASTIC_USE_AGENT_STORE=True, so every rank, rank 0 too, joins it as a client. The
// results must equal ddprun's. Each run is a real multi-process job under a timeout.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

bool torchrun_available() {
  auto r = run_process({DDP_PYTHON, "-c", "import torch.distributed.run"}, one_rank({}, std::chrono::seconds(60)));
  return r.exit_code == 0;
}

std::vector<std::string> torchrun(const std::vector<std::string>& launcher_args, const std::string& program,
                                  const std::vector<std::string>& args) {
  std::vector<std::string> argv = {DDP_PYTHON, "-m", "torch.distributed.run"};
  argv.insert(argv.end(), launcher_args.begin(), launcher_args.end());
  argv.push_back("--no-python");
  argv.push_back(bin_path(program));
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::vector<std::string> standalone() { return {"--standalone", "--nproc-per-node", "2"}; }
std::vector<std::string> static_rendezvous(int port) {
  return {"--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", std::to_string(port),
          "--nproc-per-node", "2"};
}

class Torchrun : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torchrun_available()) GTEST_SKIP() << DDP_PYTHON << " cannot import torch.distributed.run";
  }
};

// wine_ddp under torchrun, standalone and static, trains exactly as under ddprun.
TEST_F(Torchrun, WineDdpUnderTorchrunEqualsDdprun) {
  auto reference = make_temp_dir("wine_ddprun");
  auto ref = run_process(under_ddprun(2, "wine_ddp", {"20", "10", "--checkpoint-dir", reference, "--no-resume"}),
                         one_rank({}, std::chrono::seconds(120)));
  ASSERT_EQ(ref.exit_code, 0) << ref.describe();
  ASSERT_EQ(loss_lines(ref.out).size(), 20u) << ref.describe();
  for (const auto& launcher : {standalone(), static_rendezvous(free_port())}) {
    auto dir = make_temp_dir("wine_torchrun");
    auto r = run_process(torchrun(launcher, "wine_ddp", {"20", "10", "--checkpoint-dir", dir, "--no-resume"}),
                         one_rank({}, std::chrono::seconds(120)));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(r.err.find("already in use"), std::string::npos) << r.describe();
    EXPECT_EQ(loss_lines(r.out), loss_lines(ref.out)) << r.describe();
    EXPECT_EQ(compare_state_dicts(dir + "/model_final.pt", reference + "/model_final.pt"), "identical");
    fs::remove_all(dir);
  }
  fs::remove_all(reference);
}

// The DDP test worker: both ranks meet and all-reduce under both rendezvous kinds.
TEST_F(Torchrun, DdpWorkerRanksMeetThroughTorchrunsStore) {
  for (const auto& launcher : {standalone(), static_rendezvous(free_port())}) {
    auto r = run_process(torchrun(launcher, "ddp_worker", {"ready"}), one_rank({}, std::chrono::seconds(120)));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NE(r.out.find("READY rank " + std::to_string(rank) + " of 2 sum 2"), std::string::npos) << r.describe();
    }
  }
}


// torchrun --max-restarts 1 restarts the workers after one is killed; wine_ddp resumes from
// its snapshot through torchrun's store (which outlives the restart) and ends bit-identical
// to an uninterrupted ddprun run.
TEST_F(Torchrun, RestartAfterAKilledWorkerResumesFromTheSnapshot) {
  auto straight = make_temp_dir("wine_straight");
  auto restarted = make_temp_dir("wine_torchrun_restart");
  auto full = run_process(under_ddprun(2, "wine_ddp", {"300", "10", "--checkpoint-dir", straight}),
                          one_rank({}, std::chrono::seconds(180)));
  ASSERT_EQ(full.exit_code, 0) << full.describe();

  std::vector<std::string> launcher = standalone();
  launcher.insert(launcher.begin(), {"--max-restarts", "1"});
  auto job = start_background(torchrun(launcher, "wine_ddp", {"300", "10", "--checkpoint-dir", restarted}),
                              one_rank({{"DDP_TIMEOUT_SECONDS", "60"}}, std::chrono::seconds(180)));
  bool killed = false;
  for (int i = 0; i < 3000 && !killed; ++i) {
    std::ifstream out(job.out_path);
    std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
    if (text.find("Epoch 105, Loss") != std::string::npos) {
      int pid = worker_pid(job.pid, 1);
      ASSERT_GT(pid, 0) << "rank 1's pid not found";
      ASSERT_EQ(kill(pid, SIGKILL), 0);
      killed = true;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  auto r = wait_background(job, std::chrono::seconds(180));
  ASSERT_TRUE(killed) << "training ended before rank 1 could be killed: " << r.describe();
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("Resuming after epoch"), std::string::npos) << r.describe();
  EXPECT_EQ(compare_state_dicts(straight + "/model_final.pt", restarted + "/model_final.pt"), "identical");
  fs::remove_all(straight);
  fs::remove_all(restarted);
}

}  // namespace
