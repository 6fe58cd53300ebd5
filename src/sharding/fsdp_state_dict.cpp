// FullyShardedDataParallel's state dicts: full (the unwrapped model's keys,
// loadable at any world size and by Python) and sharded (one file per rank),
// for the module and for the optimizer built over its shards.

#include "sharding/fsdp_runtime.h"

#include <ddp/error.h>
#include <ddp/snapshot.h>

#include "checkpoint/optimizer_state.h"
#include "common/shard_range.h"

#include <ATen/Functions.h>
#include <torch/optim/optimizer.h>

#include <map>

namespace ddp {
namespace detail {

// --- state dicts -----------------------------------------------------------

StateDict FsdpRuntime::full_state_dict(bool rank0_only) {
  const bool keep = !rank0_only || whole_group_->rank() == 0;
  std::map<std::string, at::Tensor> gathered;
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    // From the shards, in their own dtype: a unit gathered in param_dtype
    // holds rounded values.
    const at::Tensor full = unit->gathered() && !unit->precision.casts()
                                ? unit->full
                                : unit->gather->gather_now(unit->shard.detach(), unit->layout.padded,
                                                           "the full state dict");
    if (!keep) continue;
    for (size_t j = 0; j < unit->params.size(); ++j) gathered[unit->layout.names[j]] = unit->layout.view(full, j).clone();
  }
  StateDict state;
  if (!keep) return state;
  // Frozen parameters in their own dtype, not the module's cast copy.
  for (const auto& [name, tensor] : frozen_) gathered.emplace(name, tensor.detach().clone());
  // In the unwrapped model's order (ddp::state_dict's, Python's).
  for (const auto& [name, tensor] : ddp::state_dict(*root_)) {
    auto it = gathered.find(name);
    state.emplace_back(name, it != gathered.end() ? it->second : tensor.detach().clone());
  }
  return state;
}

void FsdpRuntime::load_full_state_dict(const StateDict& state) {
  // load_state_dict's checks (every entry present with its shape, none
  // extra) run against stand-ins: each unit's parameters as views of a new
  // flat tensor, and copies of the buffers and frozen parameters. Only when
  // all have passed does anything of the model change.
  StateDict targets;
  std::vector<at::Tensor> flats;
  for (const auto& unit : units_) {
    flats.push_back(at::zeros({unit->layout.padded}, unit->shard.options()));
    for (size_t j = 0; j < unit->params.size(); ++j) {
      targets.emplace_back(unit->layout.names[j], unit->layout.view(flats.back(), j));
    }
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // (the model's, its stand-in)
  for (const auto& [name, tensor] : replicated()) {
    buffers.emplace_back(tensor, at::empty_like(tensor, tensor.options().requires_grad(false)));
    targets.emplace_back(name, buffers.back().second);
  }
  copy_state_into(targets, state);

  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = *units_[u];
    const ShardRange mine = unit.layout.shard;
    unit.shard.detach().copy_(flats[u].narrow(0, mine.begin, mine.numel()));
    // Inside summon_full_params(): the gathered parameters follow the shards.
    if (unit.gathered() && unit.gather->frees_full()) unit.full.copy_(flats[u]);
  }
  for (auto& [target, value] : buffers) target.detach().copy_(value);
  refresh_frozen_parameters();
}

namespace {

// The optimizer must be built over parameters(), one group, in order.
void check_optimizer_layout(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& shards) {
  std::vector<at::Tensor> params;
  for (auto& group : optimizer.param_groups()) params.insert(params.end(), group.params().begin(), group.params().end());
  bool same = params.size() == shards.size();
  for (size_t i = 0; same && i < params.size(); ++i) same = params[i].is_same(shards[i]);
  DDP_CHECK(same, "ddp: the optimizer must be built over FullyShardedDataParallel::parameters(), in order (it has ",
              params.size(), " parameters, the model has ", shards.size(), " shards)");
}

}  // namespace

std::map<std::string, int64_t> FsdpRuntime::parameter_indices() const {
  std::map<std::string, int64_t> index_of;
  int64_t count = 0;
  for (const auto& item : root_->named_parameters(true)) index_of[item.key()] = count++;
  return index_of;
}

c10::IValue FsdpRuntime::full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only) {
  check_optimizer_layout(optimizer, shards());
  const bool keep = !rank0_only || whole_group_->rank() == 0;
  auto local = parse_optimizer_state(optimizer_state_dict(optimizer), "FullyShardedDataParallel");
  const auto index_of = parameter_indices();
  const int64_t count = static_cast<int64_t>(index_of.size());

  auto state = new_generic_dict();
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = *units_[u];
    auto found = local.state.find(static_cast<int64_t>(u));
    if (found == local.state.end()) continue;  // not stepped yet: the same on every rank
    // The unit's flat entry: its per-element state gathered from every
    // rank's shard (collectives, so on every rank), the rest as it is.
    const int64_t length = unit.layout.shard.numel();
    auto flat = map_per_element_state(found->value().toGenericDict(), [&](const std::string& key,
                                                                          const at::Tensor& tensor) {
      DDP_CHECK(tensor.defined() && tensor.numel() == length, "ddp: optimizer state '", key, "' of unit '",
                unit.name, "' is not a tensor of the shard's ", length, " elements");
      return unit.gather->gather_now(tensor, unit.layout.padded, "the full optimizer state");
    });
    if (!keep) continue;
    auto per_param = split_flat_entry(flat, unit.layout);
    for (size_t j = 0; j < unit.params.size(); ++j) state.insert(index_of.at(unit.layout.names[j]), per_param[j]);
  }
  if (!keep) return c10::IValue();
  // Python's layout for the unwrapped model: one entry per parameter, in
  // index order.
  return one_group_state(state, single_param_group(local, static_cast<int64_t>(units_.size()), "FSDP"), count);
}

