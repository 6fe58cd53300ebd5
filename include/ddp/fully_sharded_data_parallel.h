#pragma once

// FullyShardedDataParallel: DDP's memory limit lifted by sharding. Each unit
// of the model keeps its parameters as one flat tensor split across the
// ranks; a rank holds 1/N of every unit's parameters, of their gradients and
// (through an optimizer built over parameters()) of the optimizer state. A
// unit's full parameters exist only while it computes:
//
//   auto group = ddp::init_process_group();
//   torch::nn::Sequential net(...);                       // 50 Linear layers, say
//   ddp::FullyShardedDataParallel<torch::nn::Sequential> model(
//       net, group, ddp::FSDPOptions().min_num_params(10'000'000));
//   torch::optim::Adam optimizer(model.parameters(), 1e-3);   // this rank's shards
//   ...
//   auto loss = torch::nn::functional::cross_entropy(model.forward(x), y);
//   loss.backward();    // gradients reduce-scattered into each rank's shard
//   optimizer.step();   // steps this rank's shard only
//
// LibTorch modules have no forward hooks, so FSDP cannot intercept a
// submodule's forward on its own. Units are therefore chosen where FSDP can
// see them run:
//  * the children of a torch::nn::Sequential root, grouped by size
//    (FSDPOptions::min_num_params) or listed by name (FSDPOptions::units);
//  * any submodule the model wraps with ddp::fsdp_unit(...) where it is built;
//  * everything else belongs to the root unit, gathered for the whole forward.
//
// Frozen parameters (requires_grad false) are not sharded: like buffers, every
// rank keeps them whole, and they are not among parameters().
//
// Deferred construction, for a model that does not fit on one rank: give the
// children of a torch::nn::Sequential as factories (DeferredSequential), and
// FullyShardedDataParallel builds them one at a time. Each child is built,
// checked against the other ranks, given rank 0's values, sharded, and its
// full storage freed before the next one is built, so a rank never holds more
// than the shards plus one child:
//
//   torch::manual_seed(0);                               // the same on every rank
//   ddp::DeferredSequential layers;
//   for (int i = 0; i < 48; ++i) layers.add([] { return torch::nn::Linear(8192, 8192); });
//   ddp::FullyShardedDataParallel<torch::nn::Sequential> model(layers, group);
//   model.load_full_state_dict_file("full.pt");          // optional: reads only this rank's bytes
//   ...
//   ddp::save_distributed_checkpoint("ckpt", model, &optimizer);  // each rank writes its shards; no gather
//
// Why factories: a LibTorch module allocates and initialises its parameters
// in its constructor, and the C++ frontend has no meta device or "skeleton"
// mode to build a module without storage. The only way not to hold the whole
// model is not to construct it whole, and a factory per unit says exactly
// that with the modules users already have (a Linear, a transformer block),
// their own initialisation included. Each child is one
// unit, named by its position ("0", "1", ...) unless add() names it, so the
// model trains exactly as the same Sequential built whole and wrapped with
// FSDPOptions().min_num_params(1) (every child a unit): the same shards, the
// same steps.

#include <ddp/export.h>
#include <ddp/error.h>
#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp {

/// What is sharded; PyTorch's names and meanings.
enum class ShardingStrategy {
  kFullShard,    ///< ZeRO-3: parameters, gradients, optimizer state; gathered per unit, freed after use
  kShardGradOp,  ///< ZeRO-2: as kFullShard, but parameters stay gathered from forward to backward
  kNoShard,      ///< DDP: everything replicated, gradients all-reduced
  /// HSDP: kFullShard within each node, replicated across nodes (gradients
  /// reduce-scattered in the node, then all-reduced between the nodes).
  /// Given with a plain process group, the nodes are the launcher's
  /// (DeviceMesh::from_launcher); given with a 2-D DeviceMesh, the mesh's.
  kHybridShard,
  kHybridShardZero2,  ///< HSDP with kShardGradOp within each node
};

/// "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" or
/// "hybrid_shard_zero2" (PyTorch's upper-case names, and its
/// "_hybrid_shard_zero2", too); throws on anything else.
DDP_API ShardingStrategy parse_sharding_strategy(const std::string& name);
DDP_API std::string to_string(ShardingStrategy strategy);

