// FullyShardedDataParallel and ZeroRedundancyOptimizer against DDP, with
// real processes under ddprun (tests/workers/fsdp_worker.cpp): the same
// weights after several optimizer steps, only shards held between steps, and
// checkpoints that move between strategies and world sizes.

#include "support/launch.h"
#include "support/subprocess.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

namespace {

using namespace ddp::testing;
namespace fs = std::filesystem;

struct TempDir {
  TempDir() {
    char pattern[] = "/tmp/ddp_fsdp_XXXXXX";
    path = mkdtemp(pattern);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

// Trains with fsdp_worker and returns the run; the state dict goes to `out`.
ProcessResult train(int ranks, const std::vector<std::string>& args) {
  return run_process(under_ddprun(ranks, "fsdp_worker", args), one_rank({}));
}

// The largest elementwise difference between two state dicts with the same
// keys (a negative value, with the reason in `why`, when they differ in keys).
double max_difference(const std::string& a, const std::string& b, std::string* why = nullptr) {
  auto r = run_process({DDP_PYTHON, "-c",
                        "import sys, torch\n"
                        "a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\n"
                        "assert list(a) == list(b), (list(a), list(b))\n"
                        "print(max((a[k] - b[k]).abs().max().item() for k in a))\n",
                        a, b});
  if (r.exit_code != 0) {
    if (why) *why = r.err;
    return -1;
  }
  return std::stod(r.out);
}

// Both state dicts hold the same tensors within float tolerance.
void expect_same_weights(const std::string& a, const std::string& b, const std::string& label) {
  std::string why;
  double diff = max_difference(a, b, &why);
  EXPECT_GE(diff, 0) << label << ": " << why;
  EXPECT_LE(diff, 1e-5) << label;
}

std::vector<long long> numbers_after(const std::string& out, const std::string& prefix) {
  std::vector<long long> values;
  std::regex pattern(prefix + " ([0-9]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), pattern); it != std::sregex_iterator(); ++it) {
    values.push_back(std::stoll((*it)[1]));
  }
  return values;
}

void expect_every_strategy_matches_ddp(int ranks) {
  TempDir dir;
  for (const std::string model : {"seq", "wrapped"}) {
    auto reference = train(ranks, {"--model", model, "--strategy", "ddp", "--out", dir / "ddp.pt"});
    ASSERT_EQ(reference.exit_code, 0) << reference.describe();
    auto initial = train(ranks, {"--model", model, "--strategy", "ddp", "--steps", "0", "--out", dir / "init.pt"});
    ASSERT_EQ(initial.exit_code, 0) << initial.describe();
    // Training moved the weights, so matching DDP means something.
    EXPECT_GT(max_difference(dir / "ddp.pt", dir / "init.pt"), 1e-2) << model;
    for (const std::string strategy : {"zero1", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard"}) {
      auto r = train(ranks, {"--model", model, "--strategy", strategy, "--out", dir / "s.pt"});
      ASSERT_EQ(r.exit_code, 0) << model << " " << strategy << ": " << r.describe();
      expect_same_weights(dir / "ddp.pt", dir / "s.pt", model + " " + strategy + " at " + std::to_string(ranks) + " ranks");
      if (strategy.rfind("fsdp", 0) == 0) {
        // The units the model asked for: three size-based groups of the
        // Sequential, or the two wrapped submodules plus the root's head.
        EXPECT_NE(r.out.find(model == "seq" ? "units: '0' '1-2' '3-4'" : "units: 'middle' 'first' ''"),
                  std::string::npos)
            << r.out;
      }
    }
  }
}

TEST(FullyShardedDataParallel, EveryStrategyMatchesDdpAtTwoRanks) { expect_every_strategy_matches_ddp(2); }

// Three ranks: unit sizes 363, 578 and 90 do not divide evenly, so shards
// carry padding.
TEST(FullyShardedDataParallel, EveryStrategyMatchesDdpAtThreeRanksWithUnevenShards) {
  expect_every_strategy_matches_ddp(3);
}

TEST(FullyShardedDataParallel, AdamWAndSgdWithMomentumMatchDdp) {
  TempDir dir;
  for (const std::string optimizer : {"adamw", "sgd"}) {
    auto reference = train(2, {"--optimizer", optimizer, "--strategy", "ddp", "--out", dir / "ddp.pt"});
    ASSERT_EQ(reference.exit_code, 0) << reference.describe();
    for (const std::string strategy : {"zero1", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard"}) {
      auto r = train(2, {"--optimizer", optimizer, "--strategy", strategy, "--out", dir / "s.pt"});
      ASSERT_EQ(r.exit_code, 0) << r.describe();
      expect_same_weights(dir / "ddp.pt", dir / "s.pt", optimizer + " " + strategy);
    }
  }
}

// Four ranks: three steps around the ring in every reduce-scatter and
// all-gather.
TEST(FullyShardedDataParallel, FourRanksMatchDdp) {
  TempDir dir;
  auto reference = train(4, {"--strategy", "ddp", "--out", dir / "ddp.pt"});
  ASSERT_EQ(reference.exit_code, 0) << reference.describe();
  auto sharded = train(4, {"--strategy", "fsdp-full", "--out", dir / "fsdp.pt"});
  ASSERT_EQ(sharded.exit_code, 0) << sharded.describe();
  expect_same_weights(dir / "ddp.pt", dir / "fsdp.pt", "");
}

// Two backward passes before each step: each one's gradients are
// reduce-scattered and added into the shards' gradients. SGD, unlike Adam,
// would notice gradients off by a constant factor.
TEST(FullyShardedDataParallel, GradientAccumulationOverMicroBatchesMatchesDdp) {
  TempDir dir;
  auto reference = train(2, {"--optimizer", "sgd", "--strategy", "ddp", "--out", dir / "ddp.pt"});
  ASSERT_EQ(reference.exit_code, 0) << reference.describe();
  for (const std::string strategy : {"fsdp-full", "fsdp-grad-op"}) {
    auto r = train(2, {"--optimizer", "sgd", "--strategy", strategy, "--micro-batches", "2", "--out", dir / "s.pt"});
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    expect_same_weights(dir / "ddp.pt", dir / "s.pt", strategy);
  }
}

// N ranks with b rows each against one process with all N·b rows (SGD:
// the gradients must be averages, not sums).
TEST(FullyShardedDataParallel, MatchesOneProcessWithTheWholeBatch) {
  TempDir dir;
  auto single = train(1, {"--optimizer", "sgd", "--strategy", "single", "--out", dir / "single.pt"});
  ASSERT_EQ(single.exit_code, 0) << single.describe();
  auto sharded = train(3, {"--optimizer", "sgd", "--strategy", "fsdp-full", "--out", dir / "fsdp.pt"});
  ASSERT_EQ(sharded.exit_code, 0) << sharded.describe();
  expect_same_weights(dir / "single.pt", dir / "fsdp.pt", "");
}

// 1031 parameters padded to 1032: each of 2 ranks keeps 516 floats of
// parameters and of gradients. FULL_SHARD frees every unit after its forward;
// SHARD_GRAD_OP keeps all 1032 gathered until backward.
TEST(FullyShardedDataParallel, HoldsOnlyShardsBetweenSteps) {
  struct Case {
    std::string strategy;
    long long after_forward;
    long long between_steps;
  };
  for (const Case& c : {Case{"fsdp-full", 516 * 4, 516 * 4}, Case{"fsdp-grad-op", 516 * 4 + 1032 * 4, 516 * 4},
                        Case{"fsdp-no-shard", 1032 * 4, 1032 * 4}}) {
    auto r = train(2, {"--strategy", c.strategy});
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(numbers_after(r.out, "after forward holds"), (std::vector<long long>{c.after_forward, c.after_forward}))
        << c.strategy << "\n" << r.out;
    EXPECT_EQ(numbers_after(r.out, "between steps holds"),
              (std::vector<long long>{c.between_steps, c.between_steps}))
        << c.strategy << "\n" << r.out;
    EXPECT_EQ(numbers_after(r.out, "parameter bytes,"), (std::vector<long long>{c.between_steps, c.between_steps}))
        << "gradient bytes: " << c.strategy << "\n" << r.out;
  }
}

// A full checkpoint (model and optimizer, Python's layout) written by
// FULL_SHARD at 2 ranks resumes under other strategies at 3 ranks and alone,
// and lands exactly where uninterrupted DDP does.
TEST(FullyShardedDataParallel, FullCheckpointResumesUnderAnyStrategyAndWorldSize) {
  TempDir dir;
  auto reference = train(2, {"--strategy", "ddp", "--steps", "6", "--out", dir / "ddp6.pt"});
  ASSERT_EQ(reference.exit_code, 0) << reference.describe();
  auto first = train(2, {"--strategy", "fsdp-full", "--steps", "3", "--save-full", dir / "half"});
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  struct Case {
    int ranks;
    std::string strategy;
  };
  for (const Case& c : {Case{3, "fsdp-grad-op"}, Case{3, "zero1"}, Case{1, "ddp"}, Case{2, "fsdp-full"}}) {
    auto r = train(c.ranks, {"--strategy", c.strategy, "--init-seed", "5", "--load-full", dir / "half",
                             "--first-step", "3", "--steps", "3", "--out", dir / "resumed.pt"});
    ASSERT_EQ(r.exit_code, 0) << c.strategy << ": " << r.describe();
    expect_same_weights(dir / "ddp6.pt", dir / "resumed.pt", c.strategy + " at " + std::to_string(c.ranks) + " ranks");
  }
  // Python reads both files into the unwrapped model and torch.optim.Adam.
  auto py = run_process({DDP_PYTHON, "-c",
                         "import sys, torch\n"
                         "m = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.ReLU(), torch.nn.Linear(33, 17),\n"
                         "                        torch.nn.Tanh(), torch.nn.Linear(17, 5))\n"
                         "m.load_state_dict(torch.load(sys.argv[1] + '.model.pt'))\n"
                         "o = torch.optim.Adam(m.parameters(), lr=1e-2)\n"
                         "o.load_state_dict(torch.load(sys.argv[1] + '.optim.pt'))\n"
                         "print('steps', int(o.state[m[0].weight]['step']))\n",
                         dir / "half"});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_NE(py.out.find("steps 3"), std::string::npos) << py.out;
}

// One-element shards and one-element parameters: the optimizer state is
// still split per element, not mistaken for a per-parameter scalar.
TEST(FullyShardedDataParallel, FullCheckpointOfTinyUnitsResumesAtAnotherWorldSize) {
  TempDir dir;
  auto reference = train(2, {"--model", "tiny", "--strategy", "ddp", "--steps", "6", "--out", dir / "ddp6.pt"});
  ASSERT_EQ(reference.exit_code, 0) << reference.describe();
  auto first = train(2, {"--model", "tiny", "--strategy", "fsdp-full", "--steps", "3", "--save-full", dir / "half"});
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  auto resumed = train(3, {"--model", "tiny", "--strategy", "fsdp-full", "--init-seed", "5", "--load-full",
                           dir / "half", "--first-step", "3", "--steps", "3", "--out", dir / "resumed.pt"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.describe();
  expect_same_weights(dir / "ddp6.pt", dir / "resumed.pt", "tiny units, 2 ranks then 3");
}

TEST(FullyShardedDataParallel, ShardedCheckpointResumesExactlyAndOnlyAtTheSameWorldSize) {
  TempDir dir;
  auto reference = train(2, {"--strategy", "ddp", "--steps", "6", "--out", dir / "ddp6.pt"});
  ASSERT_EQ(reference.exit_code, 0) << reference.describe();
  auto first = train(2, {"--strategy", "fsdp-full", "--steps", "3", "--save-sharded", dir / "shards"});
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  EXPECT_TRUE(fs::exists(dir / "shards/shard_0_of_2.pt"));
  EXPECT_TRUE(fs::exists(dir / "shards/shard_1_of_2.pt"));
  auto resumed = train(2, {"--strategy", "fsdp-full", "--init-seed", "5", "--load-sharded", dir / "shards",
                           "--first-step", "3", "--steps", "3", "--out", dir / "resumed.pt"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.describe();
  EXPECT_EQ(max_difference(dir / "ddp6.pt", dir / "resumed.pt"), 0.0);

  auto wrong = train(3, {"--strategy", "fsdp-full", "--load-sharded", dir / "shards"});
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.err.find("written by another world size"), std::string::npos) << wrong.err;
}

}  // namespace
