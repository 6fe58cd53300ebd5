// The digits example end to end: a convnet trained on 2 ranks, its checkpoint
// read back by Python, its metrics file, resuming, and its error messages.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <filesystem>
#include <fstream>
#include <regex>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

std::string shipped_data() { return std::string(DDP_SOURCE_DIR) + "/examples/digits/data/digits.csv.gz"; }

// The final "Test accuracy: X" line of rank 0 (not the per-epoch ones).
std::string final_accuracy(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("(^|\n)(\\[rank0\\]: )?Test accuracy: ([0-9.]+)"))) return "";
  return m[3];
}

// "Epoch E, Loss: X, Test accuracy: Y" lines, without the rank prefix.
std::vector<std::string> epoch_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::regex pattern("Epoch [0-9]+, Loss: [0-9.]+, Test accuracy: [0-9.]+");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), pattern); it != std::sregex_iterator(); ++it) {
    lines.push_back(it->str());
  }
  return lines;
}

// Python rebuilds the net, loads model_final.pt with torch.load's defaults
// (weights_only), remakes the same split and scores it: the C++ figure must
// come out again.
const char* kPythonEvaluate = R"(
import gzip, sys, torch
from torch import nn
state = torch.load(sys.argv[1])
for name, tensor in state.items():
    print(name, list(tensor.shape), str(tensor.dtype))
with gzip.open(sys.argv[2], "rt") as f:
    rows = [[float(v) for v in line.split(",")] for line in f if line.strip()]
