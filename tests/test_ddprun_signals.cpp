// Tests of the signals sent to ddprun: forwarded to the workers, the teardown after them, and
// the watchdog that cleans up after a SIGKILLed ddprun.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

// ---------------------------------------------------------------------------------------------
// Signals sent to ddprun

class DdprunSignals : public ::testing::Test {
 protected:
  // Starts ddprun in the background with two probes and waits until both are ready.
  void start(std::vector<std::string> ddprun_flags, std::vector<std::string> probe_flags) {
    std::vector<std::string> args = std::move(ddprun_flags);
    args.insert(args.end(), {"--nproc-per-node", "2", probe(), "--pid-file", pids_.path()});
    args.insert(args.end(), probe_flags.begin(), probe_flags.end());
    launcher_ = ddp::testing::start_background(ddprun_argv(args), run_options());
    for (int rank = 0; rank < 2; ++rank) {
      worker_pids_.push_back(wait_for_pid_file(pids_.file("pid." + std::to_string(rank))));
      if (worker_pids_.back() <= 0)
        FAIL() << "rank " << rank << " never started: " << finish(1ms).describe();
    }
  }

  void TearDown() override {
    if (launcher_.pid > 0 && !finished_) ddp::testing::wait_background(launcher_, 1ms);
    for (int pid : worker_pids_) {
      if (pid > 0 && ddp::testing::process_alive(pid)) kill(pid, SIGKILL);
    }
  }

  ProcessResult finish(std::chrono::milliseconds timeout = 15s) {
    finished_ = true;
    return ddp::testing::wait_background(launcher_, timeout);
  }

  // Waits until ddprun's stderr (a file while it runs in the background) contains text.
  bool wait_for_stderr(const std::string& text, std::chrono::milliseconds timeout = 10s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (read_text_file(launcher_.err_path).find(text) == std::string::npos) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(10ms);
    }
    return true;
  }

  void expect_workers_dead() {
    for (int pid : worker_pids_)
      EXPECT_TRUE(wait_until_dead(pid)) << "worker " << pid << " survived";
  }

  TempDir pids_;
  BackgroundProcess launcher_;
  std::vector<int> worker_pids_;
  bool finished_ = false;
};

