#pragma once

// Internal to src/, not installed: FullyShardedDataParallel's runtime, as
// FSDP2 structures it (torch/distributed/fsdp/_fully_shard/). A step reads in
// three files: this one (the unit, its state and lifecycle, the gather, reduce
// and replicate objects), src/engine/gradient_sync_engine.h (which calls the runtime
// back during backward) and src/sharding/fsdp_step.cpp (their definitions). Forming
// units is src/sharding/fully_sharded_data_parallel.cpp, state dicts
// src/sharding/fsdp_state_dict.cpp and src/fsdp_full_state_file.cpp.
//
// A unit's parameters lie in one flat tensor (detail::FlatLayout), padded
// to a multiple of the shard group's size. The module's own parameter tensors
// keep their identity (so autograd, optimizers and the user's references stay
// valid) but are views into `full`'s storage: reshard() gives that storage
// back to its allocator, unshard() allocates it again and all-gathers the
// shards into it. Autograd's saved tensors are views of the same storage, so
// backward sees the re-gathered values without bookkeeping. Each rank's
// `shard` (its part of the flat tensor) is a leaf tensor of its own: the
// optimizer's parameter. Once a unit's gradients are all there they are
// flattened, reduced, and this rank's part lands in shard.grad().
//
// What varies with the options is chosen once, at construction, as objects:
// how a unit is gathered (UnitGather), how its gradient is reduced
// (UnitReduce, with HSDP's ReplicateStage around it: the replicate group or
// FSDPOptions::replicate_hook), and its dtypes
// (UnitPrecision, from FSDPOptions' MixedPrecisionPolicy).

#include <ddp/fully_sharded_data_parallel.h>

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/error.h>
#include <ddp/process_group.h>

#include "common/flat_layout.h"
#include "engine/gradient_sync_engine.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
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

/// Where a unit is in one training step (FSDP2's TrainingState). Every
/// lifecycle call checks it: a call in the wrong state means FSDP's hooks
/// ran out of order, an internal error.
enum class TrainingState {
  kIdle,          ///< between passes, or between a unit's forward and its backward
  kForward,       ///< its forward is running (pre_forward .. post_forward)
  kPreBackward,   ///< its backward has begun: its parameters are gathered
  kPostBackward,  ///< its gradients were handed to the reduction (or kept, inside no_sync())
};
inline const char* to_string(TrainingState state) {
  switch (state) {
    case TrainingState::kIdle: return "idle";
    case TrainingState::kForward: return "forward";
    case TrainingState::kPreBackward: return "pre-backward";
    case TrainingState::kPostBackward: return "post-backward";
  }
  return "?";
}

/// The lifecycle calls that move a unit's TrainingState.
enum class UnitEvent { kPreForward, kPostForward, kPreBackward, kPostBackward, kEndOfPass };

inline const char* to_string(UnitEvent event) {
  switch (event) {
    case UnitEvent::kPreForward: return "pre_forward";
    case UnitEvent::kPostForward: return "post_forward";
    case UnitEvent::kPreBackward: return "pre_backward";
    case UnitEvent::kPostBackward: return "post_backward";
    case UnitEvent::kEndOfPass: return "end_pass";
  }
  return "?";
}

/// The state `event` leads to from `state`; an event that cannot happen in
/// `state` throws an internal error naming `unit`. A pre-backward hook fires
/// once per output tensor of the unit, so kPreBackward repeats (and may come
/// after the unit's gradients left): those stay where they are. A unit whose
/// backward never began (unused in this forward) goes straight to
/// kPostBackward.
inline TrainingState next_training_state(TrainingState state, UnitEvent event, const std::string& unit) {
  using S = TrainingState;
  switch (event) {
    case UnitEvent::kPreForward:
      if (state == S::kIdle) return S::kForward;
      break;
    case UnitEvent::kPostForward:
      if (state == S::kForward) return S::kIdle;
      break;
    case UnitEvent::kPreBackward:
      if (state == S::kIdle) return S::kPreBackward;
      if (state == S::kPreBackward || state == S::kPostBackward) return state;
      break;
    case UnitEvent::kPostBackward:
      if (state == S::kIdle || state == S::kPreBackward) return S::kPostBackward;
      break;
    case UnitEvent::kEndOfPass:
      return S::kIdle;
  }
  DDP_CHECK(false, "ddp: internal error: FSDP unit '", unit, "' got ", to_string(event), " in state ",
            to_string(state), "; please report this with the model's forward");
}