data = torch.tensor(rows)
images, labels = data[:, :64].reshape(-1, 1, 8, 8) / 16, data[:, 64].long()
order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(42))
test = order[: -(-len(rows) * 2 // 10)]
net = nn.Sequential()
net.add_module("conv1", nn.Conv2d(1, 16, 3, padding=1))
net.add_module("relu1", nn.ReLU())
net.add_module("conv2", nn.Conv2d(16, 32, 3, padding=1))
net.add_module("relu2", nn.ReLU())
net.add_module("pool", nn.MaxPool2d(2))
net.add_module("flatten", nn.Flatten())
net.add_module("fc1", nn.Linear(512, 64))
net.add_module("relu3", nn.ReLU())
net.add_module("fc2", nn.Linear(64, 10))
net.load_state_dict(state)
with torch.no_grad():
    correct = (net(images[test]).argmax(1) == labels[test]).double().mean().item()
print("accuracy %.4f" % correct)
)";

TEST(Digits, TwoRanksReachTheAccuracyAndPythonReadsTheModel) {
  auto dir = make_temp_dir("digits");
  auto r = run_process(under_ddprun(2, "digits_ddp", {"30", "10", "--checkpoint-dir", dir}),
                       one_rank({}, std::chrono::seconds(90)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  std::string accuracy = final_accuracy(r.out);
  ASSERT_FALSE(accuracy.empty()) << r.out;
  EXPECT_GE(std::stod(accuracy), 0.97) << r.out;
  // Rank 0 alone logs: one line per epoch, all prefixed [rank0].
  EXPECT_EQ(epoch_lines(r.out).size(), 30u) << r.out;
  EXPECT_EQ(count_of(r.out, "[rank0]: Epoch 29, Loss: "), 1) << r.out;
  EXPECT_EQ(count_of(r.out, "[rank1]:"), 0) << r.out;
  for (const char* name : {"model_0.pt", "model_10.pt", "model_20.pt", "model_final.pt", "snapshot_20.pt",
                           "snapshot_29.pt"}) {
    EXPECT_TRUE(fs::exists(dir + "/" + name)) << name;
  }
  EXPECT_FALSE(fs::exists(dir + "/model_29.pt"));

  auto py = run_process({DDP_PYTHON, "-c", kPythonEvaluate, dir + "/model_final.pt", shipped_data()});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_EQ(py.out,
            "conv1.weight [16, 1, 3, 3] torch.float32\n"
            "conv1.bias [16] torch.float32\n"
            "conv2.weight [32, 16, 3, 3] torch.float32\n"
            "conv2.bias [32] torch.float32\n"
            "fc1.weight [64, 512] torch.float32\n"
            "fc1.bias [64] torch.float32\n"
            "fc2.weight [10, 64] torch.float32\n"
            "fc2.bias [10] torch.float32\n"
            "accuracy " + accuracy + "\n");
  fs::remove_all(dir);
}

// Checks the --metrics file of one run and prints each row as digits_ddp
// prints its epoch lines.
const char* kPythonCheckMetrics = R"(
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert rows, "no rows"
for row in rows:
    assert set(row) == {"epoch", "loss", "test_accuracy", "samples_per_s", "wall_time_s"}, row
    assert 0 <= row["test_accuracy"] <= 1 and row["loss"] > 0 and row["samples_per_s"] > 0, row
epochs = [row["epoch"] for row in rows]
assert epochs == list(range(epochs[0], epochs[0] + len(rows))), epochs
times = [row["wall_time_s"] for row in rows]
assert times[0] > 0 and all(a <= b for a, b in zip(times, times[1:])), times
for row in rows:
    print("Epoch %d, Loss: %.4f, Test accuracy: %.4f" % (row["epoch"], row["loss"], row["test_accuracy"]))
)";

TEST(Digits, MetricsFileHasOneJsonLinePerEpoch) {
  auto dir = make_temp_dir("digits_metrics");
  auto r = run_process(
      under_ddprun(2, "digits_ddp", {"4", "10", "--checkpoint-dir", dir, "--metrics", dir + "/metrics.jsonl"}),
      one_rank({}, std::chrono::seconds(60)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto py = run_process({DDP_PYTHON, "-c", kPythonCheckMetrics, dir + "/metrics.jsonl"});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  // One row per epoch, 0..3, agreeing with what rank 0 printed.
  std::string printed;
  for (const auto& line : epoch_lines(r.out)) printed += line + "\n";
  EXPECT_EQ(py.out, printed);
  EXPECT_EQ(count_of(py.out, "\n"), 4);
  fs::remove_all(dir);
}

TEST(Digits, ResumesFromTheNewestSnapshotBitIdentically) {
  auto straight = make_temp_dir("digits_straight");
  auto resumed = make_temp_dir("digits_resumed");
  auto full = run_process(under_ddprun(2, "digits_ddp", {"7", "2", "--checkpoint-dir", straight}),
                          one_rank({}, std::chrono::seconds(60)));
  ASSERT_EQ(full.exit_code, 0) << full.describe();
  // Stop after 4 epochs (a snapshot at the last one, epoch 3), then ask for 7.
  std::string metrics = resumed + "/metrics.jsonl";
  auto part = run_process(under_ddprun(2, "digits_ddp", {"4", "2", "--checkpoint-dir", resumed, "--metrics", metrics}),
                          one_rank({}, std::chrono::seconds(60)));
  ASSERT_EQ(part.exit_code, 0) << part.describe();
  auto rest = run_process(under_ddprun(2, "digits_ddp", {"7", "2", "--checkpoint-dir", resumed, "--metrics", metrics}),
                          one_rank({}, std::chrono::seconds(60)));
  ASSERT_EQ(rest.exit_code, 0) << rest.describe();
  EXPECT_NE(rest.out.find("Resuming after epoch 3"), std::string::npos) << rest.out;
  auto lines = epoch_lines(rest.out);
  ASSERT_EQ(lines.size(), 3u) << rest.out;
  EXPECT_EQ(lines.front().rfind("Epoch 4, ", 0), 0u) << rest.out;
  // The resumed epochs print what the straight run printed for them.
  auto straight_lines = epoch_lines(full.out);
  ASSERT_EQ(straight_lines.size(), 7u) << full.out;
  EXPECT_EQ(lines, std::vector<std::string>(straight_lines.begin() + 4, straight_lines.end()));
  EXPECT_EQ(compare_state_dicts(straight + "/model_final.pt", resumed + "/model_final.pt"), "identical");
  // The resumed run appends its epochs to the metrics file.
  std::ifstream in(metrics);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int> epochs;
  std::regex epoch_pattern("\\{\"epoch\": ([0-9]+),");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), epoch_pattern); it != std::sregex_iterator(); ++it) {
    epochs.push_back(std::stoi((*it)[1]));
  }
  EXPECT_EQ(epochs, (std::vector<int>{0, 1, 2, 3, 4, 5, 6})) << text;
  EXPECT_EQ(count_of(text, "\n"), 7) << text;
  fs::remove_all(straight);
  fs::remove_all(resumed);
}

TEST(Digits, MalformedDataNamesFileAndLine) {
  auto dir = make_temp_dir("digits_bad");
  // Writes `text` gzip'd to dir/name.
  auto write_gz = [&](const std::string& name, const std::string& text) {
    std::string plain = dir + "/" + name.substr(0, name.size() - 3);
    std::ofstream(plain) << text;
    auto gz = run_process({"gzip", "-n", "-f", plain});
    EXPECT_EQ(gz.exit_code, 0) << gz.describe();
    return dir + "/" + name;
  };
  std::string pixels;
  for (int i = 0; i < 64; ++i) pixels += std::to_string(i % 17) + ",";
  std::string row = pixels + "3\n";
  std::string cut_pixels = pixels.substr(0, pixels.size() - 3) + "x,";  // column 64 is "x"

  // The shipped file cut short in the middle of its compressed data.
  std::ifstream shipped(shipped_data(), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(shipped)), std::istreambuf_iterator<char>());
  std::ofstream(dir + "/truncated.csv.gz", std::ios::binary) << bytes.substr(0, bytes.size() / 2);

  struct Case {
    std::string file;
    std::string expected;  // a regex
  };
  std::vector<Case> cases = {
      {write_gz("columns.csv.gz", row + "1,2,3\n"), "columns\\.csv\\.gz:2: expected 65 columns .*found 3"},
      {write_gz("text.csv.gz", row + row + cut_pixels + "3\n"), "text\\.csv\\.gz:3: column 64 is not a number: 'x'"},
      {write_gz("label.csv.gz", pixels + "10\n"), "label\\.csv\\.gz:1: the label must be an integer in \\[0, 10\\), found '10'"},
      {write_gz("fraction.csv.gz", row + "\n" + pixels + "2.5\n"), "fraction\\.csv\\.gz:3: the label must be an integer"},
      {write_gz("pixel.csv.gz", "17," + row.substr(row.find(',') + 1)), "pixel\\.csv\\.gz:1: column 1: a pixel must be in \\[0, 16\\], found 17"},
      {write_gz("empty.csv.gz", ""), "data file '.*empty\\.csv\\.gz' holds no data rows"},
      {dir, "data file '[^']*' is a directory; give the gzipped CSV file's path"},
      {dir + "/truncated.csv.gz", "truncated\\.csv\\.gz:[0-9]+: cannot read the data: unexpected end of file"},
      {dir + "/missing.csv.gz", "cannot open data file '.*missing\\.csv\\.gz': No such file or directory"},
      {write_gz("long.csv.gz", row + std::string(1 << 20, '0') + "\n"), "long\\.csv\\.gz:2: the line is longer than 16384 bytes"},
  };
  for (const auto& c : cases) {
    auto r = run_process({bin_path("digits_ddp"), "1", "1", "--data", c.file, "--checkpoint-dir", dir},
                         one_rank({}, std::chrono::seconds(30)));
    EXPECT_EQ(r.exit_code, 1) << r.describe();
    EXPECT_TRUE(std::regex_search(r.err, std::regex("error: .*" + c.expected))) << c.expected << "\n" << r.describe();
    EXPECT_EQ(r.out.find("Epoch 0"), std::string::npos) << r.describe();
  }
  // A plain (not gzip'd) file is read as it is.
  std::ofstream(dir + "/plain.csv") << row + row + row + row + row;
  auto plain = run_process({bin_path("digits_ddp"), "1", "1", "--data", dir + "/plain.csv", "--checkpoint-dir", dir},
                           one_rank({}, std::chrono::seconds(30)));
  EXPECT_EQ(plain.exit_code, 0) << plain.describe();
  EXPECT_NE(plain.out.find("Epoch 0, Loss: "), std::string::npos) << plain.describe();
  fs::remove_all(dir);
}