void FsdpRuntime::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& full) {
  check_optimizer_layout(optimizer, shards());
  const std::string who = "FullyShardedDataParallel::load_full_optim_state_dict";
  auto parts = parse_optimizer_state(full, who);
  const auto index_of = parameter_indices();
  auto group = single_param_group(parts, static_cast<int64_t>(index_of.size()), who);

  auto state = new_generic_dict();
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = *units_[u];
    std::vector<GenericDict> entries;
    for (const auto& name : unit.layout.names) {
      auto it = parts.state.find(index_of.at(name));
      if (it != parts.state.end()) entries.push_back(it->value().toGenericDict());
    }
    if (entries.empty()) continue;
    DDP_CHECK(entries.size() == unit.params.size(), "ddp: the optimizer state covers only some parameters of unit '",
              unit.name, "'; FSDP needs all or none");
    const ShardRange mine = unit.layout.shard;
    state.insert(static_cast<int64_t>(u),
                 slice_flat_entry(join_flat_entry(entries, unit.layout), mine.begin, mine.numel()));
  }
  load_optimizer_state_dict(optimizer, one_group_state(state, group, static_cast<int64_t>(units_.size())));
}

c10::IValue FsdpRuntime::sharded_state_dict(torch::optim::Optimizer* optimizer) {
  auto result = new_generic_dict();
  result.insert("format", std::string("ddp.fsdp.sharded/1"));
  result.insert("world_size", static_cast<int64_t>(group_->size()));
  result.insert("rank", static_cast<int64_t>(group_->rank()));
  result.insert("strategy", to_string(options_.sharding_strategy()));
  // HSDP: which of the replicas holding this shard this rank is, so that a
  // distributed checkpoint writes each element once (each replica its part).
  result.insert("replica", static_cast<int64_t>(replicate_group_ ? replicate_group_->rank() : 0));
  result.insert("replicas", static_cast<int64_t>(replicate_group_ ? replicate_group_->size() : 1));
  c10::impl::GenericList units(c10::AnyType::get());
  for (const auto& unit : units_) {
    auto entry = new_generic_dict();
    entry.insert("name", unit->name);
    entry.insert("numel", unit->layout.numel);
    c10::impl::GenericList names(c10::AnyType::get());
    for (const auto& n : unit->layout.names) names.push_back(n);
    entry.insert("param_names", names);
    // Where each parameter and this shard lie in the unit's flat tensor:
    // what a distributed checkpoint needs to cut the shard into the
    // parameters' boxes (src/checkpoint/distributed_checkpoint.cpp).
    c10::impl::GenericList offsets(c10::AnyType::get()), shapes(c10::AnyType::get());
    for (size_t j = 0; j < unit->params.size(); ++j) {
      offsets.push_back(unit->layout.offsets[j]);
      c10::impl::GenericList shape(c10::AnyType::get());
      for (int64_t size : unit->layout.shapes[j]) shape.push_back(size);
      shapes.push_back(shape);
    }
    entry.insert("offsets", offsets);
    entry.insert("shapes", shapes);
    entry.insert("padded", unit->layout.padded);
    entry.insert("shard_start", unit->layout.shard.begin);
    entry.insert("shard", unit->shard.detach().clone());
    units.push_back(entry);
  }
  result.insert("units", units);
  auto buffers = new_generic_dict();
  for (const auto& [name, tensor] : replicated()) buffers.insert(name, tensor.detach().clone());
  result.insert("buffers", buffers);
  if (optimizer) {
    check_optimizer_layout(*optimizer, shards());
    result.insert("optimizer", optimizer_state_dict(*optimizer));
  }
  return result;
}

