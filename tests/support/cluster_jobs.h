// What the cluster tests (test_cluster.cpp, test_cluster_two_nodes.cpp)
// share: whether a tool is installed, a file's bytes, and the check that a
// launched job trained as the same job under ddprun on one host does.
#pragma once

#include <support/launch.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

namespace ddp::testing {

inline bool have(const std::string& program) {
  return run_process({"sh", "-c", "command -v " + program}, one_rank({}, std::chrono::seconds(10))).exit_code == 0;
}

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The reference: the same job under ddprun on one host.
struct Reference {
  std::vector<std::string> losses;
  std::string dir;  // holds model_final.pt; removed by the test
};
inline Reference reference_run(int ranks, const std::vector<std::string>& args) {
  auto dir = make_temp_dir("cluster_ref");
  std::vector<std::string> full = args;
  full.insert(full.end(), {"--checkpoint-dir", dir});
  // Over Gloo, as the ranks across hosts are: on one host the automatic transport is shared
  // memory, whose sums round differently, and the comparison is bit for bit.
  auto r = run_process(under_ddprun(ranks, "wine_ddp", full), one_rank({{"DDP_SHM", "0"}}));
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  return Reference{loss_lines(r.out), dir};
}

/// Expects wine_ddp `args` launched on `ranks` ranks some other way to have
/// printed the reference run's losses in `rank0_out` (unless nullopt: a
/// restarted job prints more) and saved its weights in `checkpoint_dir`.
inline void expect_matches_one_host(int ranks, const std::vector<std::string>& args,
                                    const std::optional<std::string>& rank0_out, const std::string& checkpoint_dir) {
  auto ref = reference_run(ranks, args);
  if (rank0_out) EXPECT_EQ(loss_lines(*rank0_out), ref.losses) << *rank0_out;
  EXPECT_EQ(compare_state_dicts(checkpoint_dir + "/model_final.pt", ref.dir + "/model_final.pt"), "identical");
  std::filesystem::remove_all(ref.dir);
}

}  // namespace ddp::testing