/// Per-unit settings, by unit name (as unit_names() lists them).
using FsdpUnitFlags = std::map<std::string, bool>;

/// Options for FullyShardedDataParallel.
///
///   ddp::FSDPOptions().sharding_strategy(ddp::ShardingStrategy::kShardGradOp).min_num_params(1'000'000)
struct FSDPOptions {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  /// A torch::nn::Sequential root: consecutive children are grouped into
  /// units of at least this many parameters (size-based auto-wrap). 0: off.
  TORCH_ARG(int64_t, min_num_params) = 0;
  /// A torch::nn::Sequential root: these children (by name: "0", "3", ...)
  /// each become a unit. Combined with min_num_params, listed children are
  /// units of their own and the rest are grouped by size.
  TORCH_ARG(std::vector<std::string>, units) = {};
  /// Per unit: free its gathered parameters after its forward (true, what
  /// kFullShard does) or keep them until its backward (false, what
  /// kShardGradOp does). Units not named keep their strategy's behaviour;
  /// the root unit stays gathered from forward to backward either way.
  ///   FSDPOptions().reshard_after_forward({{"block", false}})
  TORCH_ARG(FsdpUnitFlags, reshard_after_forward) = {};
  /// While a unit runs forward, gather the next unit's parameters.
  TORCH_ARG(bool, forward_prefetch) = true;
  /// While a unit runs backward, gather the parameters of the unit whose
  /// backward comes next.
  TORCH_ARG(bool, backward_prefetch) = true;
  /// Check that all ranks built the same model and copy rank 0's parameters
  /// and buffers to every rank before sharding.
  TORCH_ARG(bool, sync_module_states) = true;
  /// The dtype gradients are reduce-scattered (all-reduced under kNoShard)
  /// in, e.g. at::kHalf or at::kBFloat16 to halve the bytes sent: each
  /// unit's gradient is divided by the world size, cast to it, summed across
  /// ranks in it, and the shard's part cast back to the parameters' dtype.
  /// The same arithmetic as DDPOptions().comm_hook(ddp::fp16_compress_hook())
  /// (or bf16_compress_hook()). Unset: the parameters' dtype (PyTorch's
  /// MixedPrecision(reduce_dtype=...)).
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// The dtype a unit's parameters are gathered and computed in (PyTorch
  /// FSDP2's MixedPrecisionPolicy(param_dtype=...)): each rank's shard, what
  /// the optimizer steps, stays in the parameters' own dtype (the master
  /// weights), is cast to param_dtype before the all-gather, and floating-
  /// point tensor inputs of the forward (the root's and each unit's) are cast
  /// to it too. Gradients then arrive in param_dtype; they are reduced in
  /// reduce_dtype (unset: param_dtype) and land in the shard's gradient in the
  /// shard's dtype. Halves the gathered parameters' memory and the all-gather
  /// traffic with at::kBFloat16. Inside summon_full_params() the module's
  /// parameters are in param_dtype too; full_state_dict() always comes from
  /// the shards, in their own dtype, and destroying the wrapper gives the
  /// module its own dtype back. Unset: no casts.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// The dtype floating-point tensor results of the root's forward are cast
  /// to (FSDP2's output_dtype), e.g. at::kFloat so a loss runs in float32
  /// after a bfloat16 forward. Unset: results stay as computed.
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
  /// How each unit's gradient is reduce-scattered (all-reduced under
  /// kNoShard): the GradBucket a hook gets holds the unit's flat gradient,
  /// divided by the world size, and, when sharded, the shard it must be
  /// reduce-scattered into (GradBucket::scatters()). The same hooks as
  /// DDPOptions::comm_hook: fp16_compress_hook() and bf16_compress_hook()
  /// work for both. Null: a plain reduce-scatter (or, with a reduce_dtype
  /// narrower than the gradients, the matching compression). Not combinable
  /// with reduce_dtype. At one rank there is nothing to reduce: neither the
  /// hook nor a compression runs.
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;
  /// HSDP's across-replica stage through a hook, for replicas whose
  /// membership changes between steps (ddp::FaultTolerance::comm_hook()), so
  /// that FSDP holds no replicate group: build FSDP over one replica's ranks
  /// (a process group, or a 1-D mesh) and give the hook. After a unit's
  /// reduction in that group, whose gradient FSDP divides by that group's
  /// size only, the hook gets a GradBucket whose buffer() is the unit's
  /// reduced shard (the whole unit under kNoShard, or on a group of one
  /// rank) in the reduce dtype, index() its place in the pass's launch order
  /// and is_last() on the pass's last unit; it never scatters(). Its run()
  /// is given the group FSDP was built over. The future's value (a tensor,
  /// or a list whose first is it) must be that shard averaged across the
  /// replicas: the hook divides by their number itself. It lands in the
  /// shard's gradient as HSDP's all-reduce across replicas does, and a
  /// future that fails fails the backward with an error naming the unit.
  /// Hooks run in launch order, one per unit on every rank, also for a unit
  /// whose reduction failed on this rank (on zeros). FSDP sees that group
  /// only: sync_module_states and state dicts cover one replica, so the
  /// replicas must start alike (the hook's owner sees to it). Not
  /// combinable with a mesh or hybrid strategy that already replicates over
  /// several ranks.
  ///
  ///   ddp::FSDPOptions().replicate_hook(fault_tolerance.comm_hook())
  TORCH_ARG(std::shared_ptr<CommHook>, replicate_hook) = nullptr;
};

