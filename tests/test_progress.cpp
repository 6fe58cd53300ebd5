#include <ddp/progress.h>

#include <gtest/gtest.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>

#include "common/duration_text.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

namespace fs = std::filesystem;

namespace {

std::string contents_of(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) text.append(buffer, n);
  return text;
}

TEST(Progress, FormatsDurations) {
  EXPECT_EQ(ddp::detail::format_duration(0), "0:00");
  EXPECT_EQ(ddp::detail::format_duration(65), "1:05");
  EXPECT_EQ(ddp::detail::format_duration(3723), "1:02:03");
  EXPECT_EQ(ddp::detail::format_duration(-1), "?");
}

TEST(Progress, RendersEpochStepLossThroughputAndEta) {
  std::FILE* out = std::tmpfile();
  ddp::ProgressLine progress(10, 4, ddp::ProgressOptions().stream(out).terminal(false));
  progress.start_epoch(2);
  progress.step(0.5, 64);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  progress.step(0.25, 64);
  std::string line = progress.render();
  EXPECT_TRUE(std::regex_search(line, std::regex(R"(^epoch 3/10 \| step 2/4 \| loss 0\.3750 \| [0-9]+ samples/s \| ETA [0-9]+:[0-9]{2}$)")))
      << line;
  // 30 steps remain after 2 took ~20 ms: the ETA is positive and finite.
  EXPECT_GT(progress.eta_seconds(), 0);
  EXPECT_LT(progress.eta_seconds(), 60);
  EXPECT_GT(progress.samples_per_second(), 0);
  std::fclose(out);
}

TEST(Progress, PlainLinesWhenNotATerminal) {
  std::FILE* out = std::tmpfile();
  {
    ddp::ProgressLine progress(2, 2, ddp::ProgressOptions().stream(out).terminal(false).plain_interval(std::chrono::milliseconds(0)));
    for (int e = 0; e < 2; ++e) {
      progress.start_epoch(e);
      progress.step(1.0, 8);
      progress.step(1.0, 8);
      progress.end_epoch();
    }
  }
  std::string text = contents_of(out);
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 1/2 | step 1/2"), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 2/2 | step 2/2"), std::string::npos) << text;
  std::fclose(out);
}

TEST(Progress, RedrawsInPlaceOnATerminal) {
  std::FILE* out = std::tmpfile();
  {
    ddp::ProgressLine progress(1, 3, ddp::ProgressOptions().stream(out).terminal(true).redraw_interval(std::chrono::milliseconds(0)));
    progress.start_epoch(0);
    progress.step(1.0, 8);
    progress.step(1.0, 8);
    progress.end_epoch();
  }
  std::string text = contents_of(out);
  EXPECT_NE(text.find("\r\033[2Kepoch 1/1 | step 1/3"), std::string::npos) << text;
  EXPECT_NE(text.find("\r\033[2Kepoch 1/1 | step 2/3"), std::string::npos) << text;
  EXPECT_EQ(text.find('\n'), std::string::npos) << "the line is redrawn, never scrolled";
  std::fclose(out);
}

TEST(Progress, DisabledPrintsNothing) {
  std::FILE* out = std::tmpfile();
  {
    ddp::ProgressLine progress(1, 1, ddp::ProgressOptions().stream(out).enabled(false).plain_interval(std::chrono::milliseconds(0)));
    progress.start_epoch(0);
    progress.step(1.0, 1);
    progress.end_epoch();
  }
  EXPECT_EQ(contents_of(out), "");
  std::fclose(out);
}

TEST(Metrics, OneJsonObjectPerLine) {
  auto dir = ddp::testing::make_temp_dir();
  {
    ddp::MetricsWriter metrics(dir + "/m.jsonl");
    metrics.write({0, 1.5, std::nullopt, 100.0, 0.5});
    metrics.write({1, 0.75, 0.96875, 200.0, 1.0});
  }
  std::ifstream in(dir + "/m.jsonl");
  std::string first, second, third;
  std::getline(in, first);
  std::getline(in, second);
  EXPECT_FALSE(std::getline(in, third));
  EXPECT_EQ(first, R"({"epoch": 0, "loss": 1.5, "test_accuracy": null, "samples_per_s": 100, "wall_time_s": 0.5})");
  EXPECT_EQ(second, R"({"epoch": 1, "loss": 0.75, "test_accuracy": 0.96875, "samples_per_s": 200, "wall_time_s": 1})");
  auto message = ddp::testing::error_of([] { ddp::MetricsWriter bad("/nonexistent/dir/m.jsonl"); });
  EXPECT_NE(message.find("/nonexistent/dir/m.jsonl"), std::string::npos) << message;
  fs::remove_all(dir);
}

TEST(Metrics, ALinkPlantedAtTheMetricsFileIsRefusedByName) {
  auto dir = ddp::testing::make_temp_dir();
  const std::string victim = dir + "/victim.txt";
  std::ofstream(victim) << "the user's own words";
  fs::create_symlink(victim, dir + "/m.jsonl");
  for (bool append : {false, true}) {
    auto message = ddp::testing::error_of([&] { ddp::MetricsWriter metrics(dir + "/m.jsonl", append); });
    EXPECT_NE(message.find("symbolic link"), std::string::npos) << message;
    EXPECT_NE(message.find(dir + "/m.jsonl"), std::string::npos) << message;
  }
  std::ifstream in(victim);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "the user's own words");
  fs::remove_all(dir);
}

TEST(Plot, DrawsCurvesOfSeveralMetricsFiles) {
  auto dir = ddp::testing::make_temp_dir();
  for (int run = 0; run < 2; ++run) {
    ddp::MetricsWriter metrics(dir + "/run" + std::to_string(run) + ".jsonl");
    for (int e = 0; e < 5; ++e) metrics.write({e, 1.0 / (e + 1 + run), 0.5 + 0.1 * e, 100.0, e * 1.0});
  }
  for (const char* name : {"curves.png", "curves.svg"}) {
    auto r = ddp::testing::run_process({DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tools/plot/ddp_plot.py",
                                        dir + "/run0.jsonl", dir + "/run1.jsonl", "-o", dir + "/" + name});
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_GT(fs::file_size(dir + "/" + name), 1000u) << name;
  }
  std::ofstream(dir + "/bad.jsonl") << "{\"epoch\": 0}\n";
  auto bad = ddp::testing::run_process({DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tools/plot/ddp_plot.py",
                                        dir + "/bad.jsonl", "-o", dir + "/x.png"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("bad.jsonl:1: needs 'epoch' and 'loss'"), std::string::npos) << bad.describe();
  fs::remove_all(dir);
}

}  // namespace
