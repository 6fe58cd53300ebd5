#pragma once

// Internal to src/: how a group of parameters lies in one flat buffer. A DDP
// bucket's gradients, an FSDP unit's parameters and gradients, and FSDP's
// flattened optimizer state all use it, so "where is parameter i of this
// group" has one answer. Sharding (shard_range.h) is part of the layout: a
// DDP bucket is one rank's whole buffer (shard == [0, padded)), an FSDP unit
// pads to a multiple of the shard group's size and owns padded_shard().

#include "common/shard_range.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::detail {

struct FlatLayout {
  std::vector<std::string> names;  ///< for errors
  std::vector<int64_t> offsets;    ///< element offset of each parameter
  std::vector<std::vector<int64_t>> shapes;
  int64_t numel = 0;    ///< real elements: the sum of the parameters' sizes
  int64_t padded = 0;   ///< numel, rounded up to what the sharding needs
  ShardRange shard;     ///< this rank's elements of the padded buffer

  /// Parameters side by side in `params`' order. Unsharded (world_size 1):
  /// nothing padded, the shard is everything. Sharded: padded_numel() and
  /// padded_shard() of `world_size` ranks.
  static FlatLayout of(const std::vector<at::Tensor>& params, std::vector<std::string> names, int64_t world_size = 1,
                       int64_t rank = 0) {
    FlatLayout layout;
    layout.names = std::move(names);
    for (const auto& param : params) {
      layout.offsets.push_back(layout.numel);
      layout.shapes.push_back(param.sizes().vec());
      layout.numel += param.numel();
    }
    layout.padded = padded_numel(layout.numel, world_size);
    layout.shard = padded_shard(layout.numel, world_size, rank);
    return layout;
  }

  size_t size() const { return offsets.size(); }
  int64_t numel_of(size_t i) const {
    int64_t n = 1;
    for (int64_t d : shapes[i]) n *= d;
    return n;
  }
  /// Parameter i's slot of a flat buffer laid out this way, in its shape.
  at::Tensor view(const at::Tensor& flat, size_t i) const {
    return flat.narrow(0, offsets[i], numel_of(i)).view(shapes[i]);
  }
  /// Every parameter's slot of `flat`, in order.
  std::vector<at::Tensor> views(const at::Tensor& flat) const {
    std::vector<at::Tensor> out;
    out.reserve(size());
    for (size_t i = 0; i < size(); ++i) out.push_back(view(flat, i));
    return out;
  }
  /// This rank's real elements: the shard without its padding.
  ShardRange real_shard() const { return clip(shard, {0, numel}); }
};

}  // namespace ddp::detail
