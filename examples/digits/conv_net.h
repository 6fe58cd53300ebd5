#pragma once

// A small convnet for 8x8 digits:
//   [n,1,8,8] -conv1,relu-> [n,16,8,8] -conv2,relu-> [n,32,8,8] -maxpool 2-> [n,32,4,4]
//   -flatten-> [n,512] -fc1,relu-> [n,64] -fc2-> [n,10] logits

#include <ATen/core/Tensor.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace digits {

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 4 * 4, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}

  at::Tensor forward(const at::Tensor& images) {
    namespace F = torch::nn::functional;
    at::Tensor x = F::relu(conv1(images));
    x = F::max_pool2d(F::relu(conv2(x)), F::MaxPool2dFuncOptions(2));
    return fc2(F::relu(fc1(x.flatten(1))));
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(ConvNet);

}  // namespace digits
