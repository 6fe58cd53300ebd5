// How FSDP keeps a unit's parameters (see docs/architecture.md, "FSDP"):
//
// A unit's parameters are laid out in one flat tensor, `full`, padded to a
// multiple of the world size. The module's own parameter tensors keep their
// identity (so autograd, optimizers and the user's references stay valid) but
// are made views into `full`'s storage. Freeing a unit releases that
// storage's memory; gathering allocates it again and all-gathers the shards
// into it. Autograd's saved tensors are views of the same storage, so the
// backward pass sees the re-gathered values without any bookkeeping.
//
// Each rank's `shard` (its 1/N of `full`) is a separate leaf tensor: the
// optimizer's parameter. Gradients arrive on the module's parameters; once a
// unit's are all there they are flattened, reduce-scattered, and this rank's
// part lands in shard.grad().

#include <ddp/error.h>
#include <ddp/fully_sharded_data_parallel.h>

#include <ddp/detail/optimizer_state.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/snapshot.h>

#include "autograd_hooks.h"

#include <ATen/Functions.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_set>

namespace ddp {

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  std::string lower;
  for (char c : name) lower.push_back(c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "full_shard") return ShardingStrategy::kFullShard;
  if (lower == "shard_grad_op") return ShardingStrategy::kShardGradOp;
  if (lower == "no_shard") return ShardingStrategy::kNoShard;
  DDP_CHECK(false, "ddp: unknown sharding strategy '", name, "'; use full_shard, shard_grad_op or no_shard");
}

std::string to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard: return "full_shard";
    case ShardingStrategy::kShardGradOp: return "shard_grad_op";
    case ShardingStrategy::kNoShard: return "no_shard";
  }
  return "?";
}

namespace detail {
namespace {

// Gives `tensor`'s storage back to its allocator, keeping the StorageImpl
// (and so every view of it) alive.
void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
}

void allocate_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  size_t nbytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (storage->nbytes() == nbytes && storage->data() != nullptr) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

bool storage_allocated(const at::Tensor& tensor) { return tensor.storage().nbytes() > 0; }

}  // namespace

struct FsdpState::Unit {
  std::string name;
  std::vector<std::string> param_names;  // dotted names in the root module
  std::vector<at::Tensor> params;        // the module's own leaf tensors
  std::vector<int64_t> offsets;
  int64_t numel = 0;        // real elements
  int64_t padded = 0;       // numel rounded up to a multiple of the world size
  int64_t shard_numel = 0;  // padded / world size
  at::Tensor full;          // `padded` elements; memory only while gathered
  at::Tensor shard;         // this rank's part; the optimizer's parameter
  bool is_root = false;
  bool reshard_after_forward = true;
  bool gathered = false;
  c10::intrusive_ptr<c10d::Work> pending_gather;
  // One backward pass.
  std::vector<char> ready;
  size_t ready_count = 0;
  bool reduced = false;
  bool pre_backward_ran = false;
  at::Tensor gradient_flat;
  at::Tensor gradient_shard;
  // no_sync(): the sum of the unsharded gradients of backward passes whose
  // reduce-scatter was skipped, reduced with the next synchronised one.
  at::Tensor unsynced_gradient;
  c10::intrusive_ptr<c10d::Work> pending_reduce;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
};

FsdpState::FsdpState(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<ProcessGroup> group,
                     FSDPOptions options)
    : root_(std::move(root)), group_(std::move(group)), options_(std::move(options)) {
  // One rank has nothing to shard with: gathering would only copy. PyTorch
  // makes the same switch.
  if (group_->size() == 1) options_.sharding_strategy(ShardingStrategy::kNoShard);
  DDP_CHECK(options_.min_num_params() >= 0, "ddp: FSDPOptions::min_num_params must be >= 0, got ",
              options_.min_num_params());
  if (options_.sync_module_states() && group_->size() > 1) {
    verify_replicas_match(*root_, *group_);
    broadcast_module_state(*root_, *group_, /*parameters=*/true, /*buffers=*/true);
  }
  build_units();
}

FsdpState::~FsdpState() {
  for (auto& unit : units_) {
    for (size_t i = 0; i < unit->accumulators.size(); ++i) unit->accumulators[i]->del_post_hook(unit->hook_keys[i]);
  }
  // The module outlives us: leave it with real, full parameters. That is a
  // collective, skipped while an error unwinds (a peer may be dead).
  if (std::uncaught_exceptions() > 0) return;
  try {
    for (auto& unit : units_) {
      if (!unit->gathered && sharded()) {
        if (unit->pending_gather) finish_gather(*unit);
        else {
          start_gather(*unit);
          finish_gather(*unit);
        }
      }
    }
  } catch (...) {
    // A dead peer: nothing more to gather from.
  }
}

