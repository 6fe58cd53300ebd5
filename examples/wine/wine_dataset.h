#pragma once

// The Wine split as a LibTorch dataset, so the examples load it as the
// reference tutorials do in Python: a Dataset, a DistributedSampler and a
// DataLoader (torch::data::make_data_loader).

#include "wine_data.h"

#include <torch/data/datasets/base.h>
#include <torch/data/datasets/map.h>
#include <torch/data/example.h>

#include <memory>
#include <optional>
#include <vector>

namespace wine {

/// One sample per get(): 13 standardised features and the class label.
/// Stateless and cheap to copy (the tensors are shared), so loader worker
/// threads each hold a copy.
class WineDataset : public torch::data::datasets::Dataset<WineDataset> {
 public:
  /// With `fetched`, each index read is appended to it (the loader's copies
  /// share it): which samples a rank trained on, for --sample-log.
  explicit WineDataset(wine::Dataset data, std::shared_ptr<std::vector<int64_t>> fetched = nullptr)
      : data_(std::move(data)), fetched_(std::move(fetched)) {}
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    if (fetched_) fetched_->push_back(i);
    return {data_.features[i], data_.labels[i]};
  }
  std::optional<size_t> size() const override { return static_cast<size_t>(data_.size()); }

 private:
  wine::Dataset data_;
  std::shared_ptr<std::vector<int64_t>> fetched_;
};

}  // namespace wine
