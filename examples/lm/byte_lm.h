#pragma once

// A byte-level transformer language model, small enough to train on two
// cores: bytes in, a distribution over the next byte out. GPT-2's layout
// (pre-norm blocks of causal self-attention and a 4x MLP, learned positions),
// with a few hundred thousand parameters at the defaults.

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

namespace lm {

struct ModelConfig {
  int64_t context = 64;  // bytes the model sees at once
  int64_t width = 128;   // embedding size
  int64_t layers = 2;
  int64_t heads = 4;
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t heads) : heads(heads) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    qkv = register_module("qkv", torch::nn::Linear(width, 3 * width));
    proj = register_module("proj", torch::nn::Linear(width, width));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    up = register_module("up", torch::nn::Linear(width, 4 * width));
    down = register_module("down", torch::nn::Linear(4 * width, width));
  }

  at::Tensor forward(at::Tensor x) {
    const int64_t batch = x.size(0), time = x.size(1), width = x.size(2);
    // [3, batch, heads, time, width / heads]
    at::Tensor qkv_heads =
        qkv->forward(norm1->forward(x)).view({batch, time, 3, heads, width / heads}).permute({2, 0, 3, 1, 4});
    at::Tensor attended = at::scaled_dot_product_attention(qkv_heads[0], qkv_heads[1], qkv_heads[2], {}, 0.0,
                                                           /*is_causal=*/true);
    x = x + proj->forward(attended.transpose(1, 2).reshape({batch, time, width}));
    return x + down->forward(torch::nn::functional::gelu(up->forward(norm2->forward(x))));
  }

  int64_t heads;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct ByteLMImpl : torch::nn::Module {
  explicit ByteLMImpl(const ModelConfig& config) {
    bytes = register_module("bytes", torch::nn::Embedding(256, config.width));
    positions = register_module("positions", torch::nn::Embedding(config.context, config.width));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < config.layers; ++i) blocks->push_back(Block(config.width, config.heads));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.width})));
    head = register_module("head", torch::nn::Linear(config.width, 256));
  }

  /// [batch, time] byte values (int64) -> [batch, time, 256] logits.
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = bytes->forward(tokens) + positions->forward(at::arange(tokens.size(1), tokens.options()));
    for (const auto& block : *blocks) x = block->as<Block>()->forward(x);
    return head->forward(norm->forward(x));
  }

  torch::nn::Embedding bytes{nullptr}, positions{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ByteLM);

}  // namespace lm
