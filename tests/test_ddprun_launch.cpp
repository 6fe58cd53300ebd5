// Tests of ddprun run as a real program against the launcher_probe worker: the workers'
// environment, their output, the log directory, the run id and the command line.
#include <regex>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

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
