// bench/gpt_bench under ddprun --fault-tolerance (what bench/churn_bench.py measures): three
// real worker processes; one is SIGKILLed mid-run; the survivors commit at two members, the
// restarted worker heals from a live one (the committed-samples counter travels with the
// state) and the job ends at the requested step with three members.
#include <dirent.h>
#include <signal.h>

#include <fstream>
#include <regex>
#include <thread>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The pid of ddprun's gpt_bench child whose RANK is `rank`, or -1.
int worker_with_rank(int ddprun_pid, int rank) {
  const std::string task_dir = "/proc/" + std::to_string(ddprun_pid) + "/task";
  DIR* dir = opendir(task_dir.c_str());
  if (dir == nullptr) return -1;
  std::vector<int> children;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::istringstream words(read_file(task_dir + "/" + entry->d_name + "/children"));
    for (int pid; words >> pid;) children.push_back(pid);
  }
  closedir(dir);
  for (int pid : children) {
    // Each variable between NULs; a leading one makes the first findable too.
    const std::string env_block = '\0' + read_file("/proc/" + std::to_string(pid) + "/environ");
    if (read_file("/proc/" + std::to_string(pid) + "/comm") == "gpt_bench\n" &&
        env_block.find(std::string("\0RANK=", 6) + std::to_string(rank) + '\0') != std::string::npos)
      return pid;
  }
  return -1;
}

struct StepLine {
  int64_t step, members, samples;
};

std::vector<StepLine> step_lines(const std::string& out, int rank) {
  static const std::regex kStep(R"(gpt_bench: step (\d+) members (\d+) samples (\d+) time)");
  const std::string prefix = "[rank" + std::to_string(rank) + "]: ";
  std::vector<StepLine> result;
  for (const std::string& line : lines_of(out)) {
    std::smatch m;
    if (line.rfind(prefix, 0) == 0 && std::regex_search(line, m, kStep))
      result.push_back({std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3])});
  }
  return result;
}

TEST(GptBenchFaultTolerance, AKilledWorkerCostsAStepAndHealsWhileTheOthersTrainOn) {
  constexpr int64_t kSteps = 300, kBatch = 2;
  ddp::testing::RunOptions options = run_options();
  options.timeout = 120s;
  ddp::testing::BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv({"--standalone", "--fault-tolerance", "--nproc-per-node", "3", "--max-restarts", "1",
                   bin_path("gpt_bench"), "--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2",
                   "--seq", "16", "--vocab", "64", "--batch", std::to_string(kBatch), "--threads", "1", "--warmup",
                   "0", "--steps", std::to_string(kSteps)}),
      options);
  // Kill rank 1 once it has committed some steps.
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (read_file(job.out_path).find("[rank1]: gpt_bench: step 30 ") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << read_file(job.out_path) << read_file(job.err_path);
    std::this_thread::sleep_for(20ms);
  }
  const int victim = worker_with_rank(job.pid, 1);
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ddp::testing::ProcessResult result = ddp::testing::wait_background(job, 90s);
  ASSERT_EQ(result.exit_code, 0) << result.describe();

  // Rank 0 trained on at two members, then at three again, to the last step.
  std::vector<StepLine> rank0 = step_lines(result.out, 0);
  ASSERT_FALSE(rank0.empty()) << result.describe();
  EXPECT_EQ(rank0.back().step, kSteps);
  auto at_two = std::find_if(rank0.begin(), rank0.end(), [](const StepLine& s) { return s.members == 2; });
  ASSERT_NE(at_two, rank0.end()) << "the survivors never committed without rank 1\n" << result.describe();
  EXPECT_NE(std::find_if(at_two, rank0.end(), [](const StepLine& s) { return s.members == 3; }), rank0.end())
      << "the restarted rank 1 never trained again\n" << result.describe();
  // Every committed step counted members x batch, nothing was counted twice.
  int64_t samples = 0;
  for (size_t i = 0; i < rank0.size(); ++i) {
    EXPECT_EQ(rank0[i].step, static_cast<int64_t>(i) + 1);
    samples += rank0[i].members * kBatch;
    EXPECT_EQ(rank0[i].samples, samples) << "at step " << rank0[i].step;
  }
  // The restarted rank 1 joined from a live peer: its counter continued the job's.
  EXPECT_NE(result.err.find("healed from"), std::string::npos) << result.describe();
  std::vector<StepLine> rank1 = step_lines(result.out, 1);
  ASSERT_FALSE(rank1.empty());
  EXPECT_EQ(rank1.back().step, kSteps);
  EXPECT_EQ(rank1.back().samples, rank0.back().samples);
  // The survivors' line and the stats at the end.
  EXPECT_NE(result.err.find("left (crash"), std::string::npos) << result.describe();
  static const std::regex kEnd(R"(\[rank0\]: gpt_bench: process fds \d+ threads \d+ rss_kb \d+ time [\d.]+ at_end stats )"
                               R"(\{"ft_committed_steps": (\d+), .*"ft_membership_changes": (\d+))");
  std::smatch end;
  ASSERT_TRUE(std::regex_search(result.out, end, kEnd)) << result.describe();
  EXPECT_EQ(std::stoll(end[1]), kSteps);
  EXPECT_GE(std::stoll(end[2]), 2);  // rank 1 left, and came back
}

}  // namespace