/// FSDP2's MixedPrecisionPolicy, from FSDPOptions: unset means "the
/// parameters' own dtype".
struct MixedPrecisionPolicy {
  std::optional<at::ScalarType> param_dtype;   ///< gathered and computed in
  std::optional<at::ScalarType> reduce_dtype;  ///< gradients summed across ranks in
  std::optional<at::ScalarType> output_dtype;  ///< the root's floating outputs cast to

  static MixedPrecisionPolicy of(const FSDPOptions& options) {
    return {options.param_dtype(), options.reduce_dtype(), options.output_dtype()};
  }
};

/// A MixedPrecisionPolicy resolved for one unit, whose parameters are of
/// dtype `own`: every dtype known.
struct UnitPrecision {
  at::ScalarType own = at::kFloat;    ///< the shard's, its gradient's and the optimizer's
  at::ScalarType param = at::kFloat;  ///< `full`'s; gradients arrive in it
  /// The flat gradient's: `param`, or a wider reduce_dtype (the gradients
  /// cast to it exactly while they are flattened). Any other reduce_dtype is
  /// a compress_hook around the unit's hook instead.
  at::ScalarType flat_gradient = at::kFloat;
  /// What gradients are summed across ranks in (the shard group and, under
  /// HSDP, the replicas): reduce_dtype, or `param`.
  at::ScalarType reduce = at::kFloat;

  static UnitPrecision resolve(const MixedPrecisionPolicy& policy, at::ScalarType own);
  /// Whether `full` is a cast copy of the parameters, not their own values.
  bool casts() const { return param != own; }
};

class UnitGather;

/// One FSDP unit: a flat group of parameters (FSDP2's FSDPParamGroup), its
/// state and its lifecycle.
class FsdpUnit {
 public:
  enum class ShardedState { kSharded, kUnsharding, kUnsharded };

  std::string name;
  std::vector<at::Tensor> params;  ///< the module's own leaf tensors, in layout order
  FlatLayout layout;               ///< names (dotted, in the root module), offsets, shapes, this rank's shard
  UnitPrecision precision;
  std::shared_ptr<UnitGather> gather;
  /// How the gradient is summed across the shard group:
  /// FSDPOptions::comm_hook, or compress_hook(reduce_dtype); null, the
  /// UnitReduce's own collective.
  std::shared_ptr<CommHook> hook;
  at::Tensor full;   ///< layout.padded elements in precision.param; memory only while unsharded
  at::Tensor shard;  ///< this rank's part in precision.own; the optimizer's parameter
  bool is_root = false;
  bool reshard_after_forward = true;
  /// Called when unshard() allocates `full` (the runtime's peak memory).
  std::function<void()> on_allocate;

  // One backward pass: the reduction's tensors, which finish_group reads.
  at::Tensor gradient_flat;   ///< all-reduced or on one rank: the result is the flat gradient itself
  at::Tensor gradient_shard;  ///< reduce-scattered: where this rank's part lands
  /// no_sync(): the sum of the unsharded gradients of passes whose
  /// reduction was skipped, reduced with the next synchronised one.
  at::Tensor unsynced_gradient;

  TrainingState training_state() const { return training_state_; }
  ShardedState sharded_state() const { return sharded_state_; }
  bool gathered() const { return sharded_state_ == ShardedState::kUnsharded; }

  /// Starts gathering `full` from the shards (no-op if under way or done).
  void unshard();
  /// Gathers (unless under way) and waits: `full` holds every rank's values.
  void wait_for_unshard();
  /// Frees `full` (after waiting for a gather under way), unless the gather
  /// keeps it (the shard is the full tensor).
  void reshard();
  /// The shards changed (a load): a gathered `full` is gathered again.
  void regather();

  void pre_forward();
  /// `reshard_now`: free `full` (reshard_after_forward, or no backward
  /// follows); otherwise it stays gathered for backward.
  void post_forward(bool reshard_now);
  /// Returns whether this call began the unit's backward (false: it had).
  bool pre_backward();
  /// The unit's gradients are final: returns them as one flat tensor of
  /// layout.padded elements in precision.flat_gradient (zeros where a
  /// parameter has none, plus what no_sync() passes kept), releasing the
  /// parameters' own gradients and the unit's full parameters.
  at::Tensor post_backward();
  /// The pass is over (or abandoned): back to kIdle, per-pass tensors dropped.
  void end_pass();

 private:
  at::Tensor flatten_gradients();

  TrainingState training_state_ = TrainingState::kIdle;
  ShardedState sharded_state_ = ShardedState::kUnsharded;  // built from full parameters
  c10::intrusive_ptr<c10d::Work> pending_gather_;
  at::Tensor gather_input_;  // the shard cast to precision.param, while its all-gather runs
};

