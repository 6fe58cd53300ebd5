#pragma once

// Internal, not API: may change in any release. ModuleTensors (the
// parameters and buffers of any kind of module), the check that every rank
// holds the same model (verify_replicas_match) and the copy of one rank's
// parameters and buffers to all (broadcast_module_state), shared by
// DistributedDataParallel (construction, buffer sync before each forward,
// Join, load), FullyShardedDataParallel (sync_module_states) and
// ZeroRedundancyOptimizer (the owners' shards after each step).
// <ddp/distributed_data_parallel.h> includes it because its templates reach
// each kind of module through ModuleTensors.

#include <ddp/export.h>
#include <ddp/checkpoint.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace ddp::detail {

/// The parameters and buffers of a module of any kind, by name, in the
/// order of Python's state_dict(). DistributedDataParallel holds one.
class ModuleTensors {
 public:
  virtual ~ModuleTensors() = default;
  virtual StateDict named_parameters() const = 0;
  virtual StateDict named_buffers() const = 0;
  /// Parameters then buffers per module, in registration order.
  virtual StateDict state_dict() const = 0;
  /// Layers whose gradients would be sparse, named, for a clear refusal.
  virtual std::vector<std::string> sparse_gradient_parameters() const { return {}; }
};

DDP_API std::shared_ptr<ModuleTensors> module_tensors(std::shared_ptr<torch::nn::Module> module);
/// Defined in the library; needs <torch/script.h> (or
/// torch/csrc/jit/api/module.h) where DistributedDataParallel<torch::jit::Module>
/// is used.
DDP_API std::shared_ptr<ModuleTensors> module_tensors(const torch::jit::Module& module);

/// How verify_replicas_match's error speaks to the user: the wrapper that
/// checked, the prefix of the module's names in the whole model (a
/// DeferredSequential child's "3."), and what to do.
struct ReplicaCheckWording {
  std::string owner = "DistributedDataParallel";
  std::string name_prefix;
  std::string fix = "Build the model identically on every rank.";
};

/// Checks that every rank's module has the same parameters and buffers
/// (names, shapes, dtypes, in order). On a mismatch every rank throws an
/// error naming the first differing tensor and the ranks involved.
void verify_replicas_match(const ModuleTensors& module, ProcessGroup& group,
                           const ReplicaCheckWording& wording = {});
void verify_replicas_match(const torch::nn::Module& module, ProcessGroup& group,
                           const ReplicaCheckWording& wording = {});

/// Copies `root`'s parameters and/or buffers to every rank.
void broadcast_module_state(const ModuleTensors& module, ProcessGroup& group, bool parameters,
                            bool buffers, int root = 0);
void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, bool parameters,
                            bool buffers, int root = 0);

/// Copies `root`'s values of `tensors` into every rank's, in place, with
/// one flat broadcast per dtype and device (in that order: the same on every
/// rank, which must pass tensors of the same shapes, dtypes and devices in
/// the same order). Without autograd; does nothing in a world of one.
void broadcast_tensors(const std::vector<at::Tensor>& tensors, ProcessGroup& group, int root = 0);

}  // namespace ddp::detail
