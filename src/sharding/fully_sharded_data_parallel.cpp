// FullyShardedDataParallel's construction: the units formed from the
// module, each given its gather, hook and dtypes, the runtime's reduction and
// the gradient engine; and the wrapper's non-template part. How a step runs
// is src/sharding/fsdp_step.cpp (see src/sharding/fsdp_runtime.h).

#include "sharding/fsdp_runtime.h"

#include <ddp/distributed_data_parallel.h>
#include <ddp/error.h>

#include "sharding/fsdp_unit_grouping.h"
#include "engine/gradient_sync_engine.h"
#include "common/shard_range.h"

#include <ATen/Functions.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <exception>
#include <map>
#include <set>

namespace ddp {

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  std::string lower;
  for (char c : name) lower.push_back(c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "full_shard") return ShardingStrategy::kFullShard;
  if (lower == "shard_grad_op") return ShardingStrategy::kShardGradOp;
  if (lower == "no_shard") return ShardingStrategy::kNoShard;
  if (lower == "hybrid_shard") return ShardingStrategy::kHybridShard;
  if (lower == "hybrid_shard_zero2" || lower == "_hybrid_shard_zero2") return ShardingStrategy::kHybridShardZero2;
  DDP_CHECK(false, "ddp: unknown sharding strategy '", name,
            "'; use full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2");
}

std::string to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard: return "full_shard";
    case ShardingStrategy::kShardGradOp: return "shard_grad_op";
    case ShardingStrategy::kNoShard: return "no_shard";
    case ShardingStrategy::kHybridShard: return "hybrid_shard";
    case ShardingStrategy::kHybridShardZero2: return "hybrid_shard_zero2";
  }
  return "?";
}