/// How a unit's full parameters come from its shard, chosen per unit at
/// construction: an all-gather over the shard group (sharded strategies), a
/// cast (kNoShard under param_dtype), or nothing at all (kNoShard: the shard
/// is the full tensor).
class UnitGather {
 public:
  virtual ~UnitGather() = default;
  /// This rank's elements of a flat tensor laid out as `layout`.
  virtual ShardRange shard_of(const FlatLayout& layout) const = 0;
  /// Whether `full` is memory of its own, given back after use.
  virtual bool frees_full() const { return true; }
  /// Starts filling unit.full (allocated) from `input` (unit.shard in
  /// precision.param): the collective to wait for, or null when full is
  /// filled already.
  virtual c10::intrusive_ptr<c10d::Work> start(FsdpUnit& unit, at::Tensor& input) = 0;
  /// Waits for what start() returned; an error names the rank.
  virtual void wait(const c10::intrusive_ptr<c10d::Work>& work) = 0;
  /// A tensor of shard_of()'s length (the shard, or its optimizer state) as
  /// all `padded` elements, in its own dtype; collective where sharded.
  virtual at::Tensor gather_now(const at::Tensor& part, int64_t padded, const std::string& what) = 0;
};

/// The sharded strategies: an all-gather over `group`.
std::shared_ptr<UnitGather> all_gather(std::shared_ptr<ProcessGroup> group);
/// kNoShard: every rank holds the whole padded flat tensor; gathering is a
/// cast when `casts`, and nothing at all otherwise.
std::shared_ptr<UnitGather> keep_whole(bool casts);

/// How a unit's (averaged) gradient is summed across the shard group, chosen
/// once at construction: a reduce-scatter into the shard, an all-reduce
/// (kNoShard), or nothing (one rank). Each runs the unit's hook, or without
/// one its collective directly.
class UnitReduce {
 public:
  virtual ~UnitReduce() = default;
  /// Before a unit's gradient is flattened: waiting here for the previous
  /// unit's reduce-scatter bounds how many full gradients exist at once when
  /// backward computes faster than they run (on CPUs, say), as FSDP2's one
  /// reduce-scatter in flight does; it costs nothing when communication keeps up.
  virtual void before_flatten() {}
  /// Starts reducing `flat`, the unit's gradient divided by the ranks it is
  /// averaged over, as bucket `position` of the pass. The future's value is
  /// this rank's part of the sum (unit.gradient_shard or gradient_flat, or
  /// what the hook returned).
  virtual c10::intrusive_ptr<c10::ivalue::Future> launch(FsdpUnit& unit, at::Tensor flat, size_t position,
                                                        bool is_last) = 0;
  /// Every unit of the pass has been launched.
  virtual void before_waiting() {}
  /// The pass ended or was abandoned: nothing in flight is waited for any more.
  virtual void reset() {}
  /// For the engine's messages: "reduce-scatters".
  virtual std::string collectives() const = 0;
  /// For the collective trace: "reduce-scatter".
  virtual std::string tag() const = 0;
};

/// A reduce-scatter into the shard over `group` (sharded strategies).
std::unique_ptr<UnitReduce> reduce_scatter(std::shared_ptr<ProcessGroup> group);
/// An all-reduce of the whole flat gradient over `group` (kNoShard).
std::unique_ptr<UnitReduce> all_reduce(std::shared_ptr<ProcessGroup> group);
/// One rank: the gradient is already the sum.
std::unique_ptr<UnitReduce> local_reduce();
/// HSDP's replicate stage around `shard_reduce`: once a unit's reduction in
/// the shard group is done, its shard is all-reduced across `replicate`.
std::unique_ptr<UnitReduce> then_across_replicas(std::unique_ptr<UnitReduce> shard_reduce,
                                                 std::shared_ptr<ProcessGroup> replicate);
/// The same stage through FSDPOptions::replicate_hook, which averages across
/// replicas FSDP does not know; its run() is given `group`.
std::unique_ptr<UnitReduce> then_replicate_hook(std::unique_ptr<UnitReduce> shard_reduce,
                                                std::shared_ptr<CommHook> hook, std::shared_ptr<ProcessGroup> group);

/// The groups FSDP runs over. Units are sharded over `shard`; under HSDP
/// each shard's gradient is then all-reduced over `replicate` (null
/// otherwise). `whole` is every rank of the model (both together): module
/// states are made rank 0's over it, and "rank 0" means its rank 0.
struct FsdpGroups {
  std::shared_ptr<ProcessGroup> shard;
  std::shared_ptr<ProcessGroup> replicate;
  std::shared_ptr<ProcessGroup> whole;
};
/// One group: plain FSDP, or with a hybrid strategy the launcher's nodes x
/// local ranks (DeviceMesh::from_launcher, collective).
FsdpGroups fsdp_groups(std::shared_ptr<ProcessGroup> group, const FSDPOptions& options);
/// A 1-D mesh is plain FSDP over its group; a 2-D one is HSDP, dimension 0
/// replicating and dimension 1 sharding (FSDP2's layout).
FsdpGroups fsdp_groups(const DeviceMesh& mesh);

