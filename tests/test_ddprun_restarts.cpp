// Tests of failing workers: how ddprun stops the others, restarts the job, and picks the root
// cause from the workers' error files.
#include <regex>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

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
// Root cause from the workers' error files (TORCHELASTIC_ERROR_FILE), issue 12 item 5


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
