// The GPU path's multi-process pieces, run on the CPU so they cannot rot on
// machines without GPUs: GradScaler's collective skip, the GPU worker's
// scenarios over gloo, and the GPT benchmarks (C++ and Python) at a tiny size.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <cmath>
#include <regex>

using namespace ddp::testing;

namespace {

// The value of "key":<number> in the JSON line of `out`, or NaN.
double json_number(const std::string& out, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("\"" + key + "\": ?([-0-9.eE+]+)"))) return std::nan("");
  return std::stod(m[1]);
}

const std::vector<std::string> kTinyGpt = {"--device", "cpu", "--layers", "2", "--d-model", "64", "--heads", "2",
                                           "--seq", "32", "--vocab", "256", "--batch", "2", "--steps", "2",
                                           "--warmup", "1", "--threads", "1"};

std::vector<std::string> tiny_gpt(const std::string& mode) {
  std::vector<std::string> args = kTinyGpt;
  args.insert(args.end(), {"--mode", mode});
  return args;
}

}  // namespace

TEST(GradScalerRanks, OneRanksInfMakesEveryRankSkip) {
  auto r = run_process(under_ddprun(2, "gpu_worker", {"grad_scaler", "--inf-rank", "1", "--inf-step", "2"}),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "60"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  // Both ranks skipped step 2 only, and ended with the same scale.
  EXPECT_EQ(count_of(r.out, " stepped=11011 scale=131072"), 2) << r.out;
  EXPECT_EQ(count_of(r.out, "SCALER identical on 2 ranks"), 2) << r.out;
}

TEST(GradScalerRanks, RankZerosInfToo) {
  auto r = run_process(under_ddprun(2, "gpu_worker", {"grad_scaler", "--inf-rank", "0", "--inf-step", "0"}),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "60"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, " stepped=01111 scale=131072"), 2) << r.out;
}

TEST(GpuWorker, EquivalenceAndCompressionHooksOverGloo) {
  for (const char* hook : {"allreduce", "fp16", "bf16"}) {
    std::string tolerance = std::string(hook) == "allreduce" ? "1e-5" : "2e-2";
    // DDP_SHM=0: on one host the automatic CPU transport is shared memory; this test is Gloo's.
    auto r = run_process(under_ddprun(2, "gpu_worker", {"equivalence", "--hook", hook, "--tolerance", tolerance}),
                         one_rank({{"DDP_TIMEOUT_SECONDS", "60"}, {"DDP_SHM", "0"}}));
    ASSERT_EQ(r.exit_code, 0) << hook << "\n" << r.describe();
    EXPECT_NE(r.out.find("EQUIVALENCE device=cpu backend=gloo hook=" + std::string(hook)), std::string::npos) << r.out;
  }
}

TEST(GptBench, CppAndPythonRunAndAgreeAtATinySize) {
  auto local = run_process([] {
    std::vector<std::string> argv = {bin_path("gpt_bench")};
    for (auto& a : tiny_gpt("local")) argv.push_back(a);
    return argv;
  }(), one_rank({}));
  ASSERT_EQ(local.exit_code, 0) << local.describe();
  auto cpp = run_process(under_ddprun(2, "gpt_bench", tiny_gpt("ddp")), one_rank({}));
  ASSERT_EQ(cpp.exit_code, 0) << cpp.describe();
  std::vector<std::string> py_argv = {DDP_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                      "2", std::string(DDP_SOURCE_DIR) + "/bench/python_gpt_bench.py"};
  for (auto& a : tiny_gpt("ddp")) py_argv.push_back(a);
  auto py = run_process(py_argv, one_rank({{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(120)));
  ASSERT_EQ(py.exit_code, 0) << py.describe();

  for (const auto* r : {&local, &cpp, &py}) {
    EXPECT_EQ(json_number(r->out, "parameters"), 118528) << r->out;
    EXPECT_GT(json_number(r->out, "step_ms_median"), 0) << r->out;
    EXPECT_NE(r->out.find("6*parameters + 12*layers*d_model*seq"), std::string::npos) << r->out;
  }
  // The same weights, data and arithmetic on both sides: the same losses.
  EXPECT_NEAR(json_number(cpp.out, "loss_first"), json_number(py.out, "loss_first"), 1e-4) << cpp.out << py.out;
  EXPECT_NEAR(json_number(cpp.out, "loss_last"), json_number(py.out, "loss_last"), 1e-4) << cpp.out << py.out;
  EXPECT_NEAR(json_number(local.out, "loss_first"), json_number(cpp.out, "loss_first"), 1e-4);
}
