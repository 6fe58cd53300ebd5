#pragma once

// The benchmark's models, mirrored exactly (layers, names, order, shapes) by
// bench/python_ddp_bench.py so both sides do the same arithmetic.

#include <ATen/Functions.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <string>
#include <vector>

namespace bench {

// (a) the Wine MLP and (b) a 2M-parameter MLP: Linear layers with ReLU.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const std::vector<int64_t>& widths) {
    for (size_t i = 0; i + 1 < widths.size(); ++i) {
      layers.push_back(register_module("fc" + std::to_string(i + 1), torch::nn::Linear(widths[i], widths[i + 1])));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < layers.size(); ++i) {
      x = layers[i](x);
      if (i + 1 < layers.size()) x = torch::nn::functional::relu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& causal_mask) {
    int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = qkv(ln1(x)).split(d, 2);
    auto shape = [&](const at::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
    at::Tensor q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(causal_mask, -INFINITY);
    at::Tensor attended = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({b, t, d});
    at::Tensor h = x + proj(attended);
    return h + fc2(torch::nn::functional::gelu(fc1(ln2(h))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// (c) a small GPT-style transformer.
struct TransformerImpl : torch::nn::Module {
  TransformerImpl(int64_t vocab, int64_t context, int64_t d, int64_t heads, int64_t layers) {
    token = register_module("token", torch::nn::Embedding(vocab, d));
    position = register_module("position", torch::nn::Embedding(context, d));
    for (int64_t i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(d, heads)));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    int64_t t = tokens.size(1);
    at::Tensor mask = at::ones({t, t}, at::kBool).triu(1);
    at::Tensor x = token(tokens) + position(at::arange(t, at::kLong));
    for (auto& block : blocks) x = block(x, mask);
    return head(ln(x));
  }
  torch::nn::Embedding token{nullptr}, position{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace bench