/// A torch::nn::Sequential given as one factory per child, for
/// FullyShardedDataParallel to build one unit at a time (deferred
/// construction, see the top of this file). A factory returns a module
/// holder (torch::nn::Linear(...)), a shared_ptr to a module, or an
/// AnyModule (so, as for any Sequential child, a module whose forward has
/// fixed argument and result types: not a Sequential itself, nor an
/// fsdp_unit); every rank must call add() alike, and a factory that draws
/// random numbers draws them from the global generator in order, as building
/// the whole Sequential would.
///
///   ddp::DeferredSequential().add([] { return torch::nn::Linear(1024, 1024); })
///                            .add("head", [] { return torch::nn::Linear(1024, 10); })
class DeferredSequential {
 public:
  using Factory = std::function<torch::nn::AnyModule()>;

  /// A child named by its position, as Sequential names them ("0", "1", ...).
  template <typename MakeModule>
  DeferredSequential& add(MakeModule make_module) {
    return add(std::to_string(children_.size()), std::move(make_module));
  }
  template <typename MakeModule>
  DeferredSequential& add(std::string name, MakeModule make_module) {
    children_.emplace_back(std::move(name), [make = std::move(make_module)]() {
      if constexpr (std::is_same_v<std::decay_t<decltype(make())>, torch::nn::AnyModule>) {
        return make();
      } else {
        return torch::nn::AnyModule(make());
      }
    });
    return *this;
  }
  const std::vector<std::pair<std::string, Factory>>& children() const { return children_; }

 private:
  std::vector<std::pair<std::string, Factory>> children_;
};

/// Bytes this rank holds for the model's state right now.
struct ShardedMemory {
  int64_t parameter_bytes = 0;  ///< shards, plus any full parameters now gathered
  int64_t gradient_bytes = 0;   ///< gradients of the shards
  /// The most parameter bytes held at any moment since the wrapper was built
  /// (or since reset_peak_memory()): shards plus every unit gathered at once,
  /// in param_dtype when one is set.
  int64_t peak_parameter_bytes = 0;
};

namespace detail {

class FsdpRuntime;

/// The part of an fsdp_unit wrapper that is not a template: the unit it
/// stands for, once a FullyShardedDataParallel has claimed it.
class DDP_API FsdpUnitModule : public torch::nn::Module {
 public:
  /// Runs before the wrapped module's forward: gathers the unit.
  void before_forward();
  /// Runs after it: frees the unit (per strategy) and arranges its gather
  /// for backward on `outputs`.
  void after_forward(const std::vector<at::Tensor>& outputs);
  /// What floating-point inputs are cast to (FSDPOptions::param_dtype).
  std::optional<at::ScalarType> input_dtype() const;
  /// Set by FullyShardedDataParallel; without one the wrapper is a no-op, so
  /// the same model also runs alone or under DistributedDataParallel.
  void attach(FsdpRuntime* runtime, size_t unit) {
    runtime_ = runtime;
    unit_ = unit;
  }
  bool attached() const { return runtime_ != nullptr; }

