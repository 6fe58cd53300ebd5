// Tests of the ddprun launcher, run as a real program against the launcher_probe worker.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <set>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/rdzv_agents.h"
#include "support/subprocess.h"

namespace {

using namespace std::chrono_literals;
using ddp::testing::BackgroundProcess;
using ddp::testing::bin_path;
using ddp::testing::ProcessResult;
using ddp::testing::RunOptions;

// Every run here should take a second or two; this only bounds a broken launcher.
constexpr std::chrono::milliseconds kRunTimeout = 20s;

using EnvAssignments = std::vector<std::pair<std::string, std::string>>;

RunOptions run_options(EnvAssignments env = {}, std::vector<std::string> unset_env = {}) {
  RunOptions options;
  options.env = std::move(env);
  options.unset_env = std::move(unset_env);
  options.timeout = kRunTimeout;
  return options;
}

std::string probe() { return bin_path("launcher_probe"); }

std::vector<std::string> ddprun_argv(const std::vector<std::string>& args) {
  std::vector<std::string> argv{bin_path("ddprun")};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

ProcessResult ddprun(const std::vector<std::string>& args,
                     const RunOptions& options = run_options()) {
  return ddp::testing::run_process(ddprun_argv(args), options);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

// Lines "[rankR]: KEY=VALUE KEY=VALUE ..." printed by --print-env, by rank.
std::map<int, std::map<std::string, std::string>> env_by_rank(const std::string& out) {
  static const std::regex kEnvLine(R"(^\[rank(\d+)\]: (RANK=.*)$)");
  std::map<int, std::map<std::string, std::string>> result;
  for (const std::string& line : lines_of(out)) {
    std::smatch match;
    if (!std::regex_match(line, match, kEnvLine)) continue;
    auto& variables = result[std::stoi(match[1])];
    std::istringstream words(match[2].str());
    for (std::string word; words >> word;) {
      size_t equals = word.find('=');
      variables[word.substr(0, equals)] = word.substr(equals + 1);
    }
  }
  return result;
}

// Every --print-env line in order of appearance (ranks repeat when workers are restarted).
std::vector<std::map<std::string, std::string>> env_lines(const std::string& out) {
  static const std::regex kEnvLine(R"(^(?:\[rank\d+\]: )?(RANK=.*)$)");
  std::vector<std::map<std::string, std::string>> result;
  for (const std::string& line : lines_of(out)) {
    std::smatch match;
    if (!std::regex_match(line, match, kEnvLine)) continue;
    auto& variables = result.emplace_back();
    std::istringstream words(match[1].str());
    for (std::string word; words >> word;) {
      size_t equals = word.find('=');
      variables[word.substr(0, equals)] = word.substr(equals + 1);
    }
  }
  return result;
}

// How many workers printed their environment on each attempt: attempt -> count.
std::map<int, int> workers_per_attempt(const std::string& out) {
  std::map<int, int> counts;
  for (auto& vars : env_lines(out)) ++counts[std::stoi(vars["TORCHELASTIC_RESTART_COUNT"])];
  return counts;
}

using ddp::testing::read_text_file;

std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

size_t count_of(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

class TempDir {
 public:
  TempDir() : path_(ddp::testing::make_temp_dir("ddprun_test")) {}
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Waits for a pid file written by the probe; returns its pid, or -1 after the timeout.
int wait_for_pid_file(const std::string& path, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::ifstream file(path);
    int pid = -1;
    if (file >> pid) return pid;
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(10ms);
  }
}

bool wait_until_dead(int pid, std::chrono::milliseconds timeout = 3s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (ddp::testing::process_alive(pid)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Environment

TEST(DdprunEnvironment, SecondNodeOfTwoGetsTorchrunVariables) {
  const int port = ddp::testing::free_port();
  ProcessResult result =
      ddprun({"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
              "127.0.0.1", "--master-port", std::to_string(port), probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();

  auto env = env_by_rank(result.out);
  ASSERT_EQ(env.size(), 2u) << result.describe();
  for (int local_rank = 0; local_rank < 2; ++local_rank) {
    const int rank = 2 + local_rank;
    SCOPED_TRACE("rank " + std::to_string(rank));
    ASSERT_TRUE(env.count(rank)) << result.describe();
    auto& vars = env[rank];
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(local_rank));
    EXPECT_EQ(vars["WORLD_SIZE"], "4");
    EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["GROUP_RANK"], "1");
    EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(vars["ROLE_WORLD_SIZE"], "4");
    EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(vars["MASTER_PORT"], std::to_string(port));
    EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(vars["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(vars["TORCHELASTIC_RUN_ID"], "none");
  }
}

TEST(DdprunEnvironment, DefaultsAreOneLocalWorkerOnPort29500) {
  ProcessResult result = ddprun({probe(), "--print-env"}, run_options({}, {"OMP_NUM_THREADS"}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto env = env_by_rank(result.out);
  ASSERT_EQ(env.size(), 1u) << result.describe();
  auto& vars = env[0];
  EXPECT_EQ(vars["RANK"], "0");
  EXPECT_EQ(vars["LOCAL_RANK"], "0");
  EXPECT_EQ(vars["WORLD_SIZE"], "1");
  EXPECT_EQ(vars["GROUP_RANK"], "0");
  EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
  EXPECT_EQ(vars["MASTER_PORT"], "29500");
  // A single worker cannot oversubscribe the CPUs, so OMP_NUM_THREADS is not invented.
  EXPECT_EQ(vars["OMP_NUM_THREADS"], "<unset>");
  EXPECT_EQ(result.err.find("OMP_NUM_THREADS"), std::string::npos) << result.describe();
}

TEST(DdprunEnvironment, FlagSpellingsWithUnderscoresAndEqualsAreAccepted) {
  ProcessResult result = ddprun({"--nproc_per_node=3", "--master_port=12345",
                                 "--master-addr=10.1.2.3", "--nnodes=1", probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto env = env_by_rank(result.out);
  ASSERT_EQ(env.size(), 3u) << result.describe();
  EXPECT_EQ(env[2]["WORLD_SIZE"], "3");
  EXPECT_EQ(env[2]["MASTER_PORT"], "12345");
  EXPECT_EQ(env[2]["MASTER_ADDR"], "10.1.2.3");
}

TEST(DdprunEnvironment, NprocCpuStartsOneWorkerPerOnlineCpu) {
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  ProcessResult result = ddprun({"--nproc-per-node", "cpu", probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto env = env_by_rank(result.out);
  EXPECT_EQ(static_cast<long>(env.size()), cpus) << result.describe();
  EXPECT_EQ(env[0]["LOCAL_WORLD_SIZE"], std::to_string(cpus));
}

TEST(DdprunEnvironment, NprocAutoMeansOnePerCpuWithoutGpus) {
  if (std::filesystem::exists("/proc/driver/nvidia/gpus")) {
    GTEST_SKIP() << "this machine has NVIDIA GPUs; 'auto' counts them instead of CPUs";
  }
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  ProcessResult result = ddprun({"--nproc-per-node", "auto", probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(static_cast<long>(env_by_rank(result.out).size()), cpus) << result.describe();
}

TEST(DdprunEnvironment, StandaloneUsesLoopbackAndAFreshFreePort) {
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE("standalone run " + std::to_string(run));
    ProcessResult result = ddprun({"--standalone", "--master-addr", "10.9.8.7", "--master-port",
                                   "1", "--nproc-per-node", "2", probe(), "--print-env"});
    ASSERT_EQ(result.exit_code, 0) << result.describe();
    auto env = env_by_rank(result.out);
    ASSERT_EQ(env.size(), 2u) << result.describe();
    EXPECT_EQ(env[0]["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env[1]["MASTER_PORT"], env[0]["MASTER_PORT"]);
    const int port = std::stoi(env[0]["MASTER_PORT"]);
    EXPECT_GE(port, 1024) << "an ephemeral port, not the --master-port that was overridden";
    EXPECT_LE(port, 65535);
  }
}

TEST(DdprunEnvironment, OmpNumThreadsIsOneForSeveralWorkersWhenUnset) {
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--print-env"},
                                run_options({}, {"OMP_NUM_THREADS"}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto env = env_by_rank(result.out);
  ASSERT_EQ(env.size(), 2u) << result.describe();
  EXPECT_EQ(env[0]["OMP_NUM_THREADS"], "1");
  EXPECT_EQ(env[1]["OMP_NUM_THREADS"], "1");
  EXPECT_EQ(count_of(result.err, "ddprun: OMP_NUM_THREADS"), 1u)
      << "one notice, " << result.describe();
}

TEST(DdprunEnvironment, OmpNumThreadsIsLeftAloneWhenSet) {
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--print-env"},
                                run_options({{"OMP_NUM_THREADS", "7"}}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto env = env_by_rank(result.out);
  ASSERT_EQ(env.size(), 2u) << result.describe();
  EXPECT_EQ(env[0]["OMP_NUM_THREADS"], "7");
  EXPECT_EQ(env[1]["OMP_NUM_THREADS"], "7");
  EXPECT_EQ(result.err.find("OMP_NUM_THREADS"), std::string::npos) << result.describe();
}

TEST(DdprunEnvironment, ProgramArgumentsPassThroughUntouched) {
  ProcessResult result = ddprun({"--no-prefix", probe(), "--print-args", "--nproc-per-node", "5",
                                 "--help", "--", "-h", "a b"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out, "arg: --nproc-per-node\narg: 5\narg: --help\narg: --\narg: -h\narg: a b\n")
      << result.describe();

  // "--" ends ddprun's options even when PROGRAM itself looks like one.
  result = ddprun({"--no-prefix", "--", probe(), "--print-args", "--standalone"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out, "arg: --standalone\n") << result.describe();
}

// ---------------------------------------------------------------------------------------------
// Output

TEST(DdprunOutput, PrefixesStdoutAndStderrLinesWithTheGlobalRank) {
  ProcessResult result = ddprun({"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                                 probe(), "--lines", "2", "--say", "bye"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  for (int rank : {2, 3}) {
    const std::string prefix = "[rank" + std::to_string(rank) + "]: ";
    const std::string r = std::to_string(rank);
    EXPECT_NE(result.out.find(prefix + "rank " + r + " line 0 xxx"), std::string::npos)
        << result.describe();
    EXPECT_NE(result.out.find(prefix + "rank " + r + " line 1 xxx"), std::string::npos);
    EXPECT_NE(result.out.find(prefix + "bye\n"), std::string::npos);
    EXPECT_NE(result.err.find(prefix + "rank " + r + " stderr line\n"), std::string::npos)
        << result.describe();
    // stderr lines stay on stderr and stdout lines on stdout.
    EXPECT_EQ(result.out.find("stderr line"), std::string::npos);
    EXPECT_EQ(result.err.find(" line 0 "), std::string::npos);
  }
}

TEST(DdprunOutput, LinesOfManyWorkersNeverInterleave) {
  constexpr int kWorkers = 4;
  constexpr int kLines = 2000;
  ProcessResult result = ddprun(
      {"--nproc-per-node", std::to_string(kWorkers), probe(), "--lines", std::to_string(kLines)});
  ASSERT_EQ(result.exit_code, 0) << result.describe();

  static const std::regex kLine(R"(^\[rank(\d)\]: rank (\d) line (\d+) x{300}$)");
  std::vector<int> next_line(kWorkers, 0);
  int bad_lines = 0;
  for (const std::string& line : lines_of(result.out)) {
    std::smatch match;
    if (!std::regex_match(line, match, kLine) || match[1] != match[2]) {
      if (++bad_lines <= 3) ADD_FAILURE() << "mangled line: '" << line.substr(0, 200) << "'";
      continue;
    }
    const int rank = std::stoi(match[1]);
    // Each worker's lines arrive complete and in order.
    EXPECT_EQ(std::stoi(match[3]), next_line[rank]) << "rank " << rank;
    next_line[rank] = std::stoi(match[3]) + 1;
  }
  EXPECT_EQ(bad_lines, 0);
  for (int rank = 0; rank < kWorkers; ++rank) EXPECT_EQ(next_line[rank], kLines) << "rank " << rank;
}

TEST(DdprunOutput, PartialLastLineIsFlushedWithANewline) {
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--partial-line"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.out.find("[rank0]: rank 0 partial line without newline\n"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.out.find("[rank1]: rank 1 partial line without newline\n"), std::string::npos)
      << result.describe();
}

TEST(DdprunOutput, NoPrefixForwardsLinesUnchanged) {
  ProcessResult result = ddprun({"--no-prefix", probe(), "--lines", "1", "--say", "plain"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out, "rank 0 line 0 " + std::string(300, 'x') + "\nplain\n")
      << result.describe();
  EXPECT_EQ(result.err, "rank 0 stderr line\n") << result.describe();
}

// ---------------------------------------------------------------------------------------------
// Failures

TEST(DdprunFailure, FailingWorkerStopsTheOthersQuickly) {
  TempDir pids;
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--pid-file", pids.path(),
                                 "--barrier", "--exit-code-on-rank", "0", "3", "--sleep", "60"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(result.seconds, 10.0) << "rank 1 sleeps 60 s; it must have been stopped";

  const int failed_pid = wait_for_pid_file(pids.file("pid.0"), 0ms);
  const int sleeper_pid = wait_for_pid_file(pids.file("pid.1"), 0ms);
  ASSERT_GT(failed_pid, 0);
  ASSERT_GT(sleeper_pid, 0);
  EXPECT_NE(result.err.find("rank 0 (local rank 0, pid " + std::to_string(failed_pid) +
                            ") failed: exit code 3"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(
      result.err.find("stopped rank 1 (local rank 1, pid " + std::to_string(sleeper_pid) + ")"),
      std::string::npos)
      << result.describe();
  EXPECT_TRUE(wait_until_dead(sleeper_pid)) << "rank 1 outlived ddprun";
}

TEST(DdprunFailure, WorkerKilledBySegfaultIsReportedByName) {
  ProcessResult result = ddprun(
      {"--nproc-per-node", "2", probe(), "--signal-on-rank", "1", "SIGSEGV", "--sleep", "60"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(result.seconds, 10.0);
  EXPECT_NE(result.err.find("rank 1 (local rank 1, pid "), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("failed: killed by signal 11 (SIGSEGV)"), std::string::npos)
      << result.describe();
}

TEST(DdprunFailure, WorkerKilledBySigkillIsReportedByName) {
  ProcessResult result =
      ddprun({"--nproc-per-node", "2", probe(), "--signal-on-rank", "0", "KILL", "--sleep", "60"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(result.seconds, 10.0);
  EXPECT_NE(result.err.find("rank 0 (local rank 0, pid "), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("failed: killed by signal 9 (SIGKILL)"), std::string::npos)
      << result.describe();
}

TEST(DdprunFailure, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir pids;
  ProcessResult result =
      ddprun({"--nproc-per-node", "2", "--grace-period", "1", probe(), "--pid-file", pids.path(),
              "--barrier", "--ignore-term", "--exit-code-on-rank", "0", "5", "--sleep", "60"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_GE(result.seconds, 1.0) << "SIGKILL came before the grace period was over";
  EXPECT_LT(result.seconds, 8.0) << result.describe();
  EXPECT_NE(result.err.find("failed: exit code 5"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("stopped rank 1"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("killed with SIGKILL"), std::string::npos) << result.describe();
  const int stubborn_pid = wait_for_pid_file(pids.file("pid.1"), 0ms);
  ASSERT_GT(stubborn_pid, 0);
  EXPECT_TRUE(wait_until_dead(stubborn_pid));
}

TEST(DdprunFailure, EarlySuccessfulExitDoesNotStopTheOthers) {
  ProcessResult result = ddprun({"--nproc-per-node", "2", probe(), "--exit-code-on-rank", "0", "0",
                                 "--sleep", "0.5", "--say", "still here"});
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.out.find("[rank1]: still here\n"), std::string::npos) << result.describe();
  EXPECT_EQ(result.out.find("[rank0]: still here"), std::string::npos) << result.describe();
}

TEST(DdprunFailure, GrandchildrenAreKilledWhenTheJobFails) {
  TempDir pids;
  ProcessResult result =
      ddprun({"--nproc-per-node", "2", probe(), "--spawn-grandchild", pids.path(), "--pid-file",
              pids.path(), "--barrier", "--exit-code-on-rank", "0", "4", "--sleep", "60"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(result.seconds, 10.0) << result.describe();
  for (int rank : {0, 1}) {
    const int grandchild = wait_for_pid_file(pids.file("grandchild." + std::to_string(rank)), 0ms);
    ASSERT_GT(grandchild, 0);
    EXPECT_TRUE(wait_until_dead(grandchild)) << "grandchild of rank " << rank << " survived";
  }
}

TEST(DdprunFailure, GrandchildrenDoNotOutliveASuccessfulJob) {
  TempDir pids;
  ProcessResult result = ddprun({probe(), "--spawn-grandchild", pids.path(), "--say", "done"});
  // The grandchild holds the worker's stdout open; ddprun must not wait out its 300 s sleep.
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_LT(result.seconds, 10.0) << result.describe();
  EXPECT_NE(result.out.find("[rank0]: done\n"), std::string::npos) << result.describe();
  const int grandchild = wait_for_pid_file(pids.file("grandchild.0"), 0ms);
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(wait_until_dead(grandchild));
}

TEST(DdprunFailure, MissingProgramIsReportedClearly) {
  for (const std::string program : {"/nonexistent/ddp_program", "ddp_no_such_program_on_path"}) {
    SCOPED_TRACE(program);
    ProcessResult result = ddprun({"--nproc-per-node", "2", program, "--flag"});
    EXPECT_EQ(result.exit_code, 1) << result.describe();
    EXPECT_NE(result.err.find("cannot execute '" + program + "': No such file or directory"),
              std::string::npos)
        << result.describe();
    EXPECT_NE(result.err.find("failed: exit code 127"), std::string::npos) << result.describe();
    EXPECT_LT(result.seconds, 10.0);
  }
}

// ---------------------------------------------------------------------------------------------
// Restarts

TEST(DdprunRestart, FailureOnTheFirstAttemptIsRestartedAndTheJobSucceeds) {
  TempDir sync;
  ProcessResult result = ddprun({"--standalone", "--max-restarts", "2", "--nproc-per-node", "2",
                                 probe(), "--print-env", "--sync-after-output", sync.path(),
                                 "--on-attempt", "0", "--exit-code-on-rank", "1", "3"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.err.find("ddprun: rank 1 failed (exit code 3); restarting all workers "
                            "(restart 1 of 2)\n"),
            std::string::npos)
      << result.describe();
  EXPECT_EQ(result.err.find("root cause"), std::string::npos) << result.describe();

  auto lines = env_lines(result.out);
  ASSERT_EQ(lines.size(), 4u) << "two ranks, two attempts: " << result.describe();
  EXPECT_EQ(workers_per_attempt(result.out), (std::map<int, int>{{0, 2}, {1, 2}}))
      << result.describe();
  for (auto& vars : lines) {
    EXPECT_EQ(vars["TORCHELASTIC_MAX_RESTARTS"], "2");
    // Nothing else took the port, so the restarted workers meet where the first ones did.
    EXPECT_EQ(vars["MASTER_PORT"], lines.front()["MASTER_PORT"]) << result.describe();
  }
}

TEST(DdprunRestart, SuccessfulJobIsNotRestarted) {
  ProcessResult result = ddprun({"--max-restarts", "2", probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(workers_per_attempt(result.out), (std::map<int, int>{{0, 1}})) << result.describe();
  EXPECT_EQ(result.err.find("restart"), std::string::npos) << result.describe();
}

TEST(DdprunRestart, SigkilledWorkerIsRestarted) {
  ProcessResult result =
      ddprun({"--max-restarts", "1", "--nproc-per-node", "2", probe(), "--print-env",
              "--on-attempt", "0", "--signal-on-rank", "0", "KILL", "--sleep", "0.2"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.err.find("ddprun: rank 0 failed (killed by signal 9 (SIGKILL)); restarting all "
                            "workers (restart 1 of 1)\n"),
            std::string::npos)
      << result.describe();
  EXPECT_EQ(workers_per_attempt(result.out)[1], 2) << result.describe();
}

TEST(DdprunRestart, ExhaustedRestartsEndWithARootCauseSummary) {
  TempDir sync;
  ProcessResult result =
      ddprun({"--max-restarts", "2", "--nproc-per-node", "2", probe(), "--print-env",
              "--sync-after-output", sync.path(), "--err", "an earlier stderr line", "--err",
              "error: deliberate failure on rank 1", "--out", "a later stdout line",
              "--exit-code-on-rank", "1", "3", "--sleep", "60"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(result.seconds, 10.0) << result.describe();
  EXPECT_EQ(workers_per_attempt(result.out), (std::map<int, int>{{0, 2}, {1, 2}, {2, 2}}))
      << "exactly three attempts: " << result.describe();
  EXPECT_EQ(count_of(result.err, "restarting all workers"), 2u) << result.describe();
  EXPECT_NE(result.err.find("(restart 2 of 2)"), std::string::npos) << result.describe();

  // The block is the last thing ddprun says; pid is that of rank 1 in the last attempt.
  static const std::regex kSummary(
      "ddprun: job failed after 2 restart\\(s\\)\n"
      "ddprun: root cause \\(first failure of the last attempt\\):\n"
      "ddprun:   rank: 1 \\(local rank 1\\), host: (.+), pid: (\\d+)\n"
      "ddprun:   exit: exit code 3\n"
      "ddprun:   last error line: error: deliberate failure on rank 1\n$");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.err, match, kSummary)) << result.describe();
  EXPECT_EQ(match[1].str(), hostname());
  const std::string pid = match[2].str();
  const size_t last_failure = result.err.rfind("ddprun: rank 1 (local rank 1, pid ");
  ASSERT_NE(last_failure, std::string::npos);
  EXPECT_EQ(result.err.compare(last_failure, 34 + pid.size() + 1,
                               "ddprun: rank 1 (local rank 1, pid " + pid + ")"),
            0)
      << result.describe();
}

TEST(DdprunRestart, SummaryFallsBackToStdoutThenToNoOutput) {
  ProcessResult result =
      ddprun({probe(), "--out", "only stdout here", "--exit-code-on-rank", "0", "4"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun: job failed after 0 restart(s)\n"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:   last error line: only stdout here\n"), std::string::npos)
      << result.describe();

  result = ddprun({probe(), "--signal-on-rank", "0", "SEGV"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun:   exit: killed by signal 11 (SIGSEGV)\n"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:   last error line: (no output)\n"), std::string::npos)
      << result.describe();
}

// ---------------------------------------------------------------------------------------------
// Log directory

// --redirects 3 keeps the workers off the console, as with torchrun; --log-dir alone no longer
// does (torchrun shows the output then), but rank_R.log gets it all the same.
TEST(DdprunLogDir, EachWorkerWritesItsOwnUnprefixedLogAndTheConsoleIsQuiet) {
  TempDir logs;
  const std::string dir = logs.file("run/logs");  // created with its parents
  ProcessResult result = ddprun(
      {"--log-dir", dir, "--redirects", "3", "--nproc-per-node", "2", probe(), "--lines", "3", "--err", "to stderr"},
      run_options({{"OMP_NUM_THREADS", "1"}}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out, "") << result.describe();
  EXPECT_EQ(result.err, "") << result.describe();
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const std::string r = std::to_string(rank);
    const std::string log = read_text_file(dir + "/attempt_0/rank_" + r + ".log");
    // Lines of one stream keep their order; the two streams' lines interleave as they came.
    std::vector<std::string> stdout_lines, stderr_lines;
    for (const std::string& line : lines_of(log)) {
      (line.find(" line ") != std::string::npos && line.find("stderr") == std::string::npos
           ? stdout_lines
           : stderr_lines)
          .push_back(line);
    }
    const std::string xs(300, 'x');
    EXPECT_EQ(stdout_lines, (std::vector<std::string>{"rank " + r + " line 0 " + xs,
                                                      "rank " + r + " line 1 " + xs,
                                                      "rank " + r + " line 2 " + xs}))
        << log;
    EXPECT_EQ(stderr_lines, (std::vector<std::string>{"rank " + r + " stderr line", "to stderr"}))
        << log;
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/attempt_1"));
}

TEST(DdprunLogDir, TeeAlsoShowsPrefixedLinesOnTheConsole) {
  TempDir logs;
  ProcessResult result = ddprun(
      {"--log-dir", logs.path(), "--tee", probe(), "--out", "hello out", "--err", "hello err"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  // Teed lines carry torchrun's prefix (test_ddprun_output.cpp compares with torchrun itself).
  EXPECT_EQ(result.out, "[default0]:hello out\n") << result.describe();
  EXPECT_EQ(result.err, "[default0]:hello err\n") << result.describe();
  const std::string log = read_text_file(logs.file("attempt_0/rank_0.log"));
  EXPECT_NE(log.find("hello out\n"), std::string::npos) << log;
  EXPECT_NE(log.find("hello err\n"), std::string::npos) << log;
  EXPECT_EQ(log.find("[rank"), std::string::npos) << log;

  // torchrun's numbered form: 2 tees stderr only; stdout, neither teed nor redirected, goes to
  // the console as without --log-dir.
  result = ddprun({"--log-dir", logs.path(), "--tee", "2", probe(), "--out", "hello out", "--err",
                   "hello err"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out, "[rank0]: hello out\n") << result.describe();
  EXPECT_EQ(result.err, "[default0]:hello err\n") << result.describe();
}

TEST(DdprunLogDir, RestartedAttemptsLogIntoTheirOwnDirectory) {
  TempDir logs;
  ProcessResult result =
      ddprun({"--log-dir", logs.path(), "--redirects", "3", "--max-restarts", "1", "--nproc-per-node", "2", probe(),
              "--print-env", "--err", "error: rank failed", "--sync-after-output", logs.path(),
              "--on-attempt", "0", "--exit-code-on-rank", "1", "3"},
             run_options({{"OMP_NUM_THREADS", "1"}}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  // ddprun's own messages still reach the console, the workers' lines do not.
  EXPECT_NE(result.err.find("restarting all workers (restart 1 of 1)"), std::string::npos)
      << result.describe();
  EXPECT_EQ(result.out, "") << result.describe();
  EXPECT_EQ(result.err.find("[rank"), std::string::npos) << result.describe();
  for (int attempt : {0, 1}) {
    for (int rank : {0, 1}) {
      const std::string path = logs.file("attempt_" + std::to_string(attempt) + "/rank_" +
                                         std::to_string(rank) + ".log");
      SCOPED_TRACE(path);
      const std::string log = read_text_file(path);
      auto env = env_lines(log);
      ASSERT_EQ(env.size(), 1u) << log;
      EXPECT_EQ(env[0]["RANK"], std::to_string(rank));
      EXPECT_EQ(env[0]["TORCHELASTIC_RESTART_COUNT"], std::to_string(attempt));
      EXPECT_NE(log.find("error: rank failed\n"), std::string::npos) << log;
    }
  }
}

TEST(DdprunLogDir, FinalFailureNamesTheLogFile) {
  TempDir logs;
  ProcessResult result = ddprun({"--log-dir", logs.path(), "--nproc-per-node", "2", probe(),
                                 "--err", "error: oops", "--exit-code-on-rank", "0", "5"},
                                run_options({{"OMP_NUM_THREADS", "1"}}));
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun:   last error line: error: oops\n"
                            "ddprun:   log: " +
                            logs.file("attempt_0/rank_0.log") + "\n"),
            std::string::npos)
      << result.describe();
}

TEST(DdprunLogDir, UnusableLogDirIsAnErrorBeforeAnyWorkerStarts) {
  TempDir scratch;
  std::ofstream(scratch.file("a_file")) << "not a directory\n";
  const std::string bad = scratch.file("a_file/logs");
  ProcessResult result =
      ddprun({"--log-dir", bad, probe(), "--pid-file", scratch.path(), "--print-env"});
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("cannot create log directory '" + bad + "'"), std::string::npos)
      << result.describe();
  EXPECT_EQ(lines_of(result.err).size(), 1u) << result.describe();
  EXPECT_FALSE(std::filesystem::exists(scratch.file("pid.0"))) << "a worker was started";
}

// ---------------------------------------------------------------------------------------------
// Run id

TEST(DdprunRunId, RdzvIdReachesTheWorkersUnderBothNames) {
  for (const std::vector<std::string>& flag : std::vector<std::vector<std::string>>{
           {"--rdzv-id", "job-42"}, {"--rdzv_id=job-42"}, {"--run-id", "job-42"}}) {
    SCOPED_TRACE(flag.front());
    std::vector<std::string> args = flag;
    args.insert(args.end(), {probe(), "--print-env"});
    ProcessResult result = ddprun(args);
    ASSERT_EQ(result.exit_code, 0) << result.describe();
    auto env = env_by_rank(result.out);
    EXPECT_EQ(env[0]["TORCHELASTIC_RUN_ID"], "job-42") << result.describe();
    EXPECT_EQ(env[0]["DDP_RUN_ID"], "job-42") << result.describe();
  }
  ProcessResult result = ddprun({probe(), "--print-env"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(env_by_rank(result.out)[0]["DDP_RUN_ID"], "none") << result.describe();
}

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

// ---------------------------------------------------------------------------------------------
// Command line

TEST(DdprunCommandLine, BadFlagsExitWithCodeTwoAndNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;  // must appear in the error message
  };
  const std::vector<Case> cases = {
      {{"--nproc-per-node", "0", "true"}, "'0' for --nproc-per-node"},
      {{"--nproc-per-node", "two", "true"}, "'two' for --nproc-per-node"},
      {{"--nproc_per_node=-3", "true"}, "'-3' for --nproc_per_node"},
      {{"--nnodes", "0", "true"}, "'0' for --nnodes"},
      {{"--nnodes", "2", "--node-rank", "2", "true"}, "'2' for --node-rank"},
      {{"--node-rank", "-1", "true"}, "'-1' for --node-rank"},
      {{"--master-port", "70000", "true"}, "'70000' for --master-port"},
      {{"--master-port", "0", "true"}, "'0' for --master-port"},
      {{"--master-port", "12ab", "true"}, "'12ab' for --master-port"},
      {{"--grace-period", "soon", "true"}, "'soon' for --grace-period"},
      {{"--bogus", "true"}, "'--bogus'"},
      {{"-x", "true"}, "'-x'"},
      {{"--nnodes"}, "--nnodes needs a value"},
      {{"--master-addr", "--standalone", "true"}, "--master-addr needs a value"},
      {{"--standalone=yes", "true"}, "--standalone"},
      {{"--standalone", "--nnodes", "2", "true"}, "--standalone"},
      {{"--max-restarts", "-1", "true"}, "'-1' for --max-restarts"},
      {{"--max-restarts", "many", "true"}, "'many' for --max-restarts"},
      {{"--max_restarts=2.5", "true"}, "'2.5' for --max_restarts"},
      {{"--max-restarts"}, "--max-restarts needs a value"},
      {{"--tee=4", "true"}, "'4' for --tee"},
      {{"--log-dir=", "true"}, "'' for --log-dir"},
      {{"--rdzv-id=", "true"}, "'' for --rdzv-id"},
      {{}, "PROGRAM"},
      {{"--nproc-per-node", "2"}, "PROGRAM"},
  };
  for (const Case& c : cases) {
    std::string joined;
    for (const std::string& arg : c.args) joined += " " + arg;
    SCOPED_TRACE("ddprun" + joined);
    ProcessResult result = ddprun(c.args);
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find(c.expected), std::string::npos) << result.describe();
    EXPECT_NE(result.err.find("see ddprun --help"), std::string::npos) << result.describe();
    EXPECT_EQ(lines_of(result.err).size(), 1u) << "a one-line error, " << result.describe();
    EXPECT_EQ(result.out, "") << result.describe();
  }
}

TEST(DdprunCommandLine, HelpListsEveryFlagWithItsDefault) {
  for (const std::string flag : {"--help", "-h"}) {
    SCOPED_TRACE(flag);
    ProcessResult result = ddprun({flag});
    ASSERT_EQ(result.exit_code, 0) << result.describe();
    const std::string& help = result.out;
    EXPECT_NE(help.find("Usage: ddprun [options] PROGRAM [ARGS...]"), std::string::npos) << help;
    const std::vector<std::pair<std::string, std::string>> flags_and_defaults = {
        {"--nproc-per-node", "(default: 1)"},  {"--nnodes", "(default: 1)"},
        {"--node-rank", "(default: 0)"},       {"--master-addr", "(default: 127.0.0.1)"},
        {"--master-port", "(default: 29500)"}, {"--standalone", "(default: off)"},
        {"--grace-period", "(default: 5)"},    {"--no-prefix", "(default: prefix)"},
        {"--max-restarts", "(default: 0)"},    {"--log-dir", "(default: none"},
        {"--tee", "(default: off)"},           {"--rdzv-id", "(default: none)"},
    };
    for (const auto& [name, default_text] : flags_and_defaults) {
      const size_t at = help.find("  " + name + " ");
      ASSERT_NE(at, std::string::npos) << name << " missing from\n" << help;
      // The default follows the flag's description, before the next flag's entry.
      const size_t next_flag = help.find("\n  -", at + 1);
      EXPECT_LT(help.find(default_text, at), next_flag) << name << " lacks " << default_text;
    }
    EXPECT_NE(help.find("-h, --help"), std::string::npos);
  }
  // --help wins over the program that follows it; nothing is started.
  ProcessResult result = ddprun({"--help", probe(), "--print-env"});
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.out.find("RANK="), std::string::npos) << result.describe();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Root cause from the workers' error files (TORCHELASTIC_ERROR_FILE), issue 12 item 5

namespace {

// A worker written in sh: `script` runs with $RANK and $TORCHELASTIC_ERROR_FILE set.
std::vector<std::string> sh_worker(int nproc, const std::string& script) {
  return {"--nproc-per-node", std::to_string(nproc), "/bin/sh", "-c", script};
}

// sh that writes a ddp-style record: MESSAGE, TIMESTAMP_NS, CONSEQUENCE (true|false).
std::string write_record(const std::string& message, const std::string& ns, const std::string& consequence) {
  return "printf '%s' '{\"message\": {\"message\": \"" + message +
         "\", \"extraInfo\": {\"py_callstack\": \"\", \"timestamp\": \"1\"}}, \"ddp\": {\"timestamp_ns\": " + ns +
         ", \"consequence\": " + consequence + "}}' > \"$TORCHELASTIC_ERROR_FILE\"";
}

TEST(DdprunRootCause, EachWorkerGetsItsOwnErrorFileWhichIsRemovedAfterwards) {
  ProcessResult result = ddprun(sh_worker(2, "echo \"EF=$TORCHELASTIC_ERROR_FILE\""));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  std::smatch a, b;
  ASSERT_TRUE(std::regex_search(result.out, a, std::regex(R"(\[rank0\]: EF=(\S+))"))) << result.describe();
  ASSERT_TRUE(std::regex_search(result.out, b, std::regex(R"(\[rank1\]: EF=(\S+))"))) << result.describe();
  EXPECT_NE(a[1].str(), b[1].str());
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(a[1].str()).parent_path()))
      << "the private error directory outlived ddprun";
}

// Rank 0's original error (disk full) is recorded first, but rank 0 exits last; rank 1 fails
// first with the consequence (a closed connection). The summary names rank 0's error.
TEST(DdprunRootCause, TheEarliestOriginalErrorWinsOverAnEarlierExitingConsequence) {
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then " + write_record("ddp: writing snapshot failed: No space left on device", "1000", "false") +
      "; echo 'error: No space left on device' >&2; sleep 1; exit 1; else sleep 0.2; " +
      write_record("ddp: all_reduce failed on rank 1 of 2: Connection closed by peer", "2000", "true") +
      "; echo 'error: Connection closed by peer' >&2; exit 1; fi";
  ProcessResult result = ddprun(sh_worker(2, script));
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  // Rank 1 did fail first...
  EXPECT_LT(result.err.find("ddprun: rank 1 (local rank 1"), result.err.find("root cause")) << result.describe();
  // ...but the root cause is rank 0's.
  EXPECT_NE(result.err.find("ddprun: root cause (the earliest original error of the last attempt):\n"
                            "ddprun:   rank: 0 (local rank 0)"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:   error: ddp: writing snapshot failed: No space left on device\n"),
            std::string::npos)
      << result.describe();
}

// A consequence recorded earlier than an original error still ranks below it (rank 0 fails
// first, with the earliest record, a consequence); among originals the earliest wins, whatever
// the exit order (ranks 1 and 2 are stopped by ddprun after recording); torchrun's own layout (seconds, no "ddp" part) is
// read too, and its message is classified by its text.
TEST(DdprunRootCause, OriginalsRankAboveConsequencesThenByTime) {
  const std::string torchrun_style =
      "printf '%s' '{\"message\": {\"message\": \"RuntimeError: Connection reset by peer\", \"extraInfo\": "
      "{\"py_callstack\": \"Traceback\", \"timestamp\": \"5\"}}}' > \"$TORCHELASTIC_ERROR_FILE\"";
  const std::string script =
      "case \"$RANK\" in 0) sleep 0.5; " + torchrun_style + "; exit 1;; 1) " +
      write_record("bad init on rank 1", "9000000000", "false") + "; sleep 5; exit 2;; 2) " +
      write_record("second original", "9500000000", "false") + "; sleep 5; exit 3;; esac";
  ProcessResult result = ddprun(sh_worker(3, script));
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun:   rank: 1 (local rank 1)"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("ddprun:   error: bad init on rank 1\n"), std::string::npos) << result.describe();
}

TEST(DdprunRootCause, OnlyConsequencesAreReportedAsSuch) {
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then " + write_record("ddp: rank 1 waited 5 s, but not all of them joined", "10", "true") +
      "; exit 1; else sleep 0.3; exit 1; fi";
  ProcessResult result = ddprun(sh_worker(2, script));
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("every recorded error is a consequence of another failure"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:   error (a consequence): ddp: rank 1 waited 5 s"), std::string::npos)
      << result.describe();
}

// Issue 11: without an error file, the summary quotes the worker's error line, not the last
// frame of the backtrace printed after it.
TEST(DdprunRootCause, WithoutAnErrorFileTheErrorLineBeatsStackFrames) {
  const std::string script =
      "echo 'error: the real message' >&2; "
      "echo 'Exception raised from foo at bar.cpp:12 (most recent call first):' >&2; "
      "echo 'frame #0: c10::Error::Error(...) + 0x98 (0x7f in /lib/libc10.so)' >&2; "
      "echo 'frame #15: <unknown function> + 0x6e81 (0x55 in ./prog)' >&2; exit 1";
  ProcessResult result = ddprun(sh_worker(1, script));
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("ddprun:   last error line: error: the real message\n"), std::string::npos)
      << result.describe();
  EXPECT_EQ(result.err.find("last error line: frame #"), std::string::npos) << result.describe();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Agent rendezvous across nodes (--rdzv-backend c10d), issue 13: several ddprun on one host,
// each a "node" with its own 127.0.0.x address, meeting in the store one of them hosts.

namespace {

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