bool FsdpState::sharded() const { return options_.sharding_strategy() != ShardingStrategy::kNoShard; }

void FsdpState::build_units() {
  std::set<const at::TensorImpl*> claimed;
  std::map<const at::TensorImpl*, std::string> name_of;
  for (const auto& item : root_->named_parameters(true)) {
    auto [it, fresh] = name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    DDP_CHECK(fresh, "ddp: parameters '", it->second, "' and '", item.key(),
                "' are one tensor (tied weights); FullyShardedDataParallel does not support tied parameters");
  }
  auto params_of = [&](const torch::nn::Module& module) {
    std::vector<std::pair<std::string, at::Tensor>> params;
    for (const auto& p : module.parameters(true)) {
      if (!claimed.insert(p.unsafeGetTensorImpl()).second) continue;
      // Frozen parameters stay whole on every rank, like buffers: sharded,
      // the optimizer's step (weight decay, say) would change them.
      if (!p.requires_grad()) frozen_.emplace_back(name_of.at(p.unsafeGetTensorImpl()), p);
      else params.emplace_back(name_of.at(p.unsafeGetTensorImpl()), p);
    }
    return params;
  };

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
    std::set<std::string> listed(options_.units().begin(), options_.units().end());
    std::vector<std::string> child_names;
    for (const auto& item : sequential->named_children()) child_names.push_back(item.key());
    for (const auto& name : listed) {
      DDP_CHECK(std::find(child_names.begin(), child_names.end(), name) != child_names.end(),
                  "ddp: FSDPOptions::units names '", name, "', which is not a child of the Sequential root "
                  "(its children are named 0 to ", child_names.size() - 1, ")");
    }
    std::vector<size_t> group;
    int64_t group_numel = 0;
    auto close_group = [&] {
      if (group.empty()) return;
      std::vector<std::pair<std::string, at::Tensor>> params;
      for (size_t child : group) {
        auto more = params_of(*sequential->ptr(child));
        params.insert(params.end(), more.begin(), more.end());
      }
      std::string name = child_names[group.front()];
      if (group.size() > 1) name += "-" + child_names[group.back()];
      sequential_groups_.push_back(group);
      sequential_unit_of_group_.push_back(params.empty() ? SIZE_MAX : units_.size());
      if (!params.empty()) add_unit(name, std::move(params));
      group.clear();
      group_numel = 0;
    };
    for (size_t child = 0; child < child_names.size(); ++child) {
      int64_t numel = 0;
      for (const auto& p : sequential->ptr(child)->parameters(true)) numel += p.numel();
      if (listed.count(child_names[child])) {
        close_group();
        group.push_back(child);
        close_group();
        continue;
      }
      group.push_back(child);
      group_numel += numel;
      if (options_.min_num_params() > 0 && group_numel >= options_.min_num_params()) close_group();
      // Without a size policy, unlisted children belong to no unit: the root
      // unit gathers their parameters.
      if (options_.min_num_params() == 0) {
        sequential_groups_.push_back(group);
        sequential_unit_of_group_.push_back(SIZE_MAX);
        group.clear();
        group_numel = 0;
      }
    }
    // A tail smaller than min_num_params is a unit of its own.
    close_group();
  }

  auto rest = params_of(*root_);
  if (!rest.empty()) {
    add_unit("", std::move(rest));
    units_.back()->is_root = true;
  }
  DDP_CHECK(!units_.empty(), "ddp: FullyShardedDataParallel needs a model with trainable parameters (requires_grad true)");
  for (auto& unit : units_) unit->reshard_after_forward = options_.sharding_strategy() == ShardingStrategy::kFullShard;
  for (const auto& [name, reshard] : options_.reshard_after_forward()) {
    auto it = std::find_if(units_.begin(), units_.end(), [&](const auto& unit) { return unit->name == name; });
    std::string names;
    for (const auto& unit : units_) names += " '" + unit->name + "'";
    DDP_CHECK(it != units_.end(), "ddp: FSDPOptions::reshard_after_forward names the unit '", name,
              "', which this model does not have; its units are", names, " ('' is the root unit)");
    (*it)->reshard_after_forward = reshard;
  }
}

