#pragma once

// The digits split as a LibTorch dataset, for torch::data::make_data_loader.

#include "digits_data.h"

#include <torch/data/datasets/base.h>
#include <torch/data/datasets/map.h>
#include <torch/data/example.h>

#include <optional>

namespace digits {

/// One [1, 8, 8] image and its label per get(); copies share the tensors.
class DigitsDataset : public torch::data::datasets::Dataset<DigitsDataset> {
 public:
  explicit DigitsDataset(digits::Dataset data) : data_(std::move(data)) {}
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {data_.images[i], data_.labels[i]};
  }
  std::optional<size_t> size() const override { return static_cast<size_t>(data_.size()); }

 private:
  digits::Dataset data_;
};

}  // namespace digits
