// examples/lm under ddprun at 2 ranks: it trains with DDP and with
// Streaming DiLoCo, logging a held-out loss per --eval-every steps that
// falls, and refuses DiLoCo's flags without --diloco.

#include <support/launch.h>
#include <support/subprocess.h>

#include <gtest/gtest.h>

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

TEST(LmExample, DiLoCoFlagsWithoutDiLoCoAreAUsageError) {
  auto r = run_process({ddp::testing::bin_path("lm_train"), "--streaming", "2"}, one_rank({}));
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_NE(r.err.find("need --diloco H"), std::string::npos) << r.err;
}