 protected:
  /// Registers the wrapped module's parameters, buffers and children under
  /// their own names, so that wrapping adds nothing to parameter names and
  /// state dicts keep the keys of the unwrapped model.
  void adopt(const std::shared_ptr<torch::nn::Module>& inner);

 private:
  FsdpRuntime* runtime_ = nullptr;
  size_t unit_ = 0;
};

/// FSDPOptions::param_dtype: floating-point tensor arguments (a tensor or
/// a vector of them) are cast to it; everything else passes through
/// unchanged. A module under FSDP therefore takes its tensors by value or by
/// const reference, as LibTorch's own modules do.
template <typename T>
decltype(auto) cast_input(T&& value, const std::optional<at::ScalarType>& dtype) {
  using Plain = std::decay_t<T>;
  if constexpr (std::is_same_v<Plain, at::Tensor>) {
    if (dtype && value.defined() && value.is_floating_point() && value.scalar_type() != *dtype) {
      return at::Tensor(value.to(*dtype));
    }
    return at::Tensor(std::forward<T>(value));
  } else if constexpr (std::is_same_v<Plain, std::vector<at::Tensor>>) {
    std::vector<at::Tensor> cast(std::forward<T>(value));
    for (auto& tensor : cast) tensor = cast_input(tensor, dtype);
    return cast;
  } else {
    return std::forward<T>(value);
  }
}

/// FSDPOptions::output_dtype: floating-point tensors of a result (a tensor,
/// or a vector, tuple or pair of them) are cast to it.
template <typename T>
void cast_output(T& /*not a tensor*/, at::ScalarType /*dtype*/) {}
inline void cast_output(at::Tensor& value, at::ScalarType dtype) {
  if (value.defined() && value.is_floating_point() && value.scalar_type() != dtype) value = value.to(dtype);
}
inline void cast_output(std::vector<at::Tensor>& values, at::ScalarType dtype) {
  for (auto& value : values) cast_output(value, dtype);
}
inline void cast_output(c10::IValue& value, at::ScalarType dtype) {
  if (value.isTensor()) {
    at::Tensor tensor = value.toTensor();
    cast_output(tensor, dtype);
    value = tensor;
  }
}
template <typename A, typename B>
void cast_output(std::pair<A, B>& values, at::ScalarType dtype);
template <typename... Ts>
void cast_output(std::tuple<Ts...>& values, at::ScalarType dtype) {
  std::apply([dtype](auto&... value) { (cast_output(value, dtype), ...); }, values);
}
template <typename A, typename B>
void cast_output(std::pair<A, B>& values, at::ScalarType dtype) {
  cast_output(values.first, dtype);
  cast_output(values.second, dtype);
}

/// The tensors of a forward's result; FSDP hooks them to gather each unit
/// again for backward, so a result without tensors is an error.
template <typename T>
std::vector<at::Tensor> forward_outputs(const T& result) {
  std::vector<at::Tensor> outputs;
  collect_tensors(result, outputs);
  DDP_CHECK(!outputs.empty(), "ddp: FSDP needs forward results made of tensors (a tensor, a vector, tuple or "
              "pair of them): they carry the hooks that gather each unit for backward");
  return outputs;
}

}  // namespace detail

/// A submodule wrapped as its own FSDP unit where the model is built:
///
///   block = register_module("block", ddp::fsdp_unit(Block(...)));
///   ... x = block->forward(x);
///
/// Parameter names do not change (no "module." prefix). Outside
/// FullyShardedDataParallel the wrapper just calls the wrapped module.
template <typename ModuleType>
class FsdpUnitImpl : public detail::FsdpUnitModule {
 public:
  explicit FsdpUnitImpl(ModuleType module) : module_(std::move(module)) { adopt(detail::as_module_ptr(module_)); }

