// ddprun's per-rank output as torchrun writes it (--redirects, --tee, --local-ranks-filter,
// --duplicate-*-filters, the --log-dir layout) and its CPU binding (--cpu-bind cores,
// --numa-binding), issue 26 items 3 and 5; also the pure spec and share functions behind them.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_binding.h"
#include "std_spec.h"
#include "support/subprocess.h"

namespace {

using namespace std::chrono_literals;
using ddp::testing::bin_path;
using ddp::testing::ProcessResult;
using ddp::testing::RunOptions;
using ddprun::CpuList;

// ---------------------------------------------------------------------------------------------
// Stream specs

TEST(DdprunStdSpec, ABareValueAppliesToEveryLocalRank) {
  for (int rank : {0, 1, 7}) {
    EXPECT_EQ(ddprun::std_streams_for("0", rank), 0);
    EXPECT_EQ(ddprun::std_streams_for("2", rank), ddprun::kStdErr);
    EXPECT_EQ(ddprun::std_streams_for("3", rank), ddprun::kStdOut | ddprun::kStdErr);
  }
}

TEST(DdprunStdSpec, AMappingSetsEachListedRankAndLeavesTheOthersAtNone) {
  EXPECT_EQ(ddprun::std_streams_for("0:3,1:1", 0), 3);
  EXPECT_EQ(ddprun::std_streams_for("0:3,1:1", 1), 1);
  EXPECT_EQ(ddprun::std_streams_for("0:3,1:1", 2), 0);
  EXPECT_EQ(ddprun::std_streams_for("0:1,0:2", 0), 2) << "the last entry for a rank wins, as in torchrun";
  EXPECT_EQ(ddprun::std_streams_for("12:2", 12), 2) << "local ranks past 9";
}

TEST(DdprunStdSpec, MalformedSpecsAreRefusedWithWhatASpecLooksLike) {
  for (const std::string spec : {"", "4", "-1", "0:4", "0:1,", ",0:1", ":1", "a", "0-1", "0:1:2", "1,2", "0: 1", "03"}) {
    SCOPED_TRACE("'" + spec + "'");
    try {
      ddprun::check_std_spec(spec);
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("LOCAL_RANK:VALUE pairs such as 0:3,1:1"), std::string::npos)
          << error.what();
    }
  }
}

TEST(DdprunStdSpec, LocalRanksFilterIsAListOfRanks) {
  EXPECT_EQ(ddprun::parse_local_ranks("0,2"), (std::set<int>{0, 2}));
  EXPECT_EQ(ddprun::parse_local_ranks("3"), (std::set<int>{3}));
  EXPECT_TRUE(ddprun::parse_local_ranks("").empty());
  for (const std::string list : {"0,,1", "a", "-1", " 1", "1,"}) {
    SCOPED_TRACE("'" + list + "'");
    EXPECT_THROW(ddprun::parse_local_ranks(list), std::invalid_argument);
  }
}

// ---------------------------------------------------------------------------------------------
// CPU shares and NUMA choices