/// FullyShardedDataParallel, independent of the module type: units, their
/// gathering and freeing, and state dicts. As the gradient engine's reduction
/// policy, a unit is a group: when its gradients are final it is flattened
/// and reduced into the shard.
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
  /// What floating inputs become (FSDPOptions::param_dtype).
  std::optional<at::ScalarType> input_dtype() const { return precision_.param_dtype; }
  std::optional<at::ScalarType> output_dtype() const { return precision_.output_dtype; }

  StateDict full_state_dict(bool rank0_only);
  void load_full_state_dict(const StateDict& state);
  /// load_full_state_dict from a torch.save file, reading only this rank's
  /// part of each parameter (src/sharding/fsdp_full_state_file.cpp).
  void load_full_state_dict_file(const std::string& path);
  c10::IValue full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only);
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state);
  c10::IValue sharded_state_dict(torch::optim::Optimizer* optimizer);
  void load_sharded_state_dict(const c10::IValue& state, torch::optim::Optimizer* optimizer);

  const std::shared_ptr<ProcessGroup>& shard_group() const { return group_; }
  const std::shared_ptr<ProcessGroup>& replicate_group() const { return replicate_group_; }
  /// The strategy in force (see FullyShardedDataParallel::sharding_strategy).
  ShardingStrategy sharding_strategy() const { return strategy_in_force_; }

  void gather_all();
  void free_all();
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

 private:
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
  /// The unit's hook: FSDPOptions::comm_hook, compress_hook(reduce_dtype)
  /// when the gradients are not summed in their own dtype, or null.
  std::shared_ptr<CommHook> hook_for(const UnitPrecision& precision) const;
  /// After the units are formed: frozen parameters under param_dtype, each
  /// unit's reshard_after_forward, then the gradient engine.
  void finish_construction();
  void register_pre_backward(size_t unit, const std::vector<at::Tensor>& outputs);
  void pre_backward(size_t unit);
  void end_pass();
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

  /// Each parameter's index in the root's named_parameters(), by name:
  /// the unwrapped model's optimizer-state keys.
  std::map<std::string, int64_t> parameter_indices() const;
  // Buffers and frozen parameters: whole on every rank.
  std::vector<std::pair<std::string, at::Tensor>> replicated() const;

  std::shared_ptr<torch::nn::Module> root_;
  std::shared_ptr<ProcessGroup> group_;             // the shard group
  std::shared_ptr<ProcessGroup> replicate_group_;  // HSDP only
  std::shared_ptr<ProcessGroup> whole_group_;
  FSDPOptions options_;
  MixedPrecisionPolicy precision_;
  ShardingStrategy strategy_in_force_ = ShardingStrategy::kFullShard;
  std::unique_ptr<UnitReduce> reduce_;
  /// What FSDP divides gradients by: the ranks it knows to hold a unit,
  /// shard x replicate (the shard group alone with a replicate_hook, which
  /// averages over its replicas itself).
  int64_t data_parallel_size_ = 1;
  // requires_grad false: not sharded. Their values in their own dtype (the
  // module's tensors themselves, or their originals under param_dtype).
  std::vector<std::pair<std::string, at::Tensor>> frozen_;
  std::set<const at::TensorImpl*> claimed_;  // parameters already in a unit or in frozen_ (construction)
  std::vector<at::Tensor> frozen_params_;  // the module's tensors, parallel to frozen_
  std::vector<std::unique_ptr<FsdpUnit>> units_;  // the root unit, if any, is last
  std::vector<std::vector<size_t>> sequential_groups_;  // children of a Sequential root, by unit
  std::vector<size_t> sequential_unit_of_group_;
  std::vector<size_t> forward_order_;       // this iteration's non-root units, as they ran
  std::vector<size_t> last_forward_order_;  // the previous iteration's, for prefetching
  std::vector<size_t> launch_position_;     // per unit: its place in this backward pass's launch order
  bool built_deferred_ = false;  // from a DeferredSequential: the module is never gathered back whole
  int64_t peak_parameter_bytes_ = 0;
  std::unique_ptr<GradientSyncEngine> engine_;  // last: its hooks call the members above
};

}  // namespace ddp::detail