  template <typename... Args>
  auto forward(Args&&... args) {
    if (!attached()) return module_->forward(std::forward<Args>(args)...);
    before_forward();
    const auto dtype = input_dtype();
    auto result = module_->forward(detail::cast_input(std::forward<Args>(args), dtype)...);
    after_forward(detail::forward_outputs(result));
    return result;
  }

  ModuleType& module() { return module_; }

 private:
  ModuleType module_;
};

/// Wraps `module` (a ModuleHolder or a shared_ptr to a Module) as an FSDP unit.
template <typename ModuleType>
std::shared_ptr<FsdpUnitImpl<ModuleType>> fsdp_unit(ModuleType module) {
  return std::make_shared<FsdpUnitImpl<ModuleType>>(std::move(module));
}

/// Releases full parameters gathered by summon_full_params() when destroyed.
class DDP_API FullParamsGuard {
 public:
  explicit FullParamsGuard(detail::FsdpRuntime& runtime);
  FullParamsGuard(FullParamsGuard&& other) noexcept : runtime_(other.runtime_) { other.runtime_ = nullptr; }
  FullParamsGuard(const FullParamsGuard&) = delete;
  FullParamsGuard& operator=(const FullParamsGuard&) = delete;
  FullParamsGuard& operator=(FullParamsGuard&&) = delete;
  ~FullParamsGuard();

 private:
  detail::FsdpRuntime* runtime_;
};

/// Turns gradient synchronisation back on when destroyed (see
/// FullyShardedDataParallelBase::no_sync()).
class DDP_API FsdpNoSyncGuard {
 public:
  explicit FsdpNoSyncGuard(detail::FsdpRuntime& runtime);
  FsdpNoSyncGuard(FsdpNoSyncGuard&& other) noexcept : runtime_(other.runtime_), previous_(other.previous_) {
    other.runtime_ = nullptr;
  }
  FsdpNoSyncGuard(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(FsdpNoSyncGuard&&) = delete;
  ~FsdpNoSyncGuard();

 private:
  detail::FsdpRuntime* runtime_;
  bool previous_;
};

/// What FullyShardedDataParallel does whatever the module's type: everything
/// but forward() and module(). Its runtime (units, gathers, reduce-scatters)
/// is internal to the library and may change in any release.
class DDP_API FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallelBase(FullyShardedDataParallelBase&&) noexcept;
  FullyShardedDataParallelBase& operator=(FullyShardedDataParallelBase&&) noexcept;
  FullyShardedDataParallelBase(const FullyShardedDataParallelBase&) = delete;
  FullyShardedDataParallelBase& operator=(const FullyShardedDataParallelBase&) = delete;

  /// This rank's shards, one flat tensor per unit: what the optimizer must
  /// be built over (an elementwise optimizer such as SGD, Adam or AdamW then
  /// steps exactly as it would on the full parameters).
  std::vector<at::Tensor> parameters() const;

  /// Gathers every unit's full parameters until the guard is destroyed, for
  /// evaluation or inspection. Collective.
  [[nodiscard]] FullParamsGuard summon_full_params();

  /// The unwrapped model's state dict (same keys, full tensors), on rank 0
  /// only unless rank0_only is false; other ranks get an empty one.
  /// Collective.
  StateDict full_state_dict(bool rank0_only = true);
  /// Loads a full state dict (from any world size, or from an unwrapped
  /// model) on every rank; each keeps its shard.
  void load_full_state_dict(const StateDict& state);
  /// Loads a full state dict file (ddp::save_state_dict's or Python's
  /// torch.save(model.state_dict(), path)) straight into the shards: each
  /// rank reads only the bytes of its own part of each parameter (and the
  /// buffers and frozen parameters, which every rank keeps whole), so the
  /// whole model is never in memory. The same checks as
  /// load_full_state_dict: every entry present with its shape, none extra;
  /// on an error nothing of the model has changed. Every rank reads the file
  /// itself (a shared file system, or a copy per node). Collective only in
  /// that every rank must call it.
  void load_full_state_dict_file(const std::string& path);

