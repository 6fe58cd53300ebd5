#pragma once

// Internal to src/, not installed: FullyShardedDataParallel's runtime (its
// units, their gathers, frees and reduce-scatters, its state dicts).
// FullyShardedDataParallelBase holds one and forwards to it.

#include <ddp/fully_sharded_data_parallel.h>

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/process_group.h>

#include "gradient_sync_engine.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp::detail {

struct FlatLayout;          // src/optimizer_state.h
struct ShardRange;          // src/shard_range.h
class GradientSyncEngine;  // src/gradient_sync_engine.h

/// The groups FSDP runs over. Units are sharded over `shard`; under HSDP
/// each shard's gradient is then all-reduced over `replicate` (null
/// otherwise). `whole` is every rank of the model (both together): module
/// states are made rank 0's over it, and "rank 0" means its rank 0.
struct FsdpGroups {
  std::shared_ptr<ProcessGroup> shard;
  std::shared_ptr<ProcessGroup> replicate;
  std::shared_ptr<ProcessGroup> whole;
  /// What the strategy became: a hybrid one named on a 1-D group turns into
  /// its within-node strategy here.
  bool hybrid = false;
};
/// One group: plain FSDP, or with a hybrid strategy the launcher's nodes x
/// local ranks (DeviceMesh::from_launcher, collective).
FsdpGroups fsdp_groups(std::shared_ptr<ProcessGroup> group, const FSDPOptions& options);
/// A 1-D mesh is plain FSDP over its group; a 2-D one is HSDP, dimension 0
/// replicating and dimension 1 sharding (FSDP2's layout).
FsdpGroups fsdp_groups(const DeviceMesh& mesh);

/// FullyShardedDataParallel, independent of the module type: units, their
/// gathering and freeing, and state dicts. As the gradient engine's reduction
/// policy (gradient_sync_engine.h), a unit is a group: when its gradients are
/// final it is flattened and reduce-scattered into the shard.
class FsdpRuntime : private ReductionPolicy {
 public:
  FsdpRuntime(std::shared_ptr<torch::nn::Module> root, FsdpGroups groups, FSDPOptions options);
  /// Deferred construction: builds `children` into the empty `root` one at
  /// a time, each child a unit, sharded and freed before the next is built.
  FsdpRuntime(std::shared_ptr<torch::nn::SequentialImpl> root, const DeferredSequential& children,
              FsdpGroups groups, FSDPOptions options);
  ~FsdpRuntime() override;
  FsdpRuntime(const FsdpRuntime&) = delete;
  FsdpRuntime& operator=(const FsdpRuntime&) = delete;