void FsdpState::add_unit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params) {
  auto unit = std::make_unique<Unit>();
  unit->name = std::move(name);
  const at::Tensor& first = params.front().second;
  for (const auto& [param_name, param] : params) {
    DDP_CHECK(param.scalar_type() == first.scalar_type() && param.device() == first.device(),
                "ddp: all parameters of an FSDP unit need one dtype and device; '", param_name, "' is ",
                param.scalar_type(), " on ", param.device(), " but '", params.front().first, "' is ",
                first.scalar_type(), " on ", first.device());
    unit->param_names.push_back(param_name);
    unit->params.push_back(param);
    unit->offsets.push_back(unit->numel);
    unit->numel += param.numel();
  }
  const int64_t world = group_->size();
  unit->padded = (unit->numel + world - 1) / world * world;
  unit->shard_numel = unit->padded / world;

  at::NoGradGuard no_grad;
  unit->full = at::zeros({unit->padded}, first.options().requires_grad(false));
  for (size_t j = 0; j < unit->params.size(); ++j) {
    at::Tensor& param = unit->params[j];
    at::Tensor slot = unit->full.narrow(0, unit->offsets[j], param.numel());
    slot.copy_(param.reshape({-1}));
    // The parameter keeps its identity and autograd metadata; only its data
    // moves into the flat storage.
    param.set_data(slot.view(param.sizes()));
  }
  if (sharded()) {
    unit->shard = unit->full.narrow(0, group_->rank() * unit->shard_numel, unit->shard_numel).clone();
  } else {
    unit->shard = unit->full.detach();
  }
  unit->shard.requires_grad_(true);
  unit->gathered = true;
  unit->ready.assign(unit->params.size(), 0);

  size_t index = units_.size();
  for (size_t j = 0; j < unit->params.size(); ++j) {
    auto accumulator = torch::autograd::impl::grad_accumulator(unit->params[j]);
    DDP_CHECK(accumulator, "ddp: FSDP parameter '", unit->param_names[j], "' has no gradient accumulator");
    unit->hook_keys.push_back(accumulator->add_post_hook(
        std::make_unique<GradientReadyHook>([this, index, j] { on_gradient_ready(index, j); })));
    unit->accumulators.push_back(std::move(accumulator));
  }
  units_.push_back(std::move(unit));
  release(*units_.back());
}