  /// `optimizer`'s state (built over parameters()) in the layout of Python's
  /// optimizer.state_dict() for the unwrapped model: one entry per original
  /// parameter. Loadable at any world size and by any strategy. Collective.
  c10::IValue full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only = true);
  /// Loads what full_optim_state_dict returned (every rank needs it all).
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state);

  /// This rank's shards, buffers and (if given) optimizer state, in memory:
  /// what save_distributed_checkpoint writes (<ddp/distributed_checkpoint.h>),
  /// which is the way to put them on disk and to load them at another world
  /// size. load_sharded_state_dict takes only this job's own: the same world
  /// size, rank and units.
  c10::IValue sharded_state_dict(torch::optim::Optimizer* optimizer = nullptr);
  void load_sharded_state_dict(const c10::IValue& state, torch::optim::Optimizer* optimizer = nullptr);

  /// Gradient accumulation without communication, as DDP's no_sync():
  ///
  ///   { auto guard = model.no_sync(); loss_of(micro_batch_1).backward(); }
  ///   loss_of(micro_batch_2).backward();  // reduce-scatters the sum of both
  ///
  /// Backward passes inside the scope start no reduce-scatter: each unit's
  /// full (unsharded) gradient is summed locally, which holds a full
  /// gradient per unit until the next synchronised backward.
  [[nodiscard]] FsdpNoSyncGuard no_sync();
  /// The same without a scope: false skips synchronisation until it is set
  /// back to true (PyTorch FSDP2's set_requires_gradient_sync).
  void set_requires_gradient_sync(bool sync);

  /// The units, by name ("" is the root unit).
  std::vector<std::string> unit_names() const;
  ShardedMemory memory() const;
  /// Starts ShardedMemory::peak_parameter_bytes again from what is held now.
  void reset_peak_memory();
  /// Every rank of the model: the group (or the mesh's) it was built with.
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }
  /// The ranks each unit is sharded over: process_group() itself, or under
  /// HSDP this rank's shard group (the mesh's second dimension).
  const std::shared_ptr<ProcessGroup>& shard_group() const;
  /// Under HSDP the ranks holding the same shards (the mesh's first
  /// dimension); null otherwise.
  const std::shared_ptr<ProcessGroup>& replicate_group() const;
  /// The strategy in force: kNoShard when the shard group has one rank
  /// whatever was asked, since one rank then holds everything; kHybridShard
  /// or kHybridShardZero2 under HSDP.
  ShardingStrategy sharding_strategy() const;

 protected:
  /// Forms the units of `root` (see FullyShardedDataParallel's constructors).
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<ProcessGroup> group,
                               const FSDPOptions& options);
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> root, const DeviceMesh& mesh,
                               const FSDPOptions& options);
  /// Deferred construction: builds `children` into the empty `root`.
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::SequentialImpl> root, const DeferredSequential& children,
                               std::shared_ptr<ProcessGroup> group, const FSDPOptions& options);
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::SequentialImpl> root, const DeferredSequential& children,
                               const DeviceMesh& mesh, const FSDPOptions& options);
  ~FullyShardedDataParallelBase();

  // The steps of forward() around the module's own.
  void begin_forward();
  void end_forward(const std::vector<at::Tensor>& outputs);
  /// FSDPOptions::param_dtype, if it casts: what floating inputs become.
  std::optional<at::ScalarType> input_dtype() const;
  std::optional<at::ScalarType> output_dtype() const;
  /// Whether the root is a Sequential whose children form units, run by
  /// run_sequential() so that each unit is gathered around its children.
  bool runs_sequential() const;
  at::Tensor run_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input);

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<detail::FsdpRuntime> runtime_;
};

/// Wraps a module (a ModuleHolder or a shared_ptr to a Module) for fully
/// sharded data-parallel training over `group`.
template <typename ModuleType>
class FullyShardedDataParallel : public FullyShardedDataParallelBase {
 public:
  /// Checks that all ranks built the same model, copies rank 0's weights,
  /// forms the units and keeps only this rank's shard of each. Collective.
  FullyShardedDataParallel(ModuleType module, std::shared_ptr<ProcessGroup> group, FSDPOptions options = {})
      : FullyShardedDataParallelBase(detail::as_module_ptr(module), std::move(group), options),
        module_(std::move(module)) {}

