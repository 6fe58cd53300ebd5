#include <ddp/zero_redundancy_optimizer.h>

#include <ddp/error.h>

#include <ddp/checkpoint.h>
#include <ddp/snapshot.h>

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
  // One broadcast per owner and dtype: each shard travels as one flat tensor.
  at::NoGradGuard no_grad;
  for (int owner = 0; owner < group_->size(); ++owner) {
    std::map<int, std::vector<size_t>> by_dtype;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (owners_[i] == owner) by_dtype[static_cast<int>(params_[i].scalar_type())].push_back(i);
    }
    for (auto& [dtype, members] : by_dtype) {
      std::vector<at::Tensor> flat_views;
      for (size_t i : members) flat_views.push_back(params_[i].detach().reshape({-1}));
      at::Tensor flat = at::cat(flat_views);
      group_->broadcast(flat, owner);
      if (owner == group_->rank()) continue;
      int64_t offset = 0;
      for (size_t i : members) {
        params_[i].detach().copy_(flat.narrow(0, offset, params_[i].numel()).view(params_[i].sizes()));
        offset += params_[i].numel();
      }
    }
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
  c10::IValue local = optimizer_state_dict(*local_);
  auto local_dict = local.toGenericDict();
  c10::impl::GenericDict state(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& item : local_dict.at("state").toGenericDict()) {
    state.insert(static_cast<int64_t>(local_indices_.at(static_cast<size_t>(item.key().toInt()))), item.value());
  }
  std::vector<char> bytes = serialize_value(state);

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

  c10::impl::GenericDict merged(c10::AnyType::get(), c10::AnyType::get());
  for (int r = 0; r < group_->size(); ++r) {
    auto* data = static_cast<const char*>(shards[static_cast<size_t>(r)].data_ptr());
    std::vector<char> shard(data, data + sizes[static_cast<size_t>(r)].item<int64_t>());
    for (const auto& item : deserialize_value(shard, "optimizer shard of rank " + std::to_string(r)).toGenericDict()) {
      merged.insert(item.key(), item.value());
    }
  }
  // Sorted by parameter index, as Python's state_dict() lists them.
  c10::impl::GenericDict ordered(c10::AnyType::get(), c10::AnyType::get());
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    auto it = merged.find(i);
    if (it != merged.end()) ordered.insert(i, it->value());
  }
  // One parameter group holding every parameter, with this rank's
  // hyperparameters (all shards were built by the same factory).
  auto group = local_dict.at("param_groups").toListRef().at(0).toGenericDict().copy();
  c10::impl::GenericList all(c10::AnyType::get());
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) all.push_back(i);
  group.insert_or_assign("params", all);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  c10::impl::GenericDict result(c10::AnyType::get(), c10::AnyType::get());
  result.insert("state", ordered);
  result.insert("param_groups", groups);
  return result;
}

}  // namespace ddp

namespace ddp {

void ZeroRedundancyOptimizer::load_state_dict(const c10::IValue& full) {
  DDP_CHECK(full.isGenericDict() && full.toGenericDict().contains("state") &&
                  full.toGenericDict().contains("param_groups"),
              "ddp: ZeroRedundancyOptimizer::load_state_dict needs a dict with 'state' and 'param_groups', as "
              "consolidate_state_dict() returns");
  auto dict = full.toGenericDict();
  auto groups = dict.at("param_groups").toListRef();
  DDP_CHECK(groups.size() == 1, "ddp: ZeroRedundancyOptimizer loads one parameter group, got ", groups.size());
  auto group = groups.at(0).toGenericDict().copy();
  DDP_CHECK(group.at("params").toListRef().size() == params_.size(), "ddp: the optimizer state has ",
              group.at("params").toListRef().size(), " parameters but this optimizer has ", params_.size());
  // This rank's entries, re-keyed from global indices to shard positions.
  auto full_state = dict.at("state").toGenericDict();
  c10::impl::GenericDict state(c10::AnyType::get(), c10::AnyType::get());
  c10::impl::GenericList positions(c10::AnyType::get());
  for (size_t position = 0; position < local_indices_.size(); ++position) {
    positions.push_back(static_cast<int64_t>(position));
    auto it = full_state.find(static_cast<int64_t>(local_indices_[position]));
    if (it != full_state.end()) state.insert(static_cast<int64_t>(position), it->value());
  }
  group.insert_or_assign("params", positions);
  c10::impl::GenericList local_groups(c10::AnyType::get());
  local_groups.push_back(group);
  c10::impl::GenericDict local(c10::AnyType::get(), c10::AnyType::get());
  local.insert("state", state);
  local.insert("param_groups", local_groups);
  load_optimizer_state_dict(*local_, local);
}

}  // namespace ddp