// Issue 12 item 9: strtod reads "0x1A" as 26; the data must be decimal.
TEST(Digits, HexadecimalValuesAreRefusedWithFileRowAndColumn) {
  auto dir = make_temp_dir("digits_hex");
  std::string pixels;
  for (int i = 0; i < 64; ++i) pixels += std::to_string(i % 17) + ",";
  std::string row = pixels + "3\n";
  std::ofstream(dir + "/hex.csv") << row + "0x1," + row.substr(row.find(',') + 1);
  auto r = run_process({bin_path("digits_ddp"), "1", "1", "--data", dir + "/hex.csv", "--checkpoint-dir", dir},
                       one_rank({}, std::chrono::seconds(30)));
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find("hex.csv:2: column 1 is not a number: '0x1'"), std::string::npos) << r.describe();
  fs::remove_all(dir);
}

TEST(Digits, UsageErrorsExitTwo) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{"0", "1"}, "TOTAL_EPOCHS must be positive"},
      {{"5", "-1"}, "SAVE_EVERY must be positive"},
      {{"5", "1", "--batch-size", "0"}, "--batch-size must be positive"},
      {{"5", "1", "--batch-size", "many"}, "--batch-size must be an integer"},
      {{"5", "1", "--seed", "-3"}, "--seed must be a non-negative integer"},
      {{"5"}, "TOTAL_EPOCHS and SAVE_EVERY are required"},
      {{"5", "1", "--metrics"}, "--metrics needs a value"},
      {{"5", "1", "7"}, "unexpected argument '7'"},
      {{"5", "1", "--bogus"}, "unknown option --bogus"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {bin_path("digits_ddp")};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_process(argv, one_rank({}, std::chrono::seconds(30)));
    EXPECT_EQ(r.exit_code, 2) << r.describe();
    EXPECT_NE(r.err.find("error: " + c.expected), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("usage:"), std::string::npos) << r.describe();
  }
  auto help = run_process({bin_path("digits_ddp"), "--help"}, one_rank({}, std::chrono::seconds(30)));
  EXPECT_EQ(help.exit_code, 0) << help.describe();
  for (const char* flag : {"--batch-size N", "(default 32)", "--seed N", "--checkpoint-dir DIR", "(default .)",
                           "--no-resume", "--metrics FILE", "--data FILE", "digits.csv.gz", "--help"}) {
    EXPECT_NE(help.err.find(flag), std::string::npos) << flag << "\n" << help.describe();
  }
  auto no_dir = run_process({bin_path("digits_ddp"), "1", "1", "--checkpoint-dir", "/nonexistent/dir"},
                            one_rank({}, std::chrono::seconds(30)));
  EXPECT_EQ(no_dir.exit_code, 1) << no_dir.describe();
  EXPECT_NE(no_dir.err.find("error: checkpoint directory '/nonexistent/dir' does not exist"), std::string::npos)
      << no_dir.describe();
}

}  // namespace
