// The small model and the weight comparisons the DDP rank tests share
// (test_distributed_data_parallel.cpp, test_no_hangs.cpp,
// test_zero_redundancy_optimizer.cpp).
#pragma once

#include <support/ranks.h>

#include <ddp/process_group.h>

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ddp::testing {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t hidden_out = 4) {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, hidden_out));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc3(torch::nn::functional::relu(fc2(torch::nn::functional::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

/// Every parameter, flattened into one vector.
inline at::Tensor flatten_parameters(torch::nn::Module& module) {
  std::vector<at::Tensor> flat;
  for (auto& p : module.parameters()) flat.push_back(p.detach().reshape({-1}));
  return at::cat(flat);
}

/// Sets `module`'s parameters from a flatten_parameters() vector.
inline void load_flat_parameters(torch::nn::Module& module, const at::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : module.parameters()) {
    p.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

/// Fails unless every rank holds exactly `mine`.
inline void expect_replicas_identical(const std::shared_ptr<ProcessGroup>& group, const at::Tensor& mine,
                                      const std::string& label = "") {
  auto all = group->all_gather(mine);
  for (size_t r = 1; r < all.size(); ++r) EXPECT_TRUE(at::equal(all[r], all[0])) << label << ": rank " << r;
}

}  // namespace ddp::testing
