// ddprun with a console nobody reads, issue 21 item 4: a stalled stdout must not keep ddprun
// from handling signals, worker exits or the rendezvous. Also ddprun's number parsing and
// limits (item 6) and the root cause of a worker stopped after its own error (item 8).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/subprocess.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ddp::testing::bin_path;
using ddp::testing::ProcessResult;

std::string probe() { return bin_path("launcher_probe"); }

std::string read_text_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

class TempDir {
 public:
  TempDir() : path_(ddp::testing::make_temp_dir("ddprun_console")) {}
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A ddprun whose stdout is a pipe that this test holds open and never reads; its stderr goes to
// a file. Everything it starts is SIGKILLed when the test is done with it.
class StalledDdprun {
 public:
  StalledDdprun(const std::vector<std::string>& args, const std::string& err_path) : err_path_(err_path) {
    int fds[2];
    EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
    std::vector<std::string> argv{bin_path("ddprun")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> c_argv;
    for (std::string& arg : argv) c_argv.push_back(arg.data());
    c_argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      ::execv(c_argv[0], c_argv.data());
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
    ::close(fds[1]);
    read_end_ = fds[0];
  }
  ~StalledDdprun() {
    if (pid_ > 0 && !reaped_) {
      ::killpg(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(read_end_);
  }

  int pid() const { return pid_; }
  std::string err() const { return read_text_file(err_path_); }

  bool wait_for_err(const std::string& text, std::chrono::milliseconds timeout = 15s) const {
    const auto deadline = Clock::now() + timeout;
    while (err().find(text) == std::string::npos) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(10ms);
    }
    return true;
  }

  // The exit status (as a shell reports it: 128+N for signal N), or -1 if it is still running
  // after `timeout`; *seconds is how long it took.
  int wait(std::chrono::milliseconds timeout, double* seconds) {
    const auto start = Clock::now();
    while (true) {
      int status = 0;
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      *seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (done == pid_) {
        reaped_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (Clock::now() - start >= timeout) return -1;
      std::this_thread::sleep_for(10ms);
    }
  }

 private:
  std::string err_path_;
  pid_t pid_ = -1;
  int read_end_ = -1;
  bool reaped_ = false;
};

int wait_for_pid_file(const std::string& path, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    std::ifstream file(path);
    int pid = -1;
    if (file >> pid) return pid;
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(10ms);
  }
}

bool wait_until_dead(int pid, std::chrono::milliseconds timeout = 3s) {
  const auto deadline = Clock::now() + timeout;
  while (ddp::testing::process_alive(pid)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// 20000 lines of ~320 bytes: more than the pipe and ddprun's 4 MiB buffer together hold.
const std::vector<std::string> kChatty = {"--lines", "20000"};

TEST(DdprunStalledConsole, SigtermStillStopsTheJobAndItsWorkers) {
  TempDir dir;
  std::vector<std::string> args = {"--nproc-per-node", "2", probe(), "--pid-file", dir.path()};
  args.insert(args.end(), kChatty.begin(), kChatty.end());
  args.insert(args.end(), {"--sleep", "60"});
  StalledDdprun ddprun(args, dir.file("err"));
  const int rank0 = wait_for_pid_file(dir.file("pid.0"));
  const int rank1 = wait_for_pid_file(dir.file("pid.1"));
  ASSERT_GT(rank0, 0);
  ASSERT_GT(rank1, 0);
  ASSERT_TRUE(ddprun.wait_for_err("stdout is not being read")) << ddprun.err();

  ASSERT_EQ(::kill(ddprun.pid(), SIGTERM), 0);
  double seconds = 0;
  const int status = ddprun.wait(15s, &seconds);
  EXPECT_EQ(status, 128 + SIGTERM) << "after " << seconds << " s: " << ddprun.err();
  EXPECT_LT(seconds, 5.0) << ddprun.err();
  EXPECT_TRUE(wait_until_dead(rank0)) << "rank 0 outlived ddprun";
  EXPECT_TRUE(wait_until_dead(rank1)) << "rank 1 outlived ddprun";
  const std::string err = ddprun.err();
  EXPECT_NE(err.find("ddprun: received SIGTERM, forwarding it to the workers"), std::string::npos) << err;
  EXPECT_NE(err.find(" bytes of worker output were dropped because stdout was not being read\n"), std::string::npos)
      << err;
}

TEST(DdprunStalledConsole, AFailingWorkerStillEndsTheJob) {
  TempDir dir;
  std::vector<std::string> args = {"--nproc-per-node", "2", probe(), "--pid-file", dir.path()};
  args.insert(args.end(), kChatty.begin(), kChatty.end());
  args.insert(args.end(), {"--wait-for-file", dir.file("go"), "--exit-code-on-rank", "1", "3", "--sleep", "60"});
  StalledDdprun ddprun(args, dir.file("err"));
  const int rank0 = wait_for_pid_file(dir.file("pid.0"));
  ASSERT_GT(rank0, 0);
  ASSERT_TRUE(ddprun.wait_for_err("stdout is not being read")) << ddprun.err();
  std::ofstream(dir.file("go")) << "go\n";  // rank 1 fails only once ddprun's stdout is stuck

  double seconds = 0;
  const int status = ddprun.wait(15s, &seconds);
  EXPECT_EQ(status, 1) << "after " << seconds << " s: " << ddprun.err();
  EXPECT_LT(seconds, 5.0) << ddprun.err();
  EXPECT_TRUE(wait_until_dead(rank0)) << "rank 0 outlived ddprun";
  const std::string err = ddprun.err();
  EXPECT_NE(err.find("ddprun: rank 1 (local rank 1, pid "), std::string::npos) << err;
  EXPECT_NE(err.find("ddprun:   exit: exit code 3\n"), std::string::npos) << err;
}

// Two agents of a c10d job; the stalled one hosts the store. A worker of the other fails: both
// must end, and soon, rather than wait for a node that cannot act.
TEST(DdprunStalledConsole, ANodeWithAStalledConsoleDoesNotHoldUpTheOthers) {
  TempDir dir;
  const std::string endpoint = "127.0.0.1:" + std::to_string(ddp::testing::free_port());
  auto agent_args = [&](int index, std::vector<std::string> program) {
    std::vector<std::string> args = {"--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--local-addr",
                                     "127.0.0." + std::to_string(2 + index), "--nnodes", "2", "--rdzv-conf",
                                     "join_timeout=20"};
    args.insert(args.end(), program.begin(), program.end());
    return args;
  };
  std::vector<std::string> chatty = {probe(), "--pid-file", dir.path()};
  chatty.insert(chatty.end(), kChatty.begin(), kChatty.end());
  chatty.insert(chatty.end(), {"--sleep", "60"});
  StalledDdprun stalled(agent_args(0, chatty), dir.file("err0"));
  ASSERT_TRUE(stalled.wait_for_err("hosting the rendezvous store")) << stalled.err();

  ddp::testing::RunOptions options;
  options.env = {{"OMP_NUM_THREADS", "1"}};
  std::vector<std::string> failing = {bin_path("ddprun")};
  for (const std::string& arg : agent_args(1, {probe(), "--wait-for-file", dir.file("go"), "--exit-code-on-rank",
                                               "1", "5", "--sleep", "60"})) {
    failing.push_back(arg);
  }
  ddp::testing::BackgroundProcess other = ddp::testing::start_background(failing, options);
  const int stalled_worker = wait_for_pid_file(dir.file("pid.0"), 20s);
  ASSERT_GT(stalled_worker, 0) << stalled.err();
  ASSERT_TRUE(stalled.wait_for_err("stdout is not being read")) << stalled.err();
  std::ofstream(dir.file("go")) << "go\n";

  ProcessResult result = ddp::testing::wait_background(other, 30s);
  EXPECT_EQ(result.exit_code, 1) << result.describe() << "\n--- stalled agent:\n" << stalled.err();
  EXPECT_LT(result.seconds, 15.0) << result.describe();
  double seconds = 0;
  const int status = stalled.wait(15s, &seconds);
  EXPECT_EQ(status, 1) << stalled.err();
  EXPECT_TRUE(wait_until_dead(stalled_worker)) << "the stalled node's worker outlived it";
  EXPECT_NE(stalled.err().find("ddprun:   node: 1, rank: 1"), std::string::npos) << stalled.err();
}

// The heartbeat speaks for the supervision loop, not only for its own thread: a node whose loop
// is stuck (held here by the launcher's test seam, as a blocking call would hold it, in the test
// build of ddprun) stops heartbeating, so the store declares it lost and the other node's
// failure ends the job within the heartbeat timeout instead of waiting for the stuck node to
// come back.
TEST(DdprunStalledSupervisor, ANodeWhoseLoopIsStuckIsDeclaredLostAndTheJobEnds) {
  TempDir dir;
  const std::string endpoint = "127.0.0.1:" + std::to_string(ddp::testing::free_port());
  auto agent = [&](int index, std::vector<std::string> program) {
    // The stuck node runs ddprun_test_build, which reads the stall from its environment.
    std::vector<std::string> argv = {bin_path(index == 1 ? "ddprun_test_build" : "ddprun"),
                                     "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                                     "--local-addr", "127.0.0." + std::to_string(2 + index), "--nnodes", "2",
                                     "--rdzv-conf", "join_timeout=20,heartbeat_timeout=3"};
    argv.insert(argv.end(), program.begin(), program.end());
    return argv;
  };
  ddp::testing::RunOptions host_options;
  host_options.env = {{"OMP_NUM_THREADS", "1"}};
  auto host = ddp::testing::start_background(
      agent(0, {probe(), "--pid-file", dir.path(), "--wait-for-file", dir.file("go"), "--exit-code-on-rank", "0",
                "5", "--sleep", "60"}),
      host_options);
  ddp::testing::RunOptions stuck_options = host_options;
  stuck_options.env.emplace_back("DDPRUN_TEST_STALL_SUPERVISOR_SECONDS", "25");
  auto stuck = ddp::testing::start_background(agent(1, {probe(), "--pid-file", dir.path(), "--sleep", "60"}),
                                              stuck_options);
  ASSERT_GT(wait_for_pid_file(dir.file("pid.0"), 20s), 0);
  ASSERT_GT(wait_for_pid_file(dir.file("pid.1"), 20s), 0);
  const auto go = Clock::now();
  std::ofstream(dir.file("go")) << "go\n";

  ProcessResult host_result = ddp::testing::wait_background(host, 35s);
  const double after_go = std::chrono::duration<double>(Clock::now() - go).count();
  EXPECT_EQ(host_result.exit_code, 1) << host_result.describe();
  // Without the loop's stamp the stuck node's heartbeat thread kept it alive, and the job
  // waited the whole 25 s stall for its report.
  EXPECT_LT(after_go, 15.0) << host_result.describe();
  EXPECT_NE(host_result.err.find("lost"), std::string::npos) << host_result.describe();
  ProcessResult stuck_result = ddp::testing::wait_background(stuck, 60s);
  EXPECT_NE(stuck_result.exit_code, 0) << stuck_result.describe();
}

// ---------------------------------------------------------------------------------------------
// Inputs that overflow or waste (item 6).

ProcessResult ddprun(const std::vector<std::string>& args) {
  std::vector<std::string> argv{bin_path("ddprun")};
  argv.insert(argv.end(), args.begin(), args.end());
  ddp::testing::RunOptions options;
  options.timeout = 20s;
  return ddp::testing::run_process(argv, options);
}

size_t line_count(const std::string& text) {
  size_t lines = 0;
  for (char c : text) lines += c == '\n';
  return lines;
}

TEST(DdprunInputs, AWorldTooLargeForAnIntIsRefusedNamingBothFlags) {
  ProcessResult result = ddprun({"--nnodes", "2000000000", "--nproc-per-node", "2", "--node-rank", "0", "true"});
  EXPECT_EQ(result.exit_code, 2) << result.describe();
  EXPECT_NE(result.err.find("--nnodes 2000000000 times --nproc-per-node 2 is 4000000000 workers, more than the "
                            "limit of 2147483647 ranks"),
            std::string::npos)
      << result.describe();
  EXPECT_EQ(line_count(result.err), 1u) << result.describe();
}

TEST(DdprunInputs, AMonitorIntervalBelowTheMinimumIsRefused) {
  ProcessResult result = ddprun({"--monitor-interval", "1e-6", "true"});
  EXPECT_EQ(result.exit_code, 2) << result.describe();
  EXPECT_NE(result.err.find("invalid value '1e-6' for --monitor-interval: expected a number of seconds >= 0.01"),
            std::string::npos)
      << result.describe();
  EXPECT_EQ(ddprun({"--monitor-interval", "0.01", "true"}).exit_code, 0);
}

TEST(DdprunInputs, NumbersAreParsedStrictly) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nproc-per-node", "2abc"}, "'2abc' for --nproc-per-node"},
      {{"--nnodes", "2abc"}, "'2abc' for --nnodes"},
      {{"--max-restarts", "+1"}, "'+1' for --max-restarts"},
      {{"--master-port", " 29500"}, "' 29500' for --master-port"},
      {{"--node-rank", "0x1"}, "'0x1' for --node-rank"},
      {{"--grace-period", "0x10"}, "'0x10' for --grace-period"},
      {{"--grace-period", " 1"}, "' 1' for --grace-period"},
      {{"--grace-period", "infinity"}, "'infinity' for --grace-period"},
      {{"--monitor-interval", "1s"}, "'1s' for --monitor-interval"},
      {{"--rdzv-conf", "heartbeat_timeout=5s"}, "'5s' for --rdzv-conf heartbeat_timeout"},
      {{"--rdzv-endpoint", "127.0.0.1:29400x"}, "'127.0.0.1:29400x' for --rdzv-endpoint"},
  };
  for (auto [args, expected] : cases) {
    SCOPED_TRACE(expected);
    args.push_back("true");
    ProcessResult result = ddprun(args);
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find("invalid value " + expected), std::string::npos) << result.describe();
    EXPECT_EQ(line_count(result.err), 1u) << result.describe();
  }
  // Plain decimals still work.
  EXPECT_EQ(ddprun({"--grace-period", "1.5", "--max-restarts", "0", "--monitor-interval", "1e-1", "true"}).exit_code,
            0);
}

// Issue 34, item 7: ddprun echoes these values (a role prefixes every teed line; run ids,
// addresses and directories appear in its messages and logs). A newline or an escape sequence
// in one could forge a console line, so each is refused, and the refusal prints it escaped.
TEST(DdprunInputs, ControlCharactersInEchoedValuesAreRefusedWithoutPrintingThem) {
  const std::string forged = "\n[rank0]: forged";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--role", "x" + forged},
      {"--rdzv-id", "job" + forged},
      {"--master-addr", "host" + forged},
      {"--local-addr", "host" + forged},
      {"--log-dir", "/tmp/logs" + forged},
      {"--rdzv-endpoint", "host" + forged},
      {"--role", "x\x1b[2K\r[rank0]: forged"},
  };
  for (const auto& [flag, value] : cases) {
    SCOPED_TRACE(flag);
    ProcessResult result = ddprun({flag, value, "--tee", "3", probe(), "--say", "worker ran"});
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find("for " + flag + ": control characters"), std::string::npos) << result.describe();
    EXPECT_EQ(line_count(result.err), 1u) << "the refusal is one line: " << result.describe();
    EXPECT_EQ(result.out.find("worker ran"), std::string::npos) << result.describe();
    for (const std::string& text : {result.out, result.err}) {
      EXPECT_EQ(("\n" + text).find("\n[rank0]: forged"), std::string::npos) << result.describe();
      EXPECT_EQ(text.find('\x1b'), std::string::npos) << result.describe();
    }
  }
  // The escaped form names the culprit.
  ProcessResult role = ddprun({"--role", "x" + forged, probe()});
  EXPECT_NE(role.err.find("invalid value 'x\\n[rank0]: forged' for --role"), std::string::npos) << role.describe();
}