TEST(DdprunCpuBinding, CpuListsReadAndWriteAsTheKernelDoes) {
  EXPECT_EQ(ddprun::parse_cpu_list("0-3,8,10-11\n"), (CpuList{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(ddprun::format_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(ddprun::format_cpu_list({5}), "5");
  EXPECT_THROW(ddprun::parse_cpu_list("3-1"), std::invalid_argument);
  EXPECT_THROW(ddprun::parse_cpu_list("x"), std::invalid_argument);
}

TEST(DdprunCpuBinding, CoreSharesAreContiguousAndTheFirstRanksTakeTheRemainder) {
  EXPECT_EQ(ddprun::core_shares({0, 1, 2, 3, 4, 5, 6, 7}, 3),
            (std::vector<CpuList>{{0, 1, 2}, {3, 4, 5}, {6, 7}}));
  EXPECT_EQ(ddprun::core_shares({2, 3, 5, 7}, 2), (std::vector<CpuList>{{2, 3}, {5, 7}}))
      << "shares of the CPUs ddprun may use, not of CPU numbers";
  EXPECT_EQ(ddprun::core_shares({0, 1}, 1), (std::vector<CpuList>{{0, 1}}));
}

TEST(DdprunCpuBinding, MoreRanksThanCpusShareThemRoundRobin) {
  EXPECT_EQ(ddprun::core_shares({4, 5}, 5), (std::vector<CpuList>{{4}, {5}, {4}, {5}, {4}}));
}

// Two sockets with one NUMA node each; node n has physical cores 4n..4n+3, whose second
// hardware threads are CPUs 8+4n..; cores {0,1} and {2,3} of each node share a last-level cache.
// GPUs 0 and 1 sit on node 0, GPUs 2 and 3 on node 1.
ddprun::CpuTopology two_socket_topology() {
  ddprun::CpuTopology topology;
  for (int node = 0; node < 2; ++node) {
    for (int core = 4 * node; core < 4 * node + 4; ++core) {
      const int sibling = core + 8;
      topology.node_cpus[node].push_back(core);
      topology.cpu_socket[core] = topology.cpu_socket[sibling] = node;
      topology.cpu_siblings[core] = topology.cpu_siblings[sibling] = {core, sibling};
      const int complex = core - core % 2;
      topology.cpu_llc_peers[core] = topology.cpu_llc_peers[sibling] = {complex, complex + 1, complex + 8,
                                                                       complex + 9};
    }
    for (int core = 4 * node; core < 4 * node + 4; ++core) topology.node_cpus[node].push_back(core + 8);
    std::sort(topology.node_cpus[node].begin(), topology.node_cpus[node].end());
  }
  return topology;
}

TEST(DdprunCpuBinding, NumaModesPickTheCpusTorchPicks) {
  const ddprun::CpuTopology topology = two_socket_topology();
  const std::vector<int> gpu_nodes = {0, 0, 1, 1};
  CpuList all;
  for (int cpu = 0; cpu < 16; ++cpu) all.push_back(cpu);
  auto pick = [&](const std::string& mode, int gpu, const CpuList& allowed) {
    return ddprun::format_cpu_list(ddprun::numa_cpus_for_gpu(mode, gpu, gpu_nodes, topology, allowed));
  };
  EXPECT_EQ(pick("node", 0, all), "0-3,8-11");
  EXPECT_EQ(pick("node", 3, all), "4-7,12-15");
  EXPECT_EQ(pick("socket", 2, all), "4-7,12-15");
  // exclusive: node 1's four physical cores split between its two GPUs, both threads of each.
  EXPECT_EQ(pick("exclusive", 2, all), "4-5,12-13");
  EXPECT_EQ(pick("exclusive", 3, all), "6-7,14-15");
  EXPECT_EQ(pick("core-complex", 0, all), "0-1,8-9");
  EXPECT_EQ(pick("core-complex", 1, all), "2-3,10-11");
  // Only the CPUs ddprun may use count; the largest cache group comes first.
  EXPECT_EQ(pick("node", 0, {1, 2, 3}), "1-3");
  EXPECT_EQ(pick("core-complex", 0, {1, 2, 3}), "2-3");
}

TEST(DdprunCpuBinding, NumaModesRefuseWhatTheyCannotDo) {
  const ddprun::CpuTopology topology = two_socket_topology();
  try {
    ddprun::numa_cpus_for_gpu("node", 4, {0, 0, 1, 1}, topology, {0, 1, 2});
    ADD_FAILURE() << "a rank without a GPU was bound";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("only 4 GPU(s) are visible"), std::string::npos) << error.what();
  }
  // Four GPUs on one node of two physical cores (when only CPUs 0 and 1 are allowed).
  EXPECT_THROW(ddprun::numa_cpus_for_gpu("exclusive", 0, {0, 0, 0, 0}, topology, {0, 1}), std::runtime_error);
  EXPECT_THROW(ddprun::numa_cpus_for_gpu("node", 0, {0}, topology, {4, 5}), std::runtime_error)
      << "node 0 has none of the allowed CPUs";
}

// ---------------------------------------------------------------------------------------------
// The launcher

constexpr std::chrono::milliseconds kRunTimeout = 30s;

class TempDir {
 public:
  TempDir() : path_(ddp::testing::make_temp_dir("ddprun_output")) {}
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

ProcessResult run(const std::vector<std::string>& argv, std::vector<std::pair<std::string, std::string>> env = {}) {
  RunOptions options;
  options.env = std::move(env);
  options.env.emplace_back("OMP_NUM_THREADS", "1");  // no banner in the outputs compared here
  options.timeout = kRunTimeout;
  return ddp::testing::run_process(argv, options);
}

std::vector<std::string> ddprun_argv(std::vector<std::string> args) {
  args.insert(args.begin(), bin_path("ddprun"));
  return args;
}

// The worker of the torchrun comparison: rank-specific lines on both streams.
const std::vector<std::string> kShellWorker = {
    "sh", "-c", "echo \"out $LOCAL_RANK apple\"; echo \"err $LOCAL_RANK orange\" >&2; echo \"out2 $LOCAL_RANK\""};

// The lines of `text` not written by the launcher itself, sorted: the workers' lines of
// different ranks interleave in any order.
std::vector<std::string> worker_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) {
    const bool launcher_line = line.rfind("ddprun: ", 0) == 0 || line.find("torch.distributed") != std::string::npos ||
                               line.rfind("W1", 0) == 0 || line.find("*****") != std::string::npos ||
                               line.rfind("Setting OMP_NUM_THREADS", 0) == 0 || line.empty();
    if (!launcher_line) lines.push_back(line);
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

// Every file under the one run directory of a torchrun-style log dir: relative path -> contents.
// ddprun's own attempt_<A>/ beside it is left out.
std::map<std::string, std::string> run_dir_files(const std::string& log_dir) {
  std::map<std::string, std::string> files;
  std::vector<std::filesystem::path> run_dirs;
  for (const auto& entry : std::filesystem::directory_iterator(log_dir)) {
    if (entry.is_directory() && entry.path().filename().string().rfind("attempt_", 0) != 0) {
      run_dirs.push_back(entry.path());
    }
  }
  if (run_dirs.size() != 1) {
    ADD_FAILURE() << run_dirs.size() << " run directories in " << log_dir;
    return files;
  }
  for (const auto& entry : std::filesystem::recursive_directory_iterator(run_dirs[0])) {
    const std::string relative = std::filesystem::relative(entry.path(), run_dirs[0]).string();
    if (entry.is_directory()) {
      files[relative + "/"] = "";
    } else {
      std::ifstream file(entry.path());
      std::ostringstream contents;
      contents << file.rdbuf();
      files[relative] = contents.str();
    }
  }
  return files;
}

std::string read_text_file(const std::string& path) {
  std::ifstream file(path);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

const std::vector<std::string> kPerRankSpec = {"--redirects", "0:1", "--tee", "1:3", "--duplicate-stdout-filters",
                                               "apple", "--duplicate-stderr-filters", "orange"};

// What torch 2.11's torchrun writes for kPerRankSpec and kShellWorker (seen by running it).
const std::map<std::string, std::string> kTorchrunFiles = {
    {"attempt_0/", ""},
    {"attempt_0/0/", ""},
    {"attempt_0/0/stdout.log", "out 0 apple\nout2 0\n"},
    {"attempt_0/1/", ""},
    {"attempt_0/1/stdout.log", "out 1 apple\nout2 1\n"},
    {"attempt_0/1/stderr.log", "err 1 orange\n"},
    {"attempt_0/filtered_stdout.log", "[default1]:out 1 apple\n"},
    {"attempt_0/filtered_stderr.log", "[default1]:err 1 orange\n"},
};

TEST(DdprunOutput, PerRankRedirectsAndTeeWriteTheFilesAndConsoleLinesTorchrunWrites) {
  TempDir logs;
  std::vector<std::string> args = {"--no-prefix", "--nproc-per-node", "2", "--log-dir", logs.path()};
  args.insert(args.end(), kPerRankSpec.begin(), kPerRankSpec.end());
  args.insert(args.end(), kShellWorker.begin(), kShellWorker.end());
  ProcessResult result = run(ddprun_argv(args));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  // Rank 0's stdout is redirected (file only), its stderr untouched; rank 1's streams are teed.
  EXPECT_EQ(worker_lines(result.out), (std::vector<std::string>{"[default1]:out 1 apple", "[default1]:out2 1"}))
      << result.describe();
  EXPECT_EQ(worker_lines(result.err), (std::vector<std::string>{"[default1]:err 1 orange", "err 0 orange"}))
      << result.describe();
  EXPECT_EQ(run_dir_files(logs.path()), kTorchrunFiles);
  // ddprun's own per-rank log beside it still gets both streams of every rank.
  for (const std::string rank : {"0", "1"}) {
    const std::string log = read_text_file(logs.path() + "/attempt_0/rank_" + rank + ".log");
    EXPECT_EQ(worker_lines(log), worker_lines("out " + rank + " apple\nout2 " + rank + "\nerr " + rank + " orange\n"))
        << log;
  }
}

TEST(DdprunOutput, TorchrunItselfWritesWhatTheExpectationsSay) {
  const std::string python = DDP_PYTHON;
  if (python.empty() || !std::filesystem::exists(python)) GTEST_SKIP() << "no Python with torch (DDP_PYTHON)";
  TempDir logs;
  std::vector<std::string> argv = {python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "2", "--no-python", "--log-dir", logs.path()};
  argv.insert(argv.end(), kPerRankSpec.begin(), kPerRankSpec.end());
  argv.insert(argv.end(), kShellWorker.begin(), kShellWorker.end());
  ProcessResult result = run(argv);
  if (result.exit_code != 0 && result.err.find("No module named") != std::string::npos) {
    GTEST_SKIP() << "torch is not importable: " << result.err;
  }
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(worker_lines(result.out), (std::vector<std::string>{"[default1]:out 1 apple", "[default1]:out2 1"}))
      << result.describe();
  EXPECT_EQ(worker_lines(result.err), (std::vector<std::string>{"[default1]:err 1 orange", "err 0 orange"}))
      << result.describe();
  EXPECT_EQ(run_dir_files(logs.path()), kTorchrunFiles);
}

TEST(DdprunOutput, RedirectedStreamsLeaveTheConsoleAndDefaultToATemporaryLogDir) {
  ProcessResult result = run(ddprun_argv({"--nproc-per-node", "2", "--redirects", "3", bin_path("launcher_probe"),
                                          "--out", "hello out", "--err", "hello err"}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out, "") << result.describe();
  EXPECT_EQ(worker_lines(result.err), std::vector<std::string>{}) << result.describe();
  // As torchrun, without --log-dir the files go to a fresh torchelastic_* directory, named.
  const std::string marker = "redirected and teed output goes to ";
  const size_t at = result.err.find(marker);
  ASSERT_NE(at, std::string::npos) << result.describe();
  std::string dir = result.err.substr(at + marker.size());
  dir = dir.substr(0, dir.find("/attempt_<A>"));
  EXPECT_NE(dir.find("/torchelastic_"), std::string::npos) << dir;
  EXPECT_EQ(read_text_file(dir + "/attempt_0/1/stdout.log"), "hello out\n");
  EXPECT_EQ(read_text_file(dir + "/attempt_0/1/stderr.log"), "hello err\n");
  std::error_code ignored;
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path(), ignored);
}

TEST(DdprunOutput, LocalRanksFilterHidesOtherRanksOnTheConsoleButNotInTheFiles) {
  TempDir logs;
  ProcessResult result = run(ddprun_argv({"--nproc-per-node", "3", "--log-dir", logs.path(), "--tee", "3",
                                          "--local-ranks-filter", "1", "--duplicate-stdout-filters", "out",
                                          kShellWorker[0], kShellWorker[1], kShellWorker[2]}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(worker_lines(result.out), (std::vector<std::string>{"[default1]:out 1 apple", "[default1]:out2 1"}))
      << result.describe();
  EXPECT_EQ(worker_lines(result.err), (std::vector<std::string>{"[default1]:err 1 orange"})) << result.describe();
  const auto files = run_dir_files(logs.path());
  for (int rank : {0, 1, 2}) {
    const std::string r = std::to_string(rank);
    EXPECT_EQ(files.at("attempt_0/" + r + "/stdout.log"), "out " + r + " apple\nout2 " + r + "\n");
    EXPECT_EQ(files.at("attempt_0/" + r + "/stderr.log"), "err " + r + " orange\n");
  }
  // torchrun's filtered file follows the console: the filtered-out ranks are not in it.
  EXPECT_EQ(files.at("attempt_0/filtered_stdout.log"), "[default1]:out 1 apple\n[default1]:out2 1\n");
  EXPECT_EQ(files.count("attempt_0/filtered_stderr.log"), 0u);

  // Without tee or redirects, the other ranks' console output is gone too.
  result = run(ddprun_argv({"--nproc-per-node", "2", "--local-ranks-filter", "0", kShellWorker[0], kShellWorker[1],
                            kShellWorker[2]}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(worker_lines(result.out), (std::vector<std::string>{"[rank0]: out 0 apple", "[rank0]: out2 0"}))
      << result.describe();
}

TEST(DdprunOutput, DuplicateFiltersCopyMatchingTeedLinesOfEveryRank) {
  TempDir logs;
  ProcessResult result =
      run(ddprun_argv({"--nproc-per-node", "2", "--log-dir", logs.path(), "--tee", "3",
                       "--duplicate-stdout-filters", "out2,nothing", "--duplicate-stderr-filters", "orange",
                       kShellWorker[0], kShellWorker[1], kShellWorker[2]}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  const auto files = run_dir_files(logs.path());
  std::vector<std::string> filtered_out = worker_lines(files.at("attempt_0/filtered_stdout.log"));
  EXPECT_EQ(filtered_out, (std::vector<std::string>{"[default0]:out2 0", "[default1]:out2 1"}));
  EXPECT_EQ(worker_lines(files.at("attempt_0/filtered_stderr.log")),
            (std::vector<std::string>{"[default0]:err 0 orange", "[default1]:err 1 orange"}));
}

TEST(DdprunOutput, MalformedSpecsAreUsageErrors) {
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--redirects", "0:4"}, {"--tee", "1:4"}, {"--local-ranks-filter", "a,b"}}) {
    SCOPED_TRACE(flag + " " + value);
    ProcessResult result = run(ddprun_argv({flag, value, "true"}));
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find("'" + value + "' for " + flag), std::string::npos) << result.describe();
  }
}

// ---------------------------------------------------------------------------------------------
// CPU binding

// "cpus: LIST" lines of the probe's --print-cpus, by the rank prefix ddprun put before them.
std::map<int, std::string> cpus_by_rank(const std::string& out) {
  std::map<int, std::string> result;
  std::istringstream stream(out);
  for (std::string line; std::getline(stream, line);) {
    const size_t at = line.find("]: cpus: ");
    if (line.rfind("[rank", 0) != 0 || at == std::string::npos) continue;
    result[std::stoi(line.substr(5, at - 5))] = line.substr(at + 9);
  }
  return result;
}

TEST(DdprunCpuBind, CoresGivesEachWorkerItsShareOfDdprunsCpus) {
  const CpuList allowed = ddprun::allowed_cpus();
  ASSERT_FALSE(allowed.empty());
  for (int nproc : {1, 2, 3}) {
    SCOPED_TRACE("nproc " + std::to_string(nproc));
    RunOptions options;
    options.timeout = kRunTimeout;
    options.unset_env = {"OMP_NUM_THREADS"};
    ProcessResult result = ddp::testing::run_process(
        ddprun_argv({"--cpu-bind", "cores", "--nproc-per-node", std::to_string(nproc), bin_path("launcher_probe"),
                     "--print-cpus", "--print-env"}),
        options);
    ASSERT_EQ(result.exit_code, 0) << result.describe();
    const std::vector<CpuList> expected = ddprun::core_shares(allowed, nproc);
    const std::map<int, std::string> seen = cpus_by_rank(result.out);
    ASSERT_EQ(seen.size(), static_cast<size_t>(nproc)) << result.describe();
    for (int rank = 0; rank < nproc; ++rank) {
      EXPECT_EQ(seen.at(rank), ddprun::format_cpu_list(expected[rank])) << result.describe();
      // OMP_NUM_THREADS unset: each worker gets as many threads as it has CPUs.
      EXPECT_NE(result.out.find("[rank" + std::to_string(rank) + "]: RANK=" + std::to_string(rank) +
                                " LOCAL_RANK=" + std::to_string(rank)),
                std::string::npos);
    }
    for (int rank = 0; rank < nproc; ++rank) {
      const std::string env_start = "[rank" + std::to_string(rank) + "]: RANK=";
      const size_t line = result.out.find(env_start);
      ASSERT_NE(line, std::string::npos);
      const std::string env_line = result.out.substr(line, result.out.find('\n', line) - line);
      EXPECT_NE(env_line.find(" OMP_NUM_THREADS=" + std::to_string(expected[rank].size()) + " "), std::string::npos)
          << env_line;
    }
    EXPECT_NE(result.err.find("ddprun: --cpu-bind cores: local rank 0 on CPUs " +
                              ddprun::format_cpu_list(expected[0])),
              std::string::npos)
        << result.describe();
    const bool shared = static_cast<size_t>(nproc) > allowed.size();
    EXPECT_EQ(result.err.find("round-robin") != std::string::npos, shared) << result.describe();
  }
}

TEST(DdprunCpuBind, WithoutItWorkersKeepDdprunsCpus) {
  ProcessResult result = run(ddprun_argv({"--nproc-per-node", "2", bin_path("launcher_probe"), "--print-cpus"}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  const std::string all = ddprun::format_cpu_list(ddprun::allowed_cpus());
  EXPECT_EQ(cpus_by_rank(result.out), (std::map<int, std::string>{{0, all}, {1, all}})) << result.describe();
}

TEST(DdprunCpuBind, NumaBindingWithoutGpusOrNumaSaysSoOnceAndStillRuns) {
  const ddprun::CpuTopology topology = ddprun::read_cpu_topology();
  const bool gpus = std::filesystem::exists("/proc/driver/nvidia/gpus") &&
                    !std::filesystem::is_empty("/proc/driver/nvidia/gpus");
  if (gpus && topology.node_cpus.size() > 1) GTEST_SKIP() << "this machine can really bind near its GPUs";
  ProcessResult result =
      run(ddprun_argv({"--numa-binding", "node", "--nproc-per-node", "2", bin_path("launcher_probe"), "--print-cpus"}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  const std::string note = "ddprun: --numa-binding node does nothing here: ";
  const size_t at = result.err.find(note);
  ASSERT_NE(at, std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find(note, at + 1), std::string::npos) << "said more than once: " << result.describe();
  const std::string all = ddprun::format_cpu_list(ddprun::allowed_cpus());
  EXPECT_EQ(cpus_by_rank(result.out), (std::map<int, std::string>{{0, all}, {1, all}})) << result.describe();
}

TEST(DdprunCpuBind, BadModesAreUsageErrors) {
  ProcessResult result = run(ddprun_argv({"--cpu-bind", "sockets", "true"}));
  EXPECT_EQ(result.exit_code, 2) << result.describe();
  EXPECT_NE(result.err.find("'sockets' for --cpu-bind"), std::string::npos) << result.describe();
  result = run(ddprun_argv({"--cpu-bind", "cores", "--numa-binding", "node", "true"}));
  EXPECT_EQ(result.exit_code, 2) << result.describe();
  EXPECT_NE(result.err.find("give one of them"), std::string::npos) << result.describe();
}

// ---------------------------------------------------------------------------------------------
// Issue 34, item 5: a --log-dir others can write into. Whoever can plant an entry named like a
// file the job writes must not make the job write anywhere else.

size_t count_of_text(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

// A log directory beside a victim file and a victim directory that the job must never touch.
struct SharedLogDir {
  TempDir dir;
  std::string logs = dir.path() + "/logs";
  std::string victim = dir.path() + "/victim.txt";
  std::string victim_dir = dir.path() + "/victim_dir";

  SharedLogDir() {
    std::filesystem::create_directories(logs + "/attempt_0");
    std::filesystem::create_directories(victim_dir);
    std::ofstream(victim) << "precious\n";
    std::ofstream(victim_dir + "/keep.txt") << "kept\n";
  }
  void expect_victims_untouched() const {
    EXPECT_EQ(read_text_file(victim), "precious\n");
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(victim_dir)) {
      names.push_back(entry.path().filename().string());
    }
    EXPECT_EQ(names, std::vector<std::string>{"keep.txt"});
    EXPECT_EQ(read_text_file(victim_dir + "/keep.txt"), "kept\n");
  }
  ProcessResult run_job() const {
    return run(ddprun_argv({"--nproc-per-node", "2", "--log-dir", logs, bin_path("launcher_probe"), "--say",
                            "written by the job"}));
  }
};

TEST(DdprunLogDir, LinksPlantedWhereTheJobWritesAreRefusedByNameAndTheirTargetsKept) {
  for (const std::string planted :
       {"attempt_0/rank_0.log", "attempt_0/rank_1.log", "attempt_0/rank_1.error.json", "attempt_0"}) {
    SCOPED_TRACE(planted);
    SharedLogDir shared;
    const std::string link = shared.logs + "/" + planted;
    const bool is_directory = planted == "attempt_0";
    if (is_directory) std::filesystem::remove(link);
    // A dangling link too: O_CREAT alone would create its target.
    const std::string target = is_directory ? shared.victim_dir : planted == "attempt_0/rank_1.log"
                                                                     ? shared.dir.path() + "/created-through-link"
                                                                     : shared.victim;
    ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
    const ProcessResult result = shared.run_job();
    EXPECT_EQ(result.exit_code, 1) << result.describe();
    EXPECT_NE(result.err.find("refusing to use '" + link + "': it is a symbolic link"), std::string::npos)
        << result.describe();
    EXPECT_EQ(result.out.find("written by the job"), std::string::npos) << "no worker starts: " << result.describe();
    shared.expect_victims_untouched();
    EXPECT_FALSE(std::filesystem::exists(shared.dir.path() + "/created-through-link"));
  }
}

TEST(DdprunLogDir, AFifoAHardLinkOrAnotherUsersDirectoryIsRefusedWithoutBlocking) {
  {
    SharedLogDir shared;
    const std::string fifo = shared.logs + "/attempt_0/rank_0.log";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0666), 0);
    const ProcessResult result = shared.run_job();
    EXPECT_FALSE(result.timed_out) << result.describe();
    EXPECT_EQ(result.exit_code, 1) << result.describe();
    EXPECT_NE(result.err.find("refusing to use '" + fifo + "': it is a FIFO"), std::string::npos) << result.describe();
  }
  {
    SharedLogDir shared;
    const std::string hard_link = shared.logs + "/attempt_0/rank_1.log";
    ASSERT_EQ(::link(shared.victim.c_str(), hard_link.c_str()), 0);
    const ProcessResult result = shared.run_job();
    EXPECT_EQ(result.exit_code, 1) << result.describe();
    EXPECT_NE(result.err.find("refusing to use '" + hard_link + "': it is a file with 2 hard links"),
              std::string::npos)
        << result.describe();
    shared.expect_victims_untouched();
  }
  if (::geteuid() == 0) {
    // A directory someone else made, where they may plant files while the job runs.
    SharedLogDir shared;
    const std::string attempt = shared.logs + "/attempt_0";
    ASSERT_EQ(::chown(attempt.c_str(), 65534, 65534), 0);
    const ProcessResult result = shared.run_job();
    EXPECT_EQ(result.exit_code, 1) << result.describe();
    EXPECT_NE(result.err.find("refusing to use '" + attempt + "': it is a directory of user id 65534"),
              std::string::npos)
        << result.describe();
  }
  {
    SharedLogDir shared;
    const std::string attempt = shared.logs + "/attempt_0";
    ASSERT_EQ(::chmod(attempt.c_str(), 0777), 0);
    const ProcessResult result = shared.run_job();
    EXPECT_EQ(result.exit_code, 1) << result.describe();
    EXPECT_NE(result.err.find("chmod go-w '" + attempt + "'"), std::string::npos) << result.describe();
  }
}

TEST(DdprunLogDir, ARunAfterAnotherInTheSameLogDirReplacesItsLogs) {
  SharedLogDir shared;
  ASSERT_EQ(::chmod((shared.logs + "/attempt_0").c_str(), 0755), 0);
  std::ofstream(shared.logs + "/attempt_0/rank_0.log") << "an earlier run's much longer log\n";
  const ProcessResult result = shared.run_job();
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(read_text_file(shared.logs + "/attempt_0/rank_0.log"), "written by the job\n");
  EXPECT_EQ(read_text_file(shared.logs + "/attempt_0/rank_1.log"), "written by the job\n");
}

// A log directory others may write into without the sticky bit lets them rename attempt_<A>
// away mid-job; ddprun cannot prevent that, so it says so once, and is quiet with the bit set.
TEST(DdprunLogDir, ALogDirOthersCanWriteWithoutTheStickyBitIsWarnedAbout) {
  SharedLogDir shared;
  const std::string warning = "ddprun: warning: other users may write into the log directory '" + shared.logs + "'";
  ASSERT_EQ(::chmod(shared.logs.c_str(), 0777), 0);
  ProcessResult result = shared.run_job();
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(count_of_text(result.err, warning), 1u) << result.describe();
  ASSERT_EQ(::chmod(shared.logs.c_str(), 01777), 0);
  result = shared.run_job();
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(count_of_text(result.err, warning), 0u) << result.describe();
}

// Issue 34, item 15: a log disk that fills up. The job's output goes on to the console, ddprun
// says once which file it could not write and why, and the failure summary quotes the lines
// that no log holds instead of only pointing at a log that ends early.
TEST(DdprunLogDir, AFullLogDiskIsReportedOnceAndTheSummaryQuotesWhatTheLogsMiss) {
  TempDir dir;
  const std::string full = dir.path() + "/full";
  std::filesystem::create_directories(full);
  if (::mount("tmpfs", full.c_str(), "tmpfs", 0, "size=64k,mode=0755") != 0) {
    GTEST_SKIP() << "cannot mount a 64 KiB tmpfs to fill (" << std::strerror(errno)
                 << "); this test needs root (CAP_SYS_ADMIN)";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{full};
  // ~130 KB of stdout per rank, then two stderr lines (the probe's own, then the last words).
  const ProcessResult result =
      run(ddprun_argv({"--nproc-per-node", "2", "--log-dir", full, bin_path("launcher_probe"), "--lines", "400",
                       "--err", "the last words of the worker", "--exit-code-on-rank", "0", "3"}));
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_EQ(count_of_text(result.err, "ddprun: warning: cannot write the log file '" + full + "/attempt_0/rank_"), 1u)
      << result.describe();
  EXPECT_NE(result.err.find(": No space left on device; the workers' output goes on to the console"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("[rank0]: the last words of the worker"), std::string::npos)
      << "the console still gets every line: " << result.describe();
  EXPECT_NE(result.err.find("ddprun:   log: " + full + "/attempt_0/rank_0.log (incomplete)"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("ddprun:     rank 0 stderr line\nddprun:     the last words of the worker\n"),
            std::string::npos)
      << result.describe();
}

}  // namespace