  void begin_forward();
  void end_forward(const std::vector<at::Tensor>& outputs);
  /// The forward of a Sequential root whose children form units.
  at::Tensor run_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input);
  bool runs_sequential() const { return !sequential_groups_.empty(); }

  void unit_before_forward(size_t unit);
  void unit_after_forward(size_t unit, const std::vector<at::Tensor>& outputs);

  std::vector<at::Tensor> shards() const;
  std::vector<std::string> unit_names() const;
  ShardedMemory memory() const;
  void reset_peak_memory();
  /// FSDPOptions::param_dtype, if it casts: what floating inputs become.
  std::optional<at::ScalarType> input_dtype() const { return mixed_ ? options_.param_dtype() : std::nullopt; }
  std::optional<at::ScalarType> output_dtype() const { return options_.output_dtype(); }

  StateDict full_state_dict(bool rank0_only);
  void load_full_state_dict(const StateDict& state);
  /// load_full_state_dict from a torch.save file, reading only this rank's
  /// part of each parameter (src/fsdp_full_state_file.cpp).
  void load_full_state_dict_file(const std::string& path);
  c10::IValue full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only);
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state);
  c10::IValue sharded_state_dict(torch::optim::Optimizer* optimizer);
  void load_sharded_state_dict(const c10::IValue& state, torch::optim::Optimizer* optimizer);

  const std::shared_ptr<ProcessGroup>& shard_group() const { return group_; }
  const std::shared_ptr<ProcessGroup>& replicate_group() const { return replicate_group_; }
  /// The strategy in force (see FullyShardedDataParallel::sharding_strategy).
  ShardingStrategy sharding_strategy() const;

  void gather_all();
  void free_all();
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

 private:
  struct Unit;
  /// What both constructors check and set before forming units.
  void check_options();
  void build_units();
  /// The trainable parameters of `module` not claimed yet (by a nested
  /// unit); its frozen ones go to frozen_. `name_of` names each parameter.
  std::vector<std::pair<std::string, at::Tensor>> claim_parameters(
      const torch::nn::Module& module, const std::map<const at::TensorImpl*, std::string>& name_of);
  /// Each parameter's dotted name in `module`, refusing tied parameters.
  static std::map<const at::TensorImpl*, std::string> parameter_names(const torch::nn::Module& module,
                                                                     const std::string& prefix);
  /// With broadcast_from_rank0, the unit's values become rank 0's (one
  /// broadcast of its flat tensor) before it is sharded.
  void add_unit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
                bool broadcast_from_rank0 = false);
  /// After the units are formed: frozen parameters under param_dtype, each
  /// unit's reshard_after_forward, then the gradient engine.
  void finish_construction();
  void start_gather(Unit& unit);
  void finish_gather(Unit& unit);
  void release(Unit& unit);
  void register_pre_backward(size_t unit, const std::vector<at::Tensor>& outputs);
  void pre_backward(size_t unit);
  void reset_backward_state();
  at::Tensor flatten_gradients(Unit& unit);
  int64_t held_parameter_bytes() const;
  void note_parameter_memory();
  /// Under param_dtype: the module's frozen parameters cast again from
  /// frozen_ after a load.
  void refresh_frozen_parameters();

  // ReductionPolicy: the gradient engine calls these during backward.
  std::vector<size_t> on_round_start(bool synchronised) override;
  void on_gradient_ready(size_t /*param*/, bool /*has_gradient*/) override {}
  c10::intrusive_ptr<c10::ivalue::Future> launch_group(size_t unit) override;
  void on_group_complete_without_sync(size_t unit) override;
  void before_waiting(const std::vector<char>& used_locally) override;
  void finish_group(size_t unit, const at::Tensor& result) override;
  void on_round_end(bool synchronised) override;
  std::string group_label(size_t unit) const override;
  std::string collective_tag(size_t unit) const override;
  bool rounds_start_on_first_gradient() const override { return false; }
  bool tracks_rounds_without_sync() const override { return true; }

  /// HSDP: starts the replicate all-reduces of units whose reduce-scatter
  /// has finished, in launch order (so in the same order on every rank), up
  /// to the first unfinished one; with `wait_for_all`, of every unit.
  void launch_replicate_reductions(bool wait_for_all);
  /// The ranks a gradient is averaged over: shard x replicate.
  int64_t data_parallel_size() const;

  bool sharded() const;
  /// The shard is the unit's flat tensor itself: nothing is ever freed or
  /// gathered (kNoShard without param_dtype).
  bool shard_is_full() const { return !sharded() && !mixed_; }
  /// This rank's part of the unit's flat tensor: padded_shard() of the
  /// shard group, or the whole padded tensor when nothing is sharded.
  ShardRange shard_range(const Unit& unit) const;
  FlatLayout layout_of(const Unit& unit) const;
  /// Each parameter's index in the root's named_parameters(), by name:
  /// the unwrapped model's optimizer-state keys.
  std::map<std::string, int64_t> parameter_indices() const;
  // Buffers and frozen parameters: whole on every rank.
  std::vector<std::pair<std::string, at::Tensor>> replicated() const;

  std::shared_ptr<torch::nn::Module> root_;
  std::shared_ptr<ProcessGroup> group_;             // the shard group
  std::shared_ptr<ProcessGroup> replicate_group_;  // HSDP only
  std::shared_ptr<ProcessGroup> whole_group_;
  bool hybrid_ = false;
  // HSDP: units whose reduce-scatter was launched and whose replicate
  // all-reduce was not yet, in launch order.
  std::vector<size_t> awaiting_replicate_;
  FSDPOptions options_;
  // requires_grad false: not sharded. Their values in their own dtype (the
  // module's tensors themselves, or their originals under param_dtype).
  std::vector<std::pair<std::string, at::Tensor>> frozen_;
  std::set<const at::TensorImpl*> claimed_;  // parameters already in a unit or in frozen_ (construction)
  std::vector<at::Tensor> frozen_params_;  // the module's tensors, parallel to frozen_
  std::vector<std::unique_ptr<Unit>> units_;  // the root unit, if any, is last
  std::vector<std::vector<size_t>> sequential_groups_;  // children of a Sequential root, by unit
  std::vector<size_t> sequential_unit_of_group_;
  std::vector<size_t> forward_order_;       // this iteration's non-root units, as they ran
  std::vector<size_t> last_forward_order_;  // the previous iteration's, for prefetching
  std::vector<size_t> launch_position_;     // per unit: its place in this backward pass's launch order
  bool mixed_ = false;  // FSDPOptions::param_dtype is set
  bool built_deferred_ = false;  // from a DeferredSequential: the module is never gathered back whole
  int64_t peak_parameter_bytes_ = 0;
  std::unique_ptr<GradientSyncEngine> engine_;  // last: its hooks call the members above
};

}  // namespace ddp::detail