void FsdpRuntime::load_sharded_state_dict(const c10::IValue& value, torch::optim::Optimizer* optimizer) {
  DDP_CHECK(value.isGenericDict() && value.toGenericDict().contains("format") &&
                  value.toGenericDict().at("format").isString() &&
                  value.toGenericDict().at("format").toStringRef() == "ddp.fsdp.sharded/1",
              "ddp: not an FSDP sharded state dict (no 'format': 'ddp.fsdp.sharded/1')");
  auto dict = value.toGenericDict();
  int64_t world = dict.at("world_size").toInt();
  int64_t rank = dict.at("rank").toInt();
  DDP_CHECK(world == group_->size(), "ddp: this sharded checkpoint was written by ", world,
              " ranks but this job has ", group_->size(),
              "; a sharded checkpoint reloads only into the same world size: load a full state dict instead, or save with "
              "ddp::save_distributed_checkpoint, which loads at any world size");
  DDP_CHECK(rank == group_->rank(), "ddp: rank ", group_->rank(), " was given rank ", rank,
              "'s shard of the checkpoint");
  auto units = dict.at("units").toList();
  DDP_CHECK(units.size() == units_.size(), "ddp: the sharded checkpoint has ", units.size(),
              " units but the model has ", units_.size(), "; wrap the model the same way as when it was saved");
  for (size_t u = 0; u < units_.size(); ++u) {
    auto entry = units.get(u).toGenericDict();
    at::Tensor shard = entry.at("shard").toTensor();
    const FsdpUnit& unit = *units_[u];
    DDP_CHECK(entry.at("name").toStringRef() == unit.name && entry.at("numel").toInt() == unit.layout.numel &&
                    shard.numel() == unit.layout.shard.numel(),
                "ddp: unit ", u, " of the sharded checkpoint ('", entry.at("name").toStringRef(), "', ",
                entry.at("numel").toInt(), " elements) does not match the model's ('", unit.name, "', ",
                unit.layout.numel, " elements)");
  }
  auto buffers = dict.at("buffers").toGenericDict();
  for (const auto& [name, tensor] : replicated()) {
    DDP_CHECK(buffers.contains(name), "ddp: the sharded checkpoint lacks the buffer or frozen parameter '", name, "'");
  }
  if (optimizer) {
    DDP_CHECK(dict.contains("optimizer"), "ddp: the sharded checkpoint holds no optimizer state");
    check_optimizer_layout(*optimizer, shards());
    load_optimizer_state_dict(*optimizer, dict.at("optimizer"));
  }
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = *units_[u];
    unit.shard.detach().copy_(units.get(u).toGenericDict().at("shard").toTensor());
    unit.regather();
  }
  for (const auto& [name, tensor] : replicated()) {
    at::Tensor target = tensor;
    target.detach().copy_(buffers.at(name).toTensor());
  }
  refresh_frozen_parameters();
}

}  // namespace detail

}  // namespace ddp