std::vector<at::Tensor> FsdpState::shards() const {
  std::vector<at::Tensor> shards;
  for (const auto& unit : units_) shards.push_back(unit->shard);
  return shards;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpState::replicated() const {
  auto tensors = frozen_;
  for (const auto& item : root_->named_buffers(true)) tensors.emplace_back(item.key(), item.value());
  return tensors;
}

std::vector<std::string> FsdpState::unit_names() const {
  std::vector<std::string> names;
  for (const auto& unit : units_) names.push_back(unit->name);
  return names;
}

ShardedMemory FsdpState::memory() const {
  ShardedMemory memory;
  for (const auto& unit : units_) {
    int64_t element = unit->full.element_size();
    if (sharded()) memory.parameter_bytes += unit->shard_numel * element;
    if (storage_allocated(unit->full)) memory.parameter_bytes += unit->padded * element;
  }
  for (const auto& [name, tensor] : frozen_) memory.parameter_bytes += static_cast<int64_t>(tensor.nbytes());
  for (const auto& unit : units_) {
    int64_t element = unit->full.element_size();
    if (unit->shard.grad().defined()) memory.gradient_bytes += unit->shard.grad().numel() * element;
    if (unit->unsynced_gradient.defined()) memory.gradient_bytes += unit->unsynced_gradient.numel() * element;
  }
  return memory;
}

// --- gathering and freeing -------------------------------------------------

void FsdpState::start_gather(Unit& unit) {
  if (unit.gathered || unit.pending_gather) return;
  allocate_storage(unit.full);
  at::NoGradGuard no_grad;
  if (group_->size() == 1) {
    unit.full.copy_(unit.shard.detach());
    unit.gathered = true;
    return;
  }
  at::Tensor input = unit.shard.detach();
  CollectiveTag tag("fsdp unit '" + unit.name + "' all-gather");
  unit.pending_gather = group_->all_gather_into_async(unit.full, input);
}

void FsdpState::finish_gather(Unit& unit) {
  if (unit.gathered) return;
  if (!unit.pending_gather) start_gather(unit);
  if (unit.pending_gather) {
    auto work = std::move(unit.pending_gather);
    unit.pending_gather.reset();
    group_->wait(work, "FSDP all_gather of parameters");
  }
  unit.gathered = true;
}

void FsdpState::release(Unit& unit) {
  if (!sharded()) return;
  if (unit.pending_gather) finish_gather(unit);
  release_storage(unit.full);
  unit.gathered = false;
}

void FsdpState::gather_all() {
  for (auto& unit : units_) start_gather(*unit);
  for (auto& unit : units_) finish_gather(*unit);
}

void FsdpState::free_all() {
  for (auto& unit : units_) release(*unit);
}

// --- forward ---------------------------------------------------------------

void FsdpState::reset_backward_state() {
  for (auto& unit : units_) {
    unit->pre_backward_ran = false;
    unit->reduced = false;
    unit->ready_count = 0;
    std::fill(unit->ready.begin(), unit->ready.end(), 0);
    // Left by a backward that failed part-way; nobody waits for them now.
    unit->pending_reduce.reset();
    unit->gradient_flat.reset();
    unit->gradient_shard.reset();
  }
  reduce_order_.clear();
  next_reduce_ = 0;
  callback_queued_ = false;
  in_backward_ = false;
}

void FsdpState::begin_forward() {
  if (in_backward_) {
    // The engine never ran finish_backward, or it threw: a backward pass
    // failed part-way, and some reduce-scatters may have been started on
    // this rank only.
    reset_backward_state();
    DDP_CHECK(false, "ddp: the previous backward pass through FullyShardedDataParallel on rank ", group_->rank(),
              " did not finish (an error was raised inside it), so its gradient reduce-scatters may not match the "
              "other ranks' and the shards' gradients are incomplete. Stop this rank and restart the job (ddprun "
              "--max-restarts resumes from the newest snapshot or checkpoint)");
  }
  // Whatever an earlier forward left gathered (one whose backward never ran)
  // is released, so every forward starts from the current shards.
  free_all();
  reset_backward_state();
  if (!forward_order_.empty()) last_forward_order_ = forward_order_;
  forward_order_.clear();
  if (units_.back()->is_root) {
    start_gather(*units_.back());
    // The first unit's gather overlaps the root's.
    if (options_.forward_prefetch() && !last_forward_order_.empty()) start_gather(*units_[last_forward_order_.front()]);
    finish_gather(*units_.back());
  }
}

void FsdpState::unit_before_forward(size_t index) {
  Unit& unit = *units_[index];
  size_t position = forward_order_.size();
  forward_order_.push_back(index);
  finish_gather(unit);
  if (options_.forward_prefetch() && position + 1 < last_forward_order_.size() &&
      last_forward_order_[position] == index) {
    start_gather(*units_[last_forward_order_[position + 1]]);
  }
}

void FsdpState::unit_after_forward(size_t index, const std::vector<at::Tensor>& outputs) {
  Unit& unit = *units_[index];
  const bool backward_follows = at::GradMode::is_enabled();
  if (!backward_follows || unit.reshard_after_forward) release(unit);
  if (backward_follows) register_pre_backward(index, outputs);
}

void FsdpState::end_forward(const std::vector<at::Tensor>& outputs) {
  const bool backward_follows = at::GradMode::is_enabled() &&
                                std::any_of(outputs.begin(), outputs.end(),
                                            [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (!backward_follows) {
    free_all();
    return;
  }
  find_unreachable(outputs);
  // The first hook to fire in backward, before any unit's: fixes the launch
  // order and queues the end of backward.
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([this](const at::Tensor&) {
      if (!callback_queued_) begin_backward();
    });
  }
}

// The parameters the forward's graph cannot reach get no gradient in this
// backward on this rank: they are marked ready (as zeros) when it starts,
// so their units launch mid-backward, as DDP's find_unused_parameters does.
void FsdpState::find_unreachable(const std::vector<at::Tensor>& outputs) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto node = out.grad_fn() ? out.grad_fn() : torch::autograd::impl::try_get_grad_accumulator(out);
    if (node && seen.insert(node.get()).second) stack.push_back(node.get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
  }
  unreachable_.clear();
  for (size_t u = 0; u < units_.size(); ++u) {
    for (size_t j = 0; j < units_[u]->accumulators.size(); ++j) {
      if (!seen.count(units_[u]->accumulators[j].get())) unreachable_.emplace_back(u, j);
    }
  }
}

void FsdpState::begin_backward() {
  callback_queued_ = true;
  in_backward_ = true;
  // Reverse forward order (backward's), then units that did not run, the
  // root unit last: the same on every rank, since all ranks run the same
  // units in the same order.
  reduce_order_.clear();
  next_reduce_ = 0;
  std::vector<char> placed(units_.size(), 0);
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) {
    if (!placed[*it] && !units_[*it]->is_root) {
      placed[*it] = 1;
      reduce_order_.push_back(*it);
    }
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!placed[u]) reduce_order_.push_back(u);
  }
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
  for (const auto& [u, j] : unreachable_) {
    Unit& unit = *units_[u];
    if (!unit.ready[j]) {
      unit.ready[j] = 1;
      ++unit.ready_count;
    }
  }
  launch_ready_in_order();
}

