#include <ddp/zero_redundancy_optimizer.h>

#include <ddp/error.h>

#include <ddp/checkpoint.h>
#include <ddp/detail/replica_broadcast.h>
#include <ddp/snapshot.h>

#include "checkpoint/optimizer_state.h"
#include "sharding/zero_redundancy_optimizer_impl.h"

#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

namespace ddp {

std::vector<int> partition_parameters(const std::vector<int64_t>& numels, int world_size) {
  DDP_CHECK(world_size >= 1, "ddp: cannot partition over ", world_size, " ranks");
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), 0);
  // Largest first; ties keep registration order so every rank agrees.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owners(numels.size(), 0);
  for (size_t i : order) {
    int lightest = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[i] = lightest;
    load[static_cast<size_t>(lightest)] += numels[i];
  }
  return owners;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 OptimizerFactory make_optimizer)
    : params_(std::move(params)), group_(std::move(group)) {
  DDP_CHECK(group_, "ddp: ZeroRedundancyOptimizer needs a process group");
  DDP_CHECK(make_optimizer, "ddp: ZeroRedundancyOptimizer needs an optimizer factory");
  std::vector<int64_t> numels;
  for (const auto& p : params_) numels.push_back(p.numel());
  owners_ = partition_parameters(numels, group_->size());
  std::vector<at::Tensor> shard;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] == group_->rank()) {
      local_indices_.push_back(i);
      shard.push_back(params_[i]);
    }
  }
  local_ = make_optimizer(std::move(shard));
  DDP_CHECK(local_, "ddp: the optimizer factory returned null");
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() {
  local_->step();
  if (group_->size() == 1) return;
  // Each owner's shard travels as one flat tensor per dtype and device.
  for (int owner = 0; owner < group_->size(); ++owner) {
    std::vector<at::Tensor> shard;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (owners_[i] == owner) shard.push_back(params_[i].detach());
    }
    CollectiveTag tag("zero broadcast from rank " + std::to_string(owner));
    detail::broadcast_tensors(shard, *group_, owner);
  }
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : params_) {
    if (!p.mutable_grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad().reset();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

c10::IValue ZeroRedundancyOptimizer::consolidate_state_dict(int to_rank) {
  // This rank's state, re-keyed from shard positions to global indices.
  auto local = detail::parse_optimizer_state(optimizer_state_dict(*local_), "ZeroRedundancyOptimizer");
  std::vector<int64_t> global_index(local_indices_.begin(), local_indices_.end());
  std::vector<char> bytes = serialize_value(detail::scatter_state(local.state, global_index));

  // Gather the serialized shards: sizes first, then padded bytes.
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), group_->control_options().dtype(at::kLong));
  auto sizes = group_->all_gather(size);
  int64_t longest = 0;
  for (auto& s : sizes) longest = std::max(longest, s.item<int64_t>());
  at::Tensor padded = at::zeros({longest}, at::kByte);
  std::memcpy(padded.data_ptr(), bytes.data(), bytes.size());
  auto shards = group_->all_gather(group_->to_control(padded));
  for (auto& shard : shards) shard = shard.cpu();
  if (group_->rank() != to_rank) return c10::IValue();

  std::vector<detail::GenericDict> parts;
  for (int r = 0; r < group_->size(); ++r) {
    auto* data = static_cast<const char*>(shards[static_cast<size_t>(r)].data_ptr());
    std::vector<char> shard(data, data + sizes[static_cast<size_t>(r)].item<int64_t>());
    parts.push_back(deserialize_value(shard, "optimizer shard of rank " + std::to_string(r)).toGenericDict());
  }
  // One parameter group holding every parameter, with this rank's
  // hyperparameters (all shards were built by the same factory).
  return detail::one_group_state(detail::merge_states(parts), local.param_groups.get(0).toGenericDict(),
                                 static_cast<int64_t>(params_.size()));
}

}  // namespace ddp

namespace ddp {

void ZeroRedundancyOptimizer::load_state_dict(const c10::IValue& full) {
  const std::string who = "ZeroRedundancyOptimizer::load_state_dict (consolidate_state_dict()'s layout)";
  auto parts = detail::parse_optimizer_state(full, who);
  auto group = detail::single_param_group(parts, static_cast<int64_t>(params_.size()), who);
  // This rank's entries, re-keyed from global indices to shard positions.
  std::vector<int64_t> global_index(local_indices_.begin(), local_indices_.end());
  load_optimizer_state_dict(*local_, detail::one_group_state(detail::gather_state(parts.state, global_index), group,
                                                             static_cast<int64_t>(local_indices_.size())));
}

}  // namespace ddp
