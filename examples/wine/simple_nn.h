#pragma once

// The tutorials' model: 13 features -> 64 hidden units -> 3 classes.

#include <ATen/core/Tensor.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace wine {

struct SimpleNNImpl : torch::nn::Module {
  SimpleNNImpl()
      : fc1(register_module("fc1", torch::nn::Linear(13, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 3))) {}

  at::Tensor forward(const at::Tensor& x) { return fc2(torch::nn::functional::relu(fc1(x))); }

  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(SimpleNN);

}  // namespace wine