at::Tensor FsdpState::run_sequential(torch::nn::SequentialImpl& sequential, at::Tensor x) {
  for (size_t g = 0; g < sequential_groups_.size(); ++g) {
    size_t unit = sequential_unit_of_group_[g];
    if (unit != SIZE_MAX) unit_before_forward(unit);
    for (size_t child : sequential_groups_[g]) x = (sequential.begin() + child)->forward(x);
    if (unit != SIZE_MAX) unit_after_forward(unit, {x});
  }
  return x;
}

// --- backward --------------------------------------------------------------

void FsdpState::register_pre_backward(size_t index, const std::vector<at::Tensor>& outputs) {
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([this, index](const at::Tensor&) { pre_backward(index); });
  }
}

void FsdpState::pre_backward(size_t index) {
  Unit& unit = *units_[index];
  if (unit.pre_backward_ran || unit.reduced) return;
  unit.pre_backward_ran = true;
  finish_gather(unit);
  if (!options_.backward_prefetch()) return;
  // Backward runs the units in reverse forward order: gather the next one.
  auto it = std::find(forward_order_.begin(), forward_order_.end(), index);
  if (it != forward_order_.end() && it != forward_order_.begin()) start_gather(*units_[*(it - 1)]);
}

void FsdpState::on_gradient_ready(size_t index, size_t param) {
  if (!in_backward_) return;  // a backward that did not start from our forward
  Unit& unit = *units_[index];
  if (unit.reduced || unit.ready[param]) return;
  unit.ready[param] = 1;
  if (++unit.ready_count == unit.params.size()) launch_ready_in_order();
}

// Like the gradient reducer's buckets: a unit whose gradients are complete
// waits for every unit before it in reduce_order_, so that all ranks start
// their reduce-scatters in one order although a parameter unused on one rank
// completes that rank's units in another.
void FsdpState::launch_ready_in_order() {
  while (next_reduce_ < reduce_order_.size()) {
    Unit& unit = *units_[reduce_order_[next_reduce_]];
    if (!unit.reduced) {
      if (unit.ready_count < unit.params.size()) return;
      reduce(unit);
    }
    ++next_reduce_;
  }
}

void FsdpState::reduce(Unit& unit) {
  at::NoGradGuard no_grad;
  const int64_t world = group_->size();
  unit.gradient_flat = at::empty({unit.padded}, unit.full.options());
  if (unit.padded > unit.numel) unit.gradient_flat.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
  for (size_t j = 0; j < unit.params.size(); ++j) {
    at::Tensor slot = unit.gradient_flat.narrow(0, unit.offsets[j], unit.params[j].numel());
    at::Tensor& grad = unit.params[j].mutable_grad();
    if (grad.defined()) {
      slot.copy_(grad.reshape({-1}));
      grad.reset();  // the full gradient is not kept: only the shard's part
    } else {
      slot.zero_();  // unused in this forward: a zero gradient, as DDP would send
    }
  }
  if (!require_sync_) {
    // Accumulating without synchronisation: no collective; the full
    // gradient is kept (as PyTorch's FSDP does) until a synced backward.
    if (unit.unsynced_gradient.defined()) unit.unsynced_gradient.add_(unit.gradient_flat);
    else unit.unsynced_gradient = unit.gradient_flat;
    unit.gradient_flat.reset();
    unit.reduced = true;
    release(unit);
    return;
  }
  if (unit.unsynced_gradient.defined()) {
    unit.gradient_flat.add_(unit.unsynced_gradient);
    unit.unsynced_gradient.reset();
  }
  // Averaged over ranks, like DDP's gradients; dividing first keeps the
  // sum in range for low-precision types.
  if (world > 1) unit.gradient_flat.div_(world);
  // FSDPOptions::reduce_dtype: the collective runs in that dtype (as DDP's
  // fp16/bf16 compression hooks do: divide, cast, sum), and
  // finish_backward casts the result back to the parameters' dtype.
  if (options_.reduce_dtype() && *options_.reduce_dtype() != unit.gradient_flat.scalar_type()) {
    unit.gradient_flat = unit.gradient_flat.to(*options_.reduce_dtype());
  }
  if (world == 1) {
    unit.gradient_shard = unit.gradient_flat;
  } else if (sharded()) {
    unit.gradient_shard = at::empty({unit.shard_numel}, unit.gradient_flat.options());
    CollectiveTag tag("fsdp unit '" + unit.name + "' reduce-scatter");
    unit.pending_reduce = group_->reduce_scatter_async(unit.gradient_shard, unit.gradient_flat);
  } else {
    unit.gradient_shard = unit.gradient_flat;
    CollectiveTag tag("fsdp unit '" + unit.name + "' all-reduce");
    unit.pending_reduce = group_->all_reduce_async(unit.gradient_flat);
  }
  unit.reduced = true;
  // The unit's backward is over: give back its full parameters (the root's
  // too, so that between steps only shards are held).
  release(unit);
}

