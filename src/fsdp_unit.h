#pragma once

// Internal to src/: one FSDP unit's tensors and per-pass state (a unit as
// FsdpRuntime holds it; how units are chosen is fsdp_unit_grouping.h),
// shared by fully_sharded_data_parallel.cpp (forming, gathering, freeing),
// fsdp_step.cpp (forward and backward) and fsdp_state_dict.cpp (state dicts).

#include <ddp/comm_hooks.h>
#include "fsdp_runtime.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <string>
#include <vector>

namespace ddp::detail {

struct FsdpRuntime::Unit {
  std::string name;
  std::vector<std::string> param_names;  // dotted names in the root module
  std::vector<at::Tensor> params;        // the module's own leaf tensors
  std::vector<int64_t> offsets;
  int64_t numel = 0;        // real elements
  int64_t padded = 0;       // numel rounded up to a multiple of the world size
  int64_t shard_numel = 0;  // padded / world size
  at::Tensor full;          // `padded` elements in param_dtype; memory only while gathered
  at::Tensor shard;         // this rank's part in the parameters' dtype; the optimizer's parameter
  at::Tensor gather_input;  // the shard cast to param_dtype, while its all-gather runs
  bool is_root = false;
  bool reshard_after_forward = true;
  bool gathered = false;
  c10::intrusive_ptr<c10d::Work> pending_gather;
  // How gradients are reduced: in `reduce_dtype` (the flat gradient's
  // dtype), by `hook`.
  at::ScalarType reduce_dtype = at::kFloat;
  std::shared_ptr<CommHook> hook;
  // HSDP: the dtype of the replicate all-reduce, the shard group's
  // reduction in flight and what the engine waits for (its result
  // all-reduced across the replicas).
  at::ScalarType replicate_dtype = at::kFloat;
  c10::intrusive_ptr<c10::ivalue::Future> scattered;
  c10::intrusive_ptr<c10::ivalue::Future> replicated;
  // One backward pass.
  bool reduced = false;
  bool pre_backward_ran = false;
  at::Tensor gradient_flat;   // all-reduced or on one rank only: a reduce-scatter's input is not kept
  at::Tensor gradient_shard;
  // The shard group's reduction of this unit, from its launch until the
  // next unit's (sharded strategies only).
  c10::intrusive_ptr<c10::ivalue::Future> scatter_in_flight;
  // no_sync(): the sum of the unsharded gradients of backward passes whose
  // reduce-scatter was skipped, reduced with the next synchronised one.
  at::Tensor unsynced_gradient;
};

}  // namespace ddp::detail