namespace detail {
namespace {

bool is_hybrid(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kHybridShard || strategy == ShardingStrategy::kHybridShardZero2;
}

}  // namespace

FsdpGroups fsdp_groups(std::shared_ptr<ProcessGroup> group, const FSDPOptions& options) {
  DDP_CHECK(group, "ddp: FullyShardedDataParallel needs a process group");
  if (!is_hybrid(options.sharding_strategy())) return {group, nullptr, group};
  // PyTorch's HYBRID_SHARD without process groups: shard within the node,
  // replicate across nodes.
  return fsdp_groups(DeviceMesh::from_launcher(group));
}

FsdpGroups fsdp_groups(const DeviceMesh& mesh) {
  if (mesh.ndim() == 1) return {mesh.group(0), nullptr, mesh.process_group()};
  return {mesh.group(1), mesh.group(0), mesh.process_group()};
}

FsdpRuntime::FsdpRuntime(std::shared_ptr<torch::nn::Module> root, FsdpGroups groups, FSDPOptions options)
    : root_(std::move(root)),
      group_(std::move(groups.shard)),
      replicate_group_(std::move(groups.replicate)),
      whole_group_(std::move(groups.whole)),
      options_(std::move(options)) {
  check_options();
  // The whole model's ranks, replicas included, start from rank 0's values.
  if (options_.sync_module_states() && whole_group_->size() > 1) {
    ReplicaCheckWording wording;
    wording.owner = "FullyShardedDataParallel";
    verify_replicas_match(*root_, *whole_group_, wording);
    broadcast_module_state(*root_, *whole_group_, /*parameters=*/true, /*buffers=*/true);
  }
  build_units();
  finish_construction();
}

FsdpRuntime::FsdpRuntime(std::shared_ptr<torch::nn::SequentialImpl> root, const DeferredSequential& children,
                         FsdpGroups groups, FSDPOptions options)
    : root_(root),
      group_(std::move(groups.shard)),
      replicate_group_(std::move(groups.replicate)),
      whole_group_(std::move(groups.whole)),
      options_(std::move(options)),
      built_deferred_(true) {
  check_options();
  DDP_CHECK(options_.min_num_params() == 0 && options_.units().empty(),
            "ddp: with deferred construction (DeferredSequential) every child is a unit of its own; leave "
            "FSDPOptions::min_num_params and ::units unset, and make one factory build what one unit should hold");
  DDP_CHECK(root->size() == 0, "ddp: deferred construction builds its Sequential itself; it must start empty");
  const bool sync = options_.sync_module_states() && whole_group_->size() > 1;
  for (const auto& [name, make_child] : children.children()) {
    // Only this child is ever whole: it is sharded and its storage freed
    // (add_unit) before the next factory runs.
    torch::nn::AnyModule child = make_child();
    std::shared_ptr<torch::nn::Module> module = child.ptr();
    DDP_CHECK(module != nullptr, "ddp: the DeferredSequential factory of child '", name, "' returned no module");
    for (const auto& item : module->modules(/*include_self=*/true)) {
      DDP_CHECK(!std::dynamic_pointer_cast<FsdpUnitModule>(item),
                "ddp: the DeferredSequential child '", name, "' contains an fsdp_unit wrapper; with deferred "
                "construction each child is already a unit, so build it without ddp::fsdp_unit");
    }
    if (sync) {
      ReplicaCheckWording wording;
      wording.owner = "FullyShardedDataParallel";
      wording.name_prefix = name + ".";
      wording.fix = "Make the DeferredSequential factory of child '" + name +
                    "' build the same module (shapes, dtypes, parameters and buffers) on every rank.";
      verify_replicas_match(*module, *whole_group_, wording);
    }
    root->push_back(name, std::move(child));
    const auto names = parameter_names(*module, name + ".");
    for (const auto& [impl, param_name] : names) {
      DDP_CHECK(!claimed_.count(impl), "ddp: parameter '", param_name, "' is also a parameter of an earlier child "
                "(tied weights); FullyShardedDataParallel does not support tied parameters");
    }
    const size_t frozen_before = frozen_.size();
    auto params = claim_parameters(*module, names);
    if (sync) {
      // Buffers and frozen parameters stay whole on every rank; the trainable
      // parameters take rank 0's values through their flat tensor in add_unit.
      std::vector<at::Tensor> replicated;
      for (size_t i = frozen_before; i < frozen_.size(); ++i) replicated.push_back(frozen_[i].second);
      for (const auto& buffer : module->buffers(/*recurse=*/true)) replicated.push_back(buffer);
      broadcast_tensors(replicated, *whole_group_);
    }
    sequential_groups_.push_back({root->size() - 1});
    sequential_unit_of_group_.push_back(params.empty() ? SIZE_MAX : units_.size());
    if (!params.empty()) add_unit(name, std::move(params), /*broadcast_from_rank0=*/sync);
  }
  finish_construction();
}

void FsdpRuntime::check_options() {
  DDP_CHECK(group_ && whole_group_, "ddp: FullyShardedDataParallel needs a process group");
  DDP_CHECK(group_->is_member() && whole_group_->is_member(), "ddp: global rank ", whole_group_->global_rank(),
            " is not a member of the process group FullyShardedDataParallel was given; build the model only on ",
            "the group's ranks");
  // A hybrid strategy means its within-node strategy on the shard group;
  // the replication is the replicate group's.
  if (options_.sharding_strategy() == ShardingStrategy::kHybridShard) {
    options_.sharding_strategy(ShardingStrategy::kFullShard);
  } else if (options_.sharding_strategy() == ShardingStrategy::kHybridShardZero2) {
    options_.sharding_strategy(ShardingStrategy::kShardGradOp);
  }
  // One replica: plain FSDP over the shard group.
  if (replicate_group_ && replicate_group_->size() == 1) replicate_group_.reset();
  DDP_CHECK(!(options_.replicate_hook() && replicate_group_), "ddp: FSDPOptions::replicate_hook was given with a ",
            "mesh (or a hybrid strategy's launcher nodes) that already replicates across ",
            replicate_group_ ? replicate_group_->size() : 0, " ranks; each is the across-replica stage, so keep one: ",
            "build FSDP over one replica's ranks (mesh.group(\"shard\"), or a 1-D mesh; a plain strategy, not a ",
            "hybrid one) with the hook, or drop replicate_hook");
  // One rank has nothing to shard with: gathering would only copy. PyTorch
  // makes the same switch.
  if (group_->size() == 1) options_.sharding_strategy(ShardingStrategy::kNoShard);
  DDP_CHECK(options_.min_num_params() >= 0, "ddp: FSDPOptions::min_num_params must be >= 0, got ",
              options_.min_num_params());
  DDP_CHECK(!(options_.comm_hook() && options_.reduce_dtype()),
            "ddp: FSDPOptions::comm_hook and reduce_dtype cannot both be set: the hook decides the dtype on the "
            "wire (fp16_compress_hook() and bf16_compress_hook() are reduce_dtype(at::kHalf) and "
            "reduce_dtype(at::kBFloat16)). Keep one of them.");
  precision_ = MixedPrecisionPolicy::of(options_);
  DDP_CHECK(!precision_.param_dtype || at::isFloatingType(*precision_.param_dtype),
            "ddp: FSDPOptions::param_dtype must be a floating-point dtype (at::kBFloat16, at::kHalf, at::kFloat), "
            "got ", *precision_.param_dtype);
  DDP_CHECK(!precision_.reduce_dtype || at::isFloatingType(*precision_.reduce_dtype),
            "ddp: FSDPOptions::reduce_dtype must be a floating-point dtype (at::kBFloat16, at::kHalf, at::kFloat), "
            "got ", *precision_.reduce_dtype);

  // What varies with the strategy is chosen here, once.
  const ShardingStrategy strategy = options_.sharding_strategy();
  if (strategy == ShardingStrategy::kNoShard) {
    reduce_ = group_->size() == 1 ? local_reduce() : all_reduce(group_);
  } else {
    reduce_ = reduce_scatter(group_);
  }
  data_parallel_size_ = group_->size();
  strategy_in_force_ = strategy;
  if (options_.replicate_hook()) {
    // The hook averages across the replicas: FSDP divides by the shard
    // group alone, and its state dicts speak for this replica only.
    reduce_ = then_replicate_hook(std::move(reduce_), options_.replicate_hook(), group_);
  } else if (replicate_group_) {
    reduce_ = then_across_replicas(std::move(reduce_), replicate_group_);
    data_parallel_size_ *= replicate_group_->size();
    if (strategy != ShardingStrategy::kNoShard) {
      strategy_in_force_ = strategy == ShardingStrategy::kFullShard ? ShardingStrategy::kHybridShard
                                                                    : ShardingStrategy::kHybridShardZero2;
    }
  }
}

void FsdpRuntime::finish_construction() {
  DDP_CHECK(!units_.empty(), "ddp: FullyShardedDataParallel needs a model with trainable parameters (requires_grad true)");
  // Under param_dtype frozen parameters compute in it too (activations
  // arrive in param_dtype), while state dicts keep their own dtype: the
  // module gets a cast copy, frozen_ keeps the original.
  for (auto& [name, original] : frozen_) {
    frozen_params_.push_back(original);
    const auto param_dtype = precision_.param_dtype;
    if (!param_dtype || !original.is_floating_point() || original.scalar_type() == *param_dtype) continue;
    at::NoGradGuard no_grad;
    at::Tensor master = original.detach().clone();
    original.set_data(master.to(*param_dtype));
    original = master;
  }
  // The root unit stays gathered from forward to backward whatever it says.
  for (auto& unit : units_) unit->reshard_after_forward = options_.sharding_strategy() == ShardingStrategy::kFullShard;
  for (const auto& [name, reshard] : options_.reshard_after_forward()) {
    auto it = std::find_if(units_.begin(), units_.end(), [&](const auto& unit) { return unit->name == name; });
    std::string names;
    for (const auto& unit : units_) names += " '" + unit->name + "'";
    DDP_CHECK(it != units_.end(), "ddp: FSDPOptions::reshard_after_forward names the unit '", name,
              "', which this model does not have; its units are", names, " ('' is the root unit)");
    (*it)->reshard_after_forward = reshard;
  }
  claimed_.clear();

  // The gradient engine: one group per unit, hooked after the units
  // moved every parameter into its unit's storage (a change of dtype gives
  // a parameter a new gradient accumulator).
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::vector<size_t>> groups;
  for (const auto& unit : units_) {
    groups.emplace_back();
    for (size_t j = 0; j < unit->params.size(); ++j) {
      groups.back().push_back(params.size());
      params.push_back(unit->params[j]);
      names.push_back(unit->layout.names[j]);
    }
  }
  EngineOptions sync;
  sync.owner = " through FullyShardedDataParallel";
  sync.collectives = reduce_->collectives();
  // As in PyTorch's FSDP, a parameter without a gradient contributes zeros.
  sync.allow_unused = true;
  engine_ = std::make_unique<GradientSyncEngine>(std::move(params), std::move(names), group_,
                                                 static_cast<ReductionPolicy&>(*this), sync);
  engine_->set_groups(std::move(groups));
  reset_peak_memory();
}

void FsdpRuntime::set_requires_gradient_sync(bool sync) { engine_->set_require_sync(sync); }

bool FsdpRuntime::requires_gradient_sync() const { return engine_->require_sync(); }

FsdpRuntime::~FsdpRuntime() {
  engine_.reset();  // the hooks go first
  // The module outlives us: leave it with real, full parameters in their own
  // dtype. That is a collective, skipped while an error unwinds (a peer may
  // be dead). Not for a model built deferred: it never was whole on one rank
  // and may not fit now; its weights leave through save_distributed_checkpoint().
  if (std::uncaught_exceptions() > 0 || built_deferred_) return;
  try {
    for (auto& unit : units_) {
      if (!unit->precision.casts()) {
        unit->wait_for_unshard();
        continue;
      }
      // `full` holds param_dtype's rounded values: the module gets the
      // shards' own, gathered.
      unit->reshard();
      at::Tensor whole = unit->gather->gather_now(unit->shard.detach(), unit->layout.padded, "parameters");
      at::NoGradGuard no_grad;
      for (size_t j = 0; j < unit->params.size(); ++j) {
        unit->params[j].mutable_grad().reset();  // in param_dtype: not the parameter's any more
        unit->params[j].set_data(unit->layout.view(whole, j));
      }
    }
    for (size_t i = 0; i < frozen_.size(); ++i) {
      if (!frozen_params_[i].is_same(frozen_[i].second)) frozen_params_[i].set_data(frozen_[i].second);
    }
  } catch (...) {
    // A dead peer: nothing more to gather from.
  }
}

std::map<const at::TensorImpl*, std::string> FsdpRuntime::parameter_names(const torch::nn::Module& module,
                                                                          const std::string& prefix) {
  std::map<const at::TensorImpl*, std::string> name_of;
  for (const auto& item : module.named_parameters(true)) {
    auto [it, fresh] = name_of.emplace(item.value().unsafeGetTensorImpl(), prefix + item.key());
    DDP_CHECK(fresh, "ddp: parameters '", it->second, "' and '", prefix + item.key(),
                "' are one tensor (tied weights); FullyShardedDataParallel does not support tied parameters");
  }
  return name_of;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpRuntime::claim_parameters(
    const torch::nn::Module& module, const std::map<const at::TensorImpl*, std::string>& name_of) {
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& p : module.parameters(true)) {
    if (!claimed_.insert(p.unsafeGetTensorImpl()).second) continue;
    // Frozen parameters stay whole on every rank, like buffers: sharded,
    // the optimizer's step (weight decay, say) would change them.
    if (!p.requires_grad()) frozen_.emplace_back(name_of.at(p.unsafeGetTensorImpl()), p);
    else params.emplace_back(name_of.at(p.unsafeGetTensorImpl()), p);
  }
  return params;
}

void FsdpRuntime::build_units() {
  const auto name_of = parameter_names(*root_, "");
  auto params_of = [&](const torch::nn::Module& module) { return claim_parameters(module, name_of); };

  // Units wrapped where the model was built. named_modules() lists a
  // parent before the units nested in it; claiming in reverse lets a nested
  // unit keep its own parameters.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> wrapped;
  for (const auto& item : root_->named_modules("", /*include_self=*/false)) {
    if (std::dynamic_pointer_cast<FsdpUnitModule>(item.value())) wrapped.emplace_back(item.key(), item.value());
  }
  for (auto it = wrapped.rbegin(); it != wrapped.rend(); ++it) {
    auto params = params_of(*it->second);
    if (params.empty()) continue;
    std::dynamic_pointer_cast<FsdpUnitModule>(it->second)->attach(this, units_.size());
    add_unit(it->first, std::move(params));
  }

  // A Sequential root: its children grouped into units.
  auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(root_.get());
  if (sequential && (options_.min_num_params() > 0 || !options_.units().empty())) {
    DDP_CHECK(wrapped.empty(), "ddp: FSDP takes units either from a Sequential root's options or from "
                "fsdp_unit wrappers, not both");
    std::vector<std::pair<std::string, int64_t>> children;
    for (const auto& item : sequential->named_children()) {
      int64_t numel = 0;
      for (const auto& p : item.value()->parameters(true)) numel += p.numel();
      children.emplace_back(item.key(), numel);
    }
    for (auto& group : group_sequential_children(children, options_.min_num_params(), options_.units())) {
      std::vector<std::pair<std::string, at::Tensor>> params;
      if (group.forms_unit) {
        for (size_t child : group.children) {
          auto more = params_of(*sequential->ptr(child));
          params.insert(params.end(), more.begin(), more.end());
        }
      }
      // A group without a unit (or without trainable parameters) runs with
      // the root unit's parameters gathered.
      sequential_unit_of_group_.push_back(params.empty() ? SIZE_MAX : units_.size());
      sequential_groups_.push_back(std::move(group.children));
      if (!params.empty()) add_unit(group.name, std::move(params));
    }
  }

  auto rest = params_of(*root_);
  if (!rest.empty()) {
    add_unit("", std::move(rest));
    units_.back()->is_root = true;
  }
}

void FsdpRuntime::add_unit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
                           bool broadcast_from_rank0) {
  auto unit = std::make_unique<FsdpUnit>();
  unit->name = std::move(name);
  const at::Tensor& first = params.front().second;
  std::vector<std::string> names;
  for (const auto& [param_name, param] : params) {
    DDP_CHECK(param.scalar_type() == first.scalar_type() && param.device() == first.device(),
                "ddp: all parameters of an FSDP unit need one dtype and device; '", param_name, "' is ",
                param.scalar_type(), " on ", param.device(), " but '", params.front().first, "' is ",
                first.scalar_type(), " on ", first.device());
    names.push_back(param_name);
    unit->params.push_back(param);
  }
  unit->precision = UnitPrecision::resolve(precision_, first.scalar_type());
  const bool casts = unit->precision.casts();
  unit->gather = options_.sharding_strategy() == ShardingStrategy::kNoShard ? keep_whole(casts) : all_gather(group_);
  unit->layout = FlatLayout::of(unit->params, std::move(names), group_->size(), group_->rank());
  unit->layout.shard = unit->gather->shard_of(unit->layout);
  unit->hook = hook_for(unit->precision);
  unit->on_allocate = [this] { note_parameter_memory(); };

  at::NoGradGuard no_grad;
  // The unit's values in the parameters' own dtype: what the shard keeps.
  at::Tensor master = at::zeros({unit->layout.padded}, first.options().requires_grad(false));
  for (size_t j = 0; j < unit->params.size(); ++j) {
    at::Tensor slot = unit->layout.view(master, j);
    slot.copy_(unit->params[j]);
    // Without a cast `master` becomes the unit's full tensor: moving each
    // parameter into it at once frees its own storage, so the unit never
    // exists twice (deferred construction counts on it).
    if (!casts) unit->params[j].set_data(slot);
  }
  if (broadcast_from_rank0) {
    CollectiveTag tag("fsdp unit '" + unit->name + "' broadcast of rank 0's values");
    whole_group_->broadcast(master, 0);
  }
  unit->full = casts ? master.to(unit->precision.param, /*non_blocking=*/false, /*copy=*/true) : master;
  for (size_t j = 0; j < unit->params.size(); ++j) {
    // The parameter keeps its identity and autograd metadata; only its data
    // moves into the flat storage (in param_dtype, if one is set).
    unit->params[j].set_data(unit->layout.view(unit->full, j));
  }
  const ShardRange mine = unit->layout.shard;
  unit->shard = mine == ShardRange{0, unit->layout.padded} ? master.detach()
                                                           : master.narrow(0, mine.begin, mine.numel()).clone();
  unit->shard.requires_grad_(true);
  units_.push_back(std::move(unit));
  units_.back()->reshard();
}

