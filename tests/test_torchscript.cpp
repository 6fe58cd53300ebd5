// A model scripted in Python (torch.jit.script) trained in C++ with DDP at 2
// ranks equals one process on the whole batch, and Python loads what the C++
// side wrote, both as a TorchScript module and as a strict state dict.

#include <gtest/gtest.h>
#include <support/launch.h>
#include <support/subprocess.h>

#include <filesystem>
#include <regex>

namespace {

using ddp::testing::bin_path;
using ddp::testing::make_temp_dir;
using ddp::testing::one_rank;
using ddp::testing::run_process;
using ddp::testing::under_ddprun;

const std::string kScript = std::string(DDP_SOURCE_DIR) + "/examples/torchscript/script_wine_mlp.py";

TEST(TorchScript, PythonScriptedModelTrainsUnderDdpLikeOneProcessOnTheWholeBatch) {
  const std::string dir = make_temp_dir("ddp_torchscript");
  auto scripted = run_process({DDP_PYTHON, kScript, "script", dir + "/wine_mlp.pt"});
  ASSERT_EQ(scripted.exit_code, 0) << scripted.describe();

  auto two = run_process(under_ddprun(2, "train_scripted", {dir + "/wine_mlp.pt", "--batch-size", "16", "--out",
                                                            dir + "/two"}));
  ASSERT_EQ(two.exit_code, 0) << two.describe();
  auto one = run_process({bin_path("train_scripted"), dir + "/wine_mlp.pt", "--batch-size", "32", "--out",
                          dir + "/one"},
                         one_rank({}));
  ASSERT_EQ(one.exit_code, 0) << one.describe();

  auto check = run_process({DDP_PYTHON, kScript, "check", dir + "/two.pt", dir + "/two_state.pt",
                            dir + "/one_state.pt"});
  ASSERT_EQ(check.exit_code, 0) << check.describe();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(check.out, m, std::regex("max \\|a - b\\| = ([0-9.e+-]+)"))) << check.out;
  EXPECT_LE(std::stod(m[1]), 1e-6) << check.out;
  // It trained: the weights moved away from the scripted ones.
  auto moved = run_process({DDP_PYTHON, "-c",
                            "import sys, torch\n"
                            "a = torch.jit.load(sys.argv[1]).state_dict(); b = torch.load(sys.argv[2])\n"
                            "print(max((a[k] - b[k]).abs().max().item() for k in b))\n",
                            dir + "/wine_mlp.pt", dir + "/two_state.pt"});
  ASSERT_EQ(moved.exit_code, 0) << moved.describe();
  EXPECT_GT(std::stod(moved.out), 1e-3) << moved.out;
  std::filesystem::remove_all(dir);
}

}  // namespace
