#pragma once

// Internal to the library, not installed. The optimizer state in the
// layout of Python's optimizer.state_dict(),
//
//   {"state":        {index: {"step": t, "exp_avg": t, ...}, ...},
//    "param_groups": [{"lr": ..., ..., "params": [index, ...]}, ...]},
//
// and the re-layouts that ZeroRedundancyOptimizer (shard positions <->
// parameter indices), FullyShardedDataParallel (one flat entry per unit <->
// one entry per original parameter) and snapshots make of it. Everything
// here is a pure function of its arguments: no collectives, no optimizer.
// The conversion from and to a torch::optim::Optimizer is
// ddp::optimizer_state_dict / ddp::load_optimizer_state_dict
// (<ddp/snapshot.h>), defined in src/checkpoint/optimizer_state.cpp too.

#include "common/flat_layout.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ddp::detail {

using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

/// A dict of Any to Any, as Python's layout is pickled.
GenericDict new_generic_dict();
/// [0, 1, ..., count - 1] as a list of Any: a typed IntList would pickle as
/// a TorchScript global, which Python's weights_only torch.load refuses.
GenericList index_list(int64_t count);

/// An optimizer state's two parts (sharing the value's contents).
struct OptimizerStateParts {
  GenericDict state;         ///< parameter index -> that parameter's entries
  GenericList param_groups;  ///< each group's hyperparameters and "params"
};

/// `value`'s parts, checked: a dict with a dict "state" and a list
/// "param_groups". `who` names the caller in the error.
OptimizerStateParts parse_optimizer_state(const c10::IValue& value, const std::string& who);
/// The inverse of parse_optimizer_state.
c10::IValue make_optimizer_state(GenericDict state, GenericList param_groups);

/// A copy of the only parameter group of `parts`, checked: there is exactly
/// one, and it lists `expected_params` parameters.
GenericDict single_param_group(const OptimizerStateParts& parts, int64_t expected_params, const std::string& who);

/// Python's layout with one parameter group over parameters 0 to count - 1:
/// `group`'s hyperparameters (copied; its "params" replaced) and `state`'s
/// entries for those indices, in index order as Python lists them.
c10::IValue one_group_state(const GenericDict& state, const GenericDict& group, int64_t count);

/// Entry i of `state` becomes entry new_index[i] (ZeRO: this rank's shard
/// positions to global parameter indices). Keys must be in range.
GenericDict scatter_state(const GenericDict& state, const std::vector<int64_t>& new_index);
/// Entry i of the result is entry old_index[i] of `state`, where it has one
/// (ZeRO: global parameter indices to this rank's shard positions).
GenericDict gather_state(const GenericDict& state, const std::vector<int64_t>& old_index);
/// The union of `parts` (disjoint keys; a key in several keeps the first).
GenericDict merge_states(const std::vector<GenericDict>& parts);

/// Where parameters lie in one flat tensor (an FSDP unit): parameter j
/// holds elements [offsets[j], offsets[j] + numel of shapes[j]), and the
/// flat tensor has `padded` elements (the tail, if any, is padding).

/// One flat entry (per-element state, is_per_element_state(), as tensors of
/// layout.padded elements; the rest, "step", for the whole flat tensor) as
/// one entry per parameter: per-element state cut to each parameter's slot
/// and shape, the rest shared by all. Every tensor is a fresh copy.
std::vector<GenericDict> split_flat_entry(const GenericDict& flat, const FlatLayout& layout);
/// The inverse: one entry per parameter (the same keys, per-element state
/// of each parameter's shape) as one flat entry with zero padding; the rest
/// is the first parameter's.
GenericDict join_flat_entry(const std::vector<GenericDict>& entries, const FlatLayout& layout);
/// A flat entry's part [start, start + length): per-element state narrowed
/// and copied, the rest kept (an FSDP rank's shard of a unit's state).
GenericDict slice_flat_entry(const GenericDict& flat, int64_t start, int64_t length);
/// `entry` with each per-element state replaced by fn(key, tensor) (an
/// undefined tensor where the value is not one), the rest kept, in order.
GenericDict map_per_element_state(const GenericDict& entry,
                                  const std::function<at::Tensor(const std::string&, const at::Tensor&)>& fn);

}  // namespace ddp::detail