std::shared_ptr<CommHook> FsdpRuntime::hook_for(const UnitPrecision& precision) const {
  if (options_.comm_hook()) return options_.comm_hook();
  // A reduce_dtype wider than the gradients is the flat gradient's own
  // (UnitPrecision::flat_gradient); any other casts around the sum.
  if (precision.reduce != precision.flat_gradient) return compress_hook(precision.reduce);
  return nullptr;
}

std::vector<at::Tensor> FsdpRuntime::shards() const {
  std::vector<at::Tensor> shards;
  for (const auto& unit : units_) shards.push_back(unit->shard);
  return shards;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpRuntime::replicated() const {
  auto tensors = frozen_;
  for (const auto& item : root_->named_buffers(true)) tensors.emplace_back(item.key(), item.value());
  return tensors;
}

std::vector<std::string> FsdpRuntime::unit_names() const {
  std::vector<std::string> names;
  for (const auto& unit : units_) names.push_back(unit->name);
  return names;
}

int64_t FsdpRuntime::held_parameter_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) {
    if (unit->gather->frees_full()) bytes += static_cast<int64_t>(unit->shard.nbytes());
    if (unit->full.storage().nbytes() > 0) bytes += unit->layout.padded * unit->full.element_size();
  }
  for (const auto& [name, tensor] : frozen_) bytes += static_cast<int64_t>(tensor.nbytes());
  return bytes;
}