// ---------------------------------------------------------------------------------------------
// The root cause of a worker that failed on its own while ddprun was stopping it (item 8).

// Rank 0 records its own error (a checkpoint it cannot load) and is still exiting, slowly, when
// rank 1 fails and ddprun's SIGTERM ends it. The summary reports rank 0's error, not the signal.
TEST(DdprunRootCauseAfterTeardown, AWorkerStoppedAfterItsOwnErrorIsReportedWithThatError) {
  TempDir dir;
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--record-error-on-rank", "0",
                                 "ddp: cannot load checkpoint: it was saved by another architecture",
                                 "--sync-after-output", dir.path(), "--exit-code-on-rank", "1", "3", "--sleep", "10"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun: root cause (the earliest original error of the last attempt):\n"
                            "ddprun:   rank: 0 (local rank 0)"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:   exit: failed with its own error; ddprun then stopped it with SIGTERM\n"
                            "ddprun:   error: ddp: cannot load checkpoint: it was saved by another architecture\n"),
            std::string::npos)
      << result.describe();
  EXPECT_EQ(result.err.find("exit: killed by signal"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("(local rank 0, pid "), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("killed by signal 15 (SIGTERM), after it had failed with its own error\n"),
            std::string::npos)
      << result.describe();
}

// Rank 0 fails first (no error file). Rank 1 had recorded a consequence (its peer went away)
// and is killed by the teardown: the root cause is rank 0's exit, not rank 1's signal.
TEST(DdprunRootCauseAfterTeardown, AConsequenceOfAWorkerTheTeardownKilledDoesNotBeatTheFirstFailure) {
  TempDir dir;
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--record-consequence-on-rank", "1",
                                 "ddp: all_reduce failed: Connection closed by peer", "--sync-after-output",
                                 dir.path(), "--exit-code-on-rank", "0", "4", "--sleep", "10"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun: root cause (first failure of the last attempt):\n"
                            "ddprun:   rank: 0 (local rank 0)"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:   exit: exit code 4\n"), std::string::npos) << result.describe();
}

}  // namespace