void FsdpState::finish_backward() {
  // Units whose gradients never all arrived (parameters unused this time
  // on this rank) are reduced now, with zeros for what is missing, in the
  // order every rank uses. All are launched before any wait can throw.
  for (; next_reduce_ < reduce_order_.size(); ++next_reduce_) {
    Unit& unit = *units_[reduce_order_[next_reduce_]];
    if (!unit.reduced) reduce(unit);
  }
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    if (unit->pending_reduce) {
      auto work = std::move(unit->pending_reduce);
      unit->pending_reduce.reset();
      group_->wait(work, sharded() ? "FSDP reduce_scatter of gradients" : "FSDP all_reduce of gradients");
    }
    if (!unit->gradient_shard.defined()) continue;  // no_sync(): kept in unsynced_gradient
    at::Tensor reduced = unit->gradient_shard;
    if (reduced.scalar_type() != unit->shard.scalar_type()) reduced = reduced.to(unit->shard.scalar_type());
    at::Tensor& grad = unit->shard.mutable_grad();
    if (grad.defined()) {
      grad.add_(reduced);  // accumulation over several backward passes
    } else {
      grad = reduced;
    }
    unit->gradient_flat.reset();
    unit->gradient_shard.reset();
  }
  // Ready for another backward through the same graph (retain_graph).
  reset_backward_state();
}

void FsdpUnitModule::before_forward() { state_->unit_before_forward(unit_); }

void FsdpUnitModule::after_forward(const std::vector<at::Tensor>& outputs) {
  state_->unit_after_forward(unit_, outputs);
}

void FsdpUnitModule::adopt(const std::shared_ptr<torch::nn::Module>& inner) {
  for (const auto& item : inner->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : inner->named_buffers(/*recurse=*/false)) register_buffer(item.key(), item.value());
  for (const auto& item : inner->named_children()) register_module(item.key(), item.value());
}

// --- state dicts -----------------------------------------------------------

StateDict FsdpState::full_state_dict(bool rank0_only) {
  const bool keep = !rank0_only || group_->rank() == 0;
  std::map<std::string, at::Tensor> gathered;
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    at::Tensor full;
    if (unit->gathered) {
      full = unit->full;
    } else {
      full = at::empty({unit->padded}, unit->full.options());
      at::Tensor input = unit->shard.detach();
      CollectiveTag tag("fsdp full state dict");
      group_->wait(group_->all_gather_into_async(full, input), "FSDP all_gather for the full state dict");
    }
    if (!keep) continue;
    for (size_t j = 0; j < unit->params.size(); ++j) {
      gathered[unit->param_names[j]] =
          full.narrow(0, unit->offsets[j], unit->params[j].numel()).view(unit->params[j].sizes()).clone();
    }
  }
  StateDict state;
  if (!keep) return state;
  // In the unwrapped model's order (ddp::state_dict's, Python's).
  for (const auto& [name, tensor] : ddp::state_dict(*root_)) {
    auto it = gathered.find(name);
    state.emplace_back(name, it != gathered.end() ? it->second : tensor.detach().clone());
  }
  return state;
}