ShardedMemory FsdpRuntime::memory() const {
  ShardedMemory memory;
  memory.parameter_bytes = held_parameter_bytes();
  for (const auto& unit : units_) {
    if (unit->shard.grad().defined()) memory.gradient_bytes += static_cast<int64_t>(unit->shard.grad().nbytes());
    if (unit->unsynced_gradient.defined()) memory.gradient_bytes += static_cast<int64_t>(unit->unsynced_gradient.nbytes());
  }
  memory.peak_parameter_bytes = std::max(peak_parameter_bytes_, memory.parameter_bytes);
  return memory;
}

void FsdpRuntime::refresh_frozen_parameters() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < frozen_.size(); ++i) {
    if (!frozen_params_[i].is_same(frozen_[i].second)) frozen_params_[i].detach().copy_(frozen_[i].second);
  }
}

void FsdpRuntime::reset_peak_memory() { peak_parameter_bytes_ = held_parameter_bytes(); }

void FsdpRuntime::note_parameter_memory() {
  peak_parameter_bytes_ = std::max(peak_parameter_bytes_, held_parameter_bytes());
}

void FsdpRuntime::gather_all() {
  for (auto& unit : units_) unit->unshard();
  for (auto& unit : units_) unit->wait_for_unshard();
}

void FsdpRuntime::free_all() {
  for (auto& unit : units_) unit->reshard();
}