TEST_F(DdprunSignals, SigtermIsForwardedToTheWorkers) {
  ASSERT_NO_FATAL_FAILURE(start({}, {"--trap-term", "--sleep", "60"}));
  ASSERT_EQ(kill(launcher_.pid, SIGTERM), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.describe();
  EXPECT_LT(result.seconds, 5.0) << result.describe();
  EXPECT_NE(result.out.find("[rank0]: rank 0 got SIGTERM\n"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.out.find("[rank1]: rank 1 got SIGTERM\n"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("received SIGTERM"), std::string::npos) << result.describe();
  expect_workers_dead();
}

TEST_F(DdprunSignals, SigintIsForwardedToTheWorkers) {
  ASSERT_NO_FATAL_FAILURE(start({}, {"--sleep", "60"}));
  ASSERT_EQ(kill(launcher_.pid, SIGINT), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.exit_code, 128 + SIGINT) << result.describe();
  EXPECT_LT(result.seconds, 5.0) << result.describe();
  EXPECT_NE(result.err.find("received SIGINT"), std::string::npos) << result.describe();
  EXPECT_EQ(count_of(result.err, "killed by signal 2 (SIGINT)"), 2u) << result.describe();
  expect_workers_dead();
}

TEST_F(DdprunSignals, SecondSignalKillsWithoutWaitingForTheGracePeriod) {
  ASSERT_NO_FATAL_FAILURE(start({"--grace-period", "60"}, {"--ignore-term", "--sleep", "60"}));
  ASSERT_EQ(kill(launcher_.pid, SIGTERM), 0);
  std::this_thread::sleep_for(300ms);
  ASSERT_EQ(kill(launcher_.pid, SIGTERM), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.describe();
  EXPECT_LT(result.seconds, 5.0) << result.describe();
  EXPECT_NE(result.err.find("killing them now"), std::string::npos) << result.describe();
  expect_workers_dead();
}

TEST_F(DdprunSignals, SighupIsForwardedToTheWorkers) {
  ASSERT_NO_FATAL_FAILURE(start({}, {"--sleep", "60"}));
  ASSERT_EQ(kill(launcher_.pid, SIGHUP), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.exit_code, 128 + SIGHUP) << result.describe();
  EXPECT_EQ(count_of(result.err, "killed by signal 1 (SIGHUP)"), 2u) << result.describe();
  expect_workers_dead();
}

TEST_F(DdprunSignals, SigkilledLauncherTakesWorkersAndTheirChildrenAlong) {
  ASSERT_NO_FATAL_FAILURE(start({}, {"--spawn-grandchild", pids_.path(), "--sleep", "60"}));
  ASSERT_EQ(kill(launcher_.pid, SIGKILL), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.term_signal, SIGKILL) << result.describe();
  // ddprun could not clean up: PR_SET_PDEATHSIG stops the workers, its watchdog their children.
  expect_workers_dead();
  for (int rank : {0, 1}) {
    const int grandchild = wait_for_pid_file(pids_.file("grandchild." + std::to_string(rank)), 0ms);
    ASSERT_GT(grandchild, 0);
    EXPECT_TRUE(wait_until_dead(grandchild)) << "grandchild of rank " << rank << " survived";
  }
}

// Slurm's `scancel --signal USR2` (or a time limit's SIGXCPU) reaches every process of the job,
// the watchdog included: it must survive them to clean up after a SIGKILLed ddprun.
TEST_F(DdprunSignals, TheWatchdogSurvivesSignalsSentToEveryProcessOfTheJob) {
  ASSERT_NO_FATAL_FAILURE(start({}, {"--spawn-grandchild", pids_.path(), "--sleep", "60"}));
  for (int rank : {0, 1}) ASSERT_GT(wait_for_pid_file(pids_.file("grandchild." + std::to_string(rank))), 0);
  // The watchdog is ddprun's forked child that never exec'd: its name is still "ddprun".
  std::vector<pid_t> watchdogs;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::ifstream stat(entry.path() / "stat");
    std::string pid, name, state, ppid;
    if (!(stat >> pid >> name >> state >> ppid)) continue;
    if (name == "(ddprun)" && std::stoi(ppid) == launcher_.pid) watchdogs.push_back(std::stoi(pid));
  }
  ASSERT_EQ(watchdogs.size(), 1u);
  for (int signal_number : {SIGUSR1, SIGUSR2, SIGALRM, SIGXCPU}) ASSERT_EQ(kill(watchdogs[0], signal_number), 0);
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(ddp::testing::process_alive(watchdogs[0])) << "the watchdog died of a job-wide signal";
  ASSERT_EQ(kill(launcher_.pid, SIGKILL), 0);
  finish();
  for (int rank : {0, 1}) {
    const int grandchild = wait_for_pid_file(pids_.file("grandchild." + std::to_string(rank)), 0ms);
    EXPECT_TRUE(wait_until_dead(grandchild)) << "grandchild of rank " << rank << " survived";
  }
  expect_workers_dead();
}

TEST_F(DdprunSignals, SigkilledLauncherTakesRestartedWorkersAndTheirChildrenAlong) {
  // The watchdog must know the restarted workers' groups, not only the first attempt's.
  ASSERT_NO_FATAL_FAILURE(
      start({"--max-restarts", "1"},
            {"--spawn-grandchild", pids_.path(), "--barrier", "--sync-after-output", pids_.path(),
             "--on-attempt", "0", "--exit-code-on-rank", "1", "3", "--sleep", "60"}));
  std::vector<int> restarted;
  for (int rank = 0; rank < 2; ++rank) {
    restarted.push_back(wait_for_pid_file(pids_.file("printed.1." + std::to_string(rank))));
    ASSERT_GT(restarted.back(), 0) << "no restart: " << finish(1ms).describe();
  }
  ASSERT_EQ(kill(launcher_.pid, SIGKILL), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.term_signal, SIGKILL) << result.describe();
  for (int pid : restarted) EXPECT_TRUE(wait_until_dead(pid)) << "restarted worker " << pid;
  for (int rank : {0, 1}) {
    // Written before printed.1.<rank>, so these are the restarted workers' children.
    const int grandchild = wait_for_pid_file(pids_.file("grandchild." + std::to_string(rank)), 0ms);
    ASSERT_GT(grandchild, 0);
    EXPECT_TRUE(wait_until_dead(grandchild)) << "grandchild of rank " << rank << " survived";
  }
  expect_workers_dead();  // the first attempt's workers
}

TEST_F(DdprunSignals, SignalDuringARunWithRestartsLeftDoesNotRestart) {
  ASSERT_NO_FATAL_FAILURE(start({"--max-restarts", "3"}, {"--print-env", "--sleep", "60"}));
  ASSERT_EQ(kill(launcher_.pid, SIGTERM), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.describe();
  EXPECT_LT(result.seconds, 5.0) << result.describe();
  EXPECT_EQ(result.err.find("restart"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("root cause"), std::string::npos) << result.describe();
  EXPECT_EQ(workers_per_attempt(result.out).count(1), 0u) << result.describe();
  expect_workers_dead();
}

TEST_F(DdprunSignals, SignalWhileStoppingAfterAFailureDoesNotRestart) {
  // Rank 0 fails; rank 1 ignores SIGTERM, so ddprun sits in its 60 s grace period when the
  // signal comes. The signal must end the job at once instead of leading to a restart.
  ASSERT_NO_FATAL_FAILURE(start({"--max-restarts", "3", "--grace-period", "60"},
                                {"--barrier", "--ignore-term", "--print-env", "--on-attempt", "0",
                                 "--exit-code-on-rank", "0", "3", "--sleep", "60"}));
  ASSERT_TRUE(wait_for_stderr("failed: exit code 3")) << finish(1ms).describe();
  ASSERT_EQ(kill(launcher_.pid, SIGINT), 0);
  ProcessResult result = finish();
  EXPECT_EQ(result.exit_code, 128 + SIGINT) << result.describe();
  EXPECT_LT(result.seconds, 5.0) << result.describe();
  EXPECT_EQ(result.err.find("restarting"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("killed with SIGKILL"), std::string::npos) << result.describe();
  EXPECT_EQ(workers_per_attempt(result.out).count(1), 0u) << result.describe();
  expect_workers_dead();
}

TEST_F(DdprunSignals, StandaloneRestartMovesToANewPortWhenTheOldOneIsTaken) {
  // Attempt 0 prints its port and fails only once the test has taken that port over.
  const std::string go = pids_.file("go");
  ASSERT_NO_FATAL_FAILURE(
      start({"--standalone", "--max-restarts", "1"},
            {"--print-env", "--sync-after-output", pids_.path(), "--wait-for-file", go,
             "--on-attempt", "0", "--exit-code-on-rank", "1", "3"}));
  int port = -1;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (port < 0 && std::chrono::steady_clock::now() < deadline) {
    auto lines = env_lines(read_text_file(launcher_.out_path));
    if (!lines.empty()) port = std::stoi(lines.front()["MASTER_PORT"]);
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GT(port, 0) << finish(1ms).describe();

  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool taken = bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                     listen(listener, 1) == 0;
  std::ofstream(go).put('\n');
  ProcessResult result = finish();
  close(listener);
  ASSERT_TRUE(taken) << "could not take port " << port << " for the test";

  EXPECT_EQ(result.exit_code, 0) << result.describe();
  auto lines = env_lines(result.out);
  ASSERT_EQ(lines.size(), 4u) << result.describe();
  for (auto& vars : lines) {
    const bool restarted = vars["TORCHELASTIC_RESTART_COUNT"] == "1";
    if (restarted) {
      EXPECT_NE(vars["MASTER_PORT"], std::to_string(port)) << result.describe();
    } else {
      EXPECT_EQ(vars["MASTER_PORT"], std::to_string(port)) << result.describe();
    }
  }
  EXPECT_NE(result.err.find("port " + std::to_string(port) + " on 127.0.0.1 is taken now"),
            std::string::npos)
      << result.describe();
}

// SIGUSR1 (for stack dumps) reaches every worker and stops nothing.
TEST(DdprunSigusr1, IsForwardedToEveryWorkerWithoutStoppingAnything) {
  TempDir pids;
  BackgroundProcess launcher = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--nproc-per-node", "2", probe(), "--trap-usr1", "--pid-file", pids.path(),
                   "--barrier", "--sleep", "2", "--say", "finished"}),
      run_options());
  for (int rank = 0; rank < 2; ++rank) ASSERT_GT(wait_for_pid_file(pids.file("pid." + std::to_string(rank))), 0);
  ASSERT_EQ(kill(launcher.pid, SIGUSR1), 0);
  ProcessResult r = ddp::testing::wait_background(launcher, 20s);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("[rank0]: rank 0 got SIGUSR1"), std::string::npos) << r.describe();
  EXPECT_NE(r.out.find("[rank1]: rank 1 got SIGUSR1"), std::string::npos) << r.describe();
  EXPECT_EQ(count_of(r.out, "finished"), 2u) << "the workers went on: " << r.describe();
  EXPECT_NE(r.err.find("received SIGUSR1, forwarded it to 2 worker(s)"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("restart"), std::string::npos) << r.describe();
}

}  // namespace