void FsdpState::load_full_state_dict(const StateDict& state) {
  // load_state_dict's checks (every entry present with its shape, none
  // extra) run against stand-ins: each unit's parameters as views of a new
  // flat tensor, and copies of the buffers and frozen parameters. Only when
  // all have passed does anything of the model change.
  StateDict targets;
  std::vector<at::Tensor> flats;
  for (const auto& unit : units_) {
    flats.push_back(at::zeros({unit->padded}, unit->full.options()));
    for (size_t j = 0; j < unit->params.size(); ++j) {
      targets.emplace_back(unit->param_names[j], flats.back()
                                                     .narrow(0, unit->offsets[j], unit->params[j].numel())
                                                     .view(unit->params[j].sizes()));
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
    Unit& unit = *units_[u];
    auto [start, length] = shard_range(unit);
    unit.shard.detach().copy_(flats[u].narrow(0, start, length));
    if (unit.gathered && sharded()) unit.full.copy_(flats[u]);
  }
  for (auto& [target, value] : buffers) target.detach().copy_(value);
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

// Where the unit's parameters lie in its flat tensor, for the optimizer
// state's re-layout.
FlatLayout FsdpState::layout_of(const Unit& unit) const {
  FlatLayout layout;
  layout.names = unit.param_names;
  layout.offsets = unit.offsets;
  for (const auto& param : unit.params) layout.shapes.push_back(param.sizes().vec());
  layout.padded = unit.padded;
  return layout;
}

std::pair<int64_t, int64_t> FsdpState::shard_range(const Unit& unit) const {
  if (!sharded()) return {0, unit.padded};
  return {group_->rank() * unit.shard_numel, unit.shard_numel};
}

std::map<std::string, int64_t> FsdpState::parameter_indices() const {
  std::map<std::string, int64_t> index_of;
  int64_t count = 0;
  for (const auto& item : root_->named_parameters(true)) index_of[item.key()] = count++;
  return index_of;
}

c10::IValue FsdpState::full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only) {
  check_optimizer_layout(optimizer, shards());
  const bool keep = !rank0_only || group_->rank() == 0;
  auto local = parse_optimizer_state(optimizer_state_dict(optimizer), "FullyShardedDataParallel");
  const auto index_of = parameter_indices();
  const int64_t count = static_cast<int64_t>(index_of.size());

  auto state = new_generic_dict();
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    auto found = local.state.find(static_cast<int64_t>(u));
    if (found == local.state.end()) continue;  // not stepped yet: the same on every rank
    // The unit's flat entry: its per-element state gathered from every
    // rank's shard (collectives, so on every rank), the rest as it is.
    const int64_t length = shard_range(unit).second;
    auto flat = map_per_element_state(found->value().toGenericDict(), [&](const std::string& key,
                                                                          const at::Tensor& tensor) {
      DDP_CHECK(tensor.defined() && tensor.numel() == length, "ddp: optimizer state '", key, "' of unit '",
                unit.name, "' is not a tensor of the shard's ", length, " elements");
      if (!sharded() || group_->size() == 1) return tensor;
      at::Tensor full = at::empty({unit.padded}, tensor.options());
      at::Tensor input = tensor.contiguous();
      CollectiveTag tag("fsdp full optimizer state");
      group_->wait(group_->all_gather_into_async(full, input), "FSDP all_gather of optimizer state");
      return full;
    });
    if (!keep) continue;
    auto per_param = split_flat_entry(flat, layout_of(unit));
    for (size_t j = 0; j < unit.params.size(); ++j) state.insert(index_of.at(unit.param_names[j]), per_param[j]);
  }
  if (!keep) return c10::IValue();
  // Python's layout for the unwrapped model: one entry per parameter, in
  // index order.
  return one_group_state(state, single_param_group(local, static_cast<int64_t>(units_.size()), "FSDP"), count);
}

void FsdpState::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& full) {
  check_optimizer_layout(optimizer, shards());
  const std::string who = "FullyShardedDataParallel::load_full_optim_state_dict";
  auto parts = parse_optimizer_state(full, who);
  const auto index_of = parameter_indices();
  auto group = single_param_group(parts, static_cast<int64_t>(index_of.size()), who);

  auto state = new_generic_dict();
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    std::vector<GenericDict> entries;
    for (const auto& name : unit.param_names) {
      auto it = parts.state.find(index_of.at(name));
      if (it != parts.state.end()) entries.push_back(it->value().toGenericDict());
    }
    if (entries.empty()) continue;
    DDP_CHECK(entries.size() == unit.params.size(), "ddp: the optimizer state covers only some parameters of unit '",
              unit.name, "'; FSDP needs all or none");
    auto [start, length] = shard_range(unit);
    state.insert(static_cast<int64_t>(u), slice_flat_entry(join_flat_entry(entries, layout_of(unit)), start, length));
  }
  load_optimizer_state_dict(optimizer, one_group_state(state, group, static_cast<int64_t>(units_.size())));
}