void FsdpUnitModule::before_forward() { runtime_->unit_before_forward(unit_); }

std::optional<at::ScalarType> FsdpUnitModule::input_dtype() const { return runtime_->input_dtype(); }

void FsdpUnitModule::after_forward(const std::vector<at::Tensor>& outputs) {
  runtime_->unit_after_forward(unit_, outputs);
}

void FsdpUnitModule::adopt(const std::shared_ptr<torch::nn::Module>& inner) {
  for (const auto& item : inner->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : inner->named_buffers(/*recurse=*/false)) register_buffer(item.key(), item.value());
  for (const auto& item : inner->named_children()) register_module(item.key(), item.value());
}

}  // namespace detail

// --- the wrapper's non-template part: forwards to the runtime ----------------

FullParamsGuard::FullParamsGuard(detail::FsdpRuntime& runtime) : runtime_(&runtime) { runtime_->gather_all(); }

FullParamsGuard::~FullParamsGuard() {
  if (runtime_) runtime_->free_all();
}

FsdpNoSyncGuard::FsdpNoSyncGuard(detail::FsdpRuntime& runtime)
    : runtime_(&runtime), previous_(runtime.requires_gradient_sync()) {
  runtime_->set_requires_gradient_sync(false);
}

FsdpNoSyncGuard::~FsdpNoSyncGuard() {
  if (runtime_) runtime_->set_requires_gradient_sync(previous_);
}

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> root,
                                                           std::shared_ptr<ProcessGroup> group,
                                                           const FSDPOptions& options) {
  auto groups = detail::fsdp_groups(std::move(group), options);
  group_ = groups.whole;
  runtime_ = std::make_unique<detail::FsdpRuntime>(std::move(root), std::move(groups), options);
}

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> root,
                                                           const DeviceMesh& mesh, const FSDPOptions& options)
    : group_(mesh.process_group()),
      runtime_(std::make_unique<detail::FsdpRuntime>(std::move(root), detail::fsdp_groups(mesh), options)) {}

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::SequentialImpl> root,
                                                           const DeferredSequential& children,
                                                           std::shared_ptr<ProcessGroup> group,
                                                           const FSDPOptions& options)
    : group_(group),
      runtime_(std::make_unique<detail::FsdpRuntime>(std::move(root), children,
                                                     detail::fsdp_groups(std::move(group), options), options)) {}

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::SequentialImpl> root,
                                                           const DeferredSequential& children,
                                                           const DeviceMesh& mesh, const FSDPOptions& options)
    : group_(mesh.process_group()),
      runtime_(std::make_unique<detail::FsdpRuntime>(std::move(root), children, detail::fsdp_groups(mesh), options)) {}