  /// HSDP on a 2-D mesh, as FSDP2's fully_shard(mesh=...): each unit is
  /// sharded along the mesh's second dimension ("shard": the ranks of one
  /// node, from DeviceMesh::from_launcher) and replicated along its first
  /// ("replicate"): a gradient is reduce-scattered within its shard group,
  /// then its shard all-reduced across the replicate group, so the heavy
  /// all-gathers and reduce-scatters stay inside a node and only 1/shard-size
  /// of the gradients crosses between nodes. Every strategy applies within
  /// the shard dimension (kHybridShard means kFullShard here, and
  /// kHybridShardZero2 kShardGradOp); every option works as with one group.
  /// A 1-D mesh is plain FSDP over its group. Collective over the mesh.
  ///
  ///   auto mesh = ddp::DeviceMesh::from_launcher(world);   // nodes x local ranks
  ///   ddp::FullyShardedDataParallel<Net> model(net, mesh);
  FullyShardedDataParallel(ModuleType module, const DeviceMesh& mesh, FSDPOptions options = {})
      : FullyShardedDataParallelBase(detail::as_module_ptr(module), mesh, options), module_(std::move(module)) {}

  /// Deferred construction (see the top of this file): builds the
  /// Sequential's children one at a time, each a unit, sharding and freeing
  /// each before building the next. With sync_module_states (the default)
  /// every child is checked against the other ranks and takes rank 0's
  /// values; without it, the factories must produce the same values on
  /// every rank (seed the generator alike). Only for
  /// FullyShardedDataParallel<torch::nn::Sequential>. The Sequential built
  /// holds parameters only while gathered, and keeps none when the wrapper
  /// is destroyed (gathering the whole model then could exceed a rank's
  /// memory): take the weights out with save_distributed_checkpoint()
  /// (<ddp/distributed_checkpoint.h>), where every rank writes its own
  /// shards, which loads at any world size and in Python's dcp.load.
  /// full_state_dict() would gather the whole model on rank 0, the very
  /// thing deferred construction avoids. Collective.
  FullyShardedDataParallel(const DeferredSequential& children, std::shared_ptr<ProcessGroup> group,
                           FSDPOptions options = {})
      : FullyShardedDataParallel(empty_sequential(), children, std::move(group), options) {}
  /// Deferred construction on a mesh (HSDP, as above).
  FullyShardedDataParallel(const DeferredSequential& children, const DeviceMesh& mesh, FSDPOptions options = {})
      : FullyShardedDataParallel(empty_sequential(), children, mesh, options) {}

  /// Runs the model's forward with each unit gathered as it runs. All ranks
  /// must run the same units in the same order.
  template <typename... Args>
  auto forward(Args&&... args) {
    begin_forward();
    const auto dtype = input_dtype();
    auto result = run(detail::cast_input(std::forward<Args>(args), dtype)...);
    end_forward(detail::forward_outputs(result));
    if (auto output = output_dtype()) detail::cast_output(result, *output);
    return result;
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// The wrapped module. Its parameters hold data only while gathered (in
  /// forward, backward, or inside summon_full_params()).
  ModuleType& module() { return module_; }
  auto operator->() { return &*module_; }

 private:
  template <typename Group>
  FullyShardedDataParallel(torch::nn::Sequential built, const DeferredSequential& children, Group&& group,
                           const FSDPOptions& options)
      : FullyShardedDataParallelBase(built.ptr(), children, std::forward<Group>(group), options),
        module_(std::move(built)) {}

  template <typename... Args>
  auto run(Args&&... args) {
    if constexpr (std::is_same_v<ModuleType, torch::nn::Sequential> && sizeof...(Args) == 1) {
      if (runs_sequential()) return run_sequential(*module_, std::forward<Args>(args)...);
    }
    return module_->forward(std::forward<Args>(args)...);
  }

  static torch::nn::Sequential empty_sequential() {
    static_assert(std::is_same_v<ModuleType, torch::nn::Sequential>,
                  "ddp: deferred construction (DeferredSequential) builds a torch::nn::Sequential; use "
                  "FullyShardedDataParallel<torch::nn::Sequential>");
    return torch::nn::Sequential();
  }

  ModuleType module_;
};

}  // namespace ddp