c10::IValue FsdpState::sharded_state_dict(torch::optim::Optimizer* optimizer) {
  auto result = new_generic_dict();
  result.insert("format", std::string("ddp.fsdp.sharded/1"));
  result.insert("world_size", static_cast<int64_t>(group_->size()));
  result.insert("rank", static_cast<int64_t>(group_->rank()));
  result.insert("strategy", to_string(options_.sharding_strategy()));
  c10::impl::GenericList units(c10::AnyType::get());
  for (const auto& unit : units_) {
    auto entry = new_generic_dict();
    entry.insert("name", unit->name);
    entry.insert("numel", unit->numel);
    c10::impl::GenericList names(c10::AnyType::get());
    for (const auto& n : unit->param_names) names.push_back(n);
    entry.insert("param_names", names);
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

void FsdpState::load_sharded_state_dict(const c10::IValue& value, torch::optim::Optimizer* optimizer) {
  DDP_CHECK(value.isGenericDict() && value.toGenericDict().contains("format") &&
                  value.toGenericDict().at("format").isString() &&
                  value.toGenericDict().at("format").toStringRef() == "ddp.fsdp.sharded/1",
              "ddp: not an FSDP sharded state dict (no 'format': 'ddp.fsdp.sharded/1')");
  auto dict = value.toGenericDict();
  int64_t world = dict.at("world_size").toInt();
  int64_t rank = dict.at("rank").toInt();
  DDP_CHECK(world == group_->size(), "ddp: this sharded checkpoint was written by ", world,
              " ranks but this job has ", group_->size(),
              "; a sharded checkpoint reloads only into the same world size: load a full state dict instead");
  DDP_CHECK(rank == group_->rank(), "ddp: rank ", group_->rank(), " was given rank ", rank,
              "'s shard of the checkpoint");
  auto units = dict.at("units").toList();
  DDP_CHECK(units.size() == units_.size(), "ddp: the sharded checkpoint has ", units.size(),
              " units but the model has ", units_.size(), "; wrap the model the same way as when it was saved");
  for (size_t u = 0; u < units_.size(); ++u) {
    auto entry = units.get(u).toGenericDict();
    at::Tensor shard = entry.at("shard").toTensor();
    DDP_CHECK(entry.at("name").toStringRef() == units_[u]->name && entry.at("numel").toInt() == units_[u]->numel &&
                    shard.numel() == shard_range(*units_[u]).second,
                "ddp: unit ", u, " of the sharded checkpoint ('", entry.at("name").toStringRef(), "', ",
                entry.at("numel").toInt(), " elements) does not match the model's ('", units_[u]->name, "', ",
                units_[u]->numel, " elements)");
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
    Unit& unit = *units_[u];
    unit.shard.detach().copy_(units.get(u).toGenericDict().at("shard").toTensor());
    if (unit.gathered && sharded()) {
      // Keep the gathered copy consistent: gather it again.
      unit.gathered = false;
      finish_gather(unit);
    }
  }
  for (const auto& [name, tensor] : replicated()) {
    at::Tensor target = tensor;
    target.detach().copy_(buffers.at(name).toTensor());
  }
}

}  // namespace detail

std::string save_sharded_checkpoint(const c10::IValue& state, const std::string& dir, ProcessGroup& group) {
  std::filesystem::create_directories(dir);
  std::string path = dir + "/shard_" + std::to_string(group.rank()) + "_of_" + std::to_string(group.size()) + ".pt";
  save_value(state, path);
  group.barrier();
  return path;
}

c10::IValue load_sharded_checkpoint(const std::string& dir, ProcessGroup& group) {
  std::string path = dir + "/shard_" + std::to_string(group.rank()) + "_of_" + std::to_string(group.size()) + ".pt";
  if (!std::filesystem::exists(path)) {
    std::string found;
    if (std::filesystem::is_directory(dir)) {
      for (const auto& entry : std::filesystem::directory_iterator(dir)) {
        std::string name = entry.path().filename().string();
        if (name.rfind("shard_", 0) == 0) {
          found = name;
          break;
        }
      }
    }
    DDP_CHECK(false, "ddp: no sharded checkpoint for rank ", group.rank(), " of ", group.size(), " in '", dir,
                "' (expected ", path, ")",
                found.empty() ? std::string()
                              : "; it holds " + found +
                                    ", written by another world size: a sharded checkpoint reloads only into the "
                                    "same world size, load a full state dict instead");
  }
  return load_value(path);
}

}  // namespace ddp