FullyShardedDataParallelBase::~FullyShardedDataParallelBase() = default;
FullyShardedDataParallelBase::FullyShardedDataParallelBase(FullyShardedDataParallelBase&&) noexcept = default;
FullyShardedDataParallelBase& FullyShardedDataParallelBase::operator=(FullyShardedDataParallelBase&&) noexcept =
    default;

std::vector<at::Tensor> FullyShardedDataParallelBase::parameters() const { return runtime_->shards(); }
FullParamsGuard FullyShardedDataParallelBase::summon_full_params() { return FullParamsGuard(*runtime_); }
StateDict FullyShardedDataParallelBase::full_state_dict(bool rank0_only) {
  return runtime_->full_state_dict(rank0_only);
}
void FullyShardedDataParallelBase::load_full_state_dict(const StateDict& state) {
  runtime_->load_full_state_dict(state);
}
void FullyShardedDataParallelBase::load_full_state_dict_file(const std::string& path) {
  runtime_->load_full_state_dict_file(path);
}
c10::IValue FullyShardedDataParallelBase::full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only) {
  return runtime_->full_optim_state_dict(optimizer, rank0_only);
}
void FullyShardedDataParallelBase::load_full_optim_state_dict(torch::optim::Optimizer& optimizer,
                                                              const c10::IValue& state) {
  runtime_->load_full_optim_state_dict(optimizer, state);
}
c10::IValue FullyShardedDataParallelBase::sharded_state_dict(torch::optim::Optimizer* optimizer) {
  return runtime_->sharded_state_dict(optimizer);
}
void FullyShardedDataParallelBase::load_sharded_state_dict(const c10::IValue& state,
                                                           torch::optim::Optimizer* optimizer) {
  runtime_->load_sharded_state_dict(state, optimizer);
}
FsdpNoSyncGuard FullyShardedDataParallelBase::no_sync() { return FsdpNoSyncGuard(*runtime_); }
void FullyShardedDataParallelBase::set_requires_gradient_sync(bool sync) {
  runtime_->set_requires_gradient_sync(sync);
}
std::vector<std::string> FullyShardedDataParallelBase::unit_names() const { return runtime_->unit_names(); }
ShardedMemory FullyShardedDataParallelBase::memory() const { return runtime_->memory(); }
void FullyShardedDataParallelBase::reset_peak_memory() { runtime_->reset_peak_memory(); }
const std::shared_ptr<ProcessGroup>& FullyShardedDataParallelBase::shard_group() const {
  return runtime_->shard_group();
}
const std::shared_ptr<ProcessGroup>& FullyShardedDataParallelBase::replicate_group() const {
  return runtime_->replicate_group();
}
ShardingStrategy FullyShardedDataParallelBase::sharding_strategy() const { return runtime_->sharding_strategy(); }
void FullyShardedDataParallelBase::begin_forward() { runtime_->begin_forward(); }
void FullyShardedDataParallelBase::end_forward(const std::vector<at::Tensor>& outputs) {
  runtime_->end_forward(outputs);
}
std::optional<at::ScalarType> FullyShardedDataParallelBase::input_dtype() const { return runtime_->input_dtype(); }
std::optional<at::ScalarType> FullyShardedDataParallelBase::output_dtype() const {
  return runtime_->output_dtype();
}
bool FullyShardedDataParallelBase::runs_sequential() const { return runtime_->runs_sequential(); }
at::Tensor FullyShardedDataParallelBase::run_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input) {
  return runtime_->run_sequential(sequential, std::move(input));
}

}  // namespace ddp
