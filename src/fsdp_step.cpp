// One FSDP step: the forward gathers each unit as it runs and arranges its
// gather for backward, and in backward FSDP is the gradient engine's policy
// (src/gradient_sync_engine.h): a unit is a group, launched in reverse forward
// order, flattened, reduce-scattered into the shard and freed. How units are
// formed, gathered and freed is in fully_sharded_data_parallel.cpp.

#include <ddp/fully_sharded_data_parallel.h>

#include <ddp/error.h>

#include "fsdp_runtime.h"
#include "fsdp_unit.h"
#include "gradient_sync_engine.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>

namespace ddp::detail {

// --- forward ---------------------------------------------------------------

void FsdpRuntime::reset_backward_state() {
  for (auto& unit : units_) {
    unit->pre_backward_ran = false;
    unit->reduced = false;
    // Left by a backward that failed part-way; nobody waits for them now.
    unit->gradient_flat.reset();
    unit->gradient_shard.reset();
    unit->scattered.reset();
    unit->replicated.reset();
    unit->scatter_in_flight.reset();
  }
  awaiting_replicate_.clear();
}

void FsdpRuntime::begin_forward() {
  // A backward pass that failed part-way (some reduce-scatters may have
  // started on this rank only) is an error, raised by the engine.
  if (engine_->round_active()) reset_backward_state();
  engine_->check_previous_round_finished();
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

void FsdpRuntime::unit_before_forward(size_t index) {
  Unit& unit = *units_[index];
  size_t position = forward_order_.size();
  forward_order_.push_back(index);
  finish_gather(unit);
  if (options_.forward_prefetch() && position + 1 < last_forward_order_.size() &&
      last_forward_order_[position] == index) {
    start_gather(*units_[last_forward_order_[position + 1]]);
  }
}

void FsdpRuntime::unit_after_forward(size_t index, const std::vector<at::Tensor>& outputs) {
  Unit& unit = *units_[index];
  const bool backward_follows = at::GradMode::is_enabled();
  if (!backward_follows || unit.reshard_after_forward) release(unit);
  if (backward_follows) register_pre_backward(index, outputs);
}

void FsdpRuntime::end_forward(const std::vector<at::Tensor>& outputs) {
  const bool backward_follows = at::GradMode::is_enabled() &&
                                std::any_of(outputs.begin(), outputs.end(),
                                            [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (!backward_follows) {
    free_all();
    return;
  }
  // Parameters the forward's graph cannot reach count as zeros from the
  // start of backward, so their units launch mid-backward.
  engine_->find_unreachable(outputs);
  // The first hook to fire in backward, before any unit's, starts the
  // engine's pass (and so fixes the launch order).
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([this](const at::Tensor&) {
      // A second backward through the same graph (retain_graph) needs the
      // root unit again: the first one freed it.
      if (units_.back()->is_root) finish_gather(*units_.back());
      engine_->begin_round();
    });
  }
}

at::Tensor FsdpRuntime::run_sequential(torch::nn::SequentialImpl& sequential, at::Tensor x) {
  for (size_t g = 0; g < sequential_groups_.size(); ++g) {
    size_t unit = sequential_unit_of_group_[g];
    if (unit != SIZE_MAX) unit_before_forward(unit);
    for (size_t child : sequential_groups_[g]) x = (sequential.begin() + child)->forward(x);
    if (unit != SIZE_MAX) unit_after_forward(unit, {x});
  }
  return x;
}

// --- backward --------------------------------------------------------------

void FsdpRuntime::register_pre_backward(size_t index, const std::vector<at::Tensor>& outputs) {
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([this, index](const at::Tensor&) { pre_backward(index); });
  }
}

void FsdpRuntime::pre_backward(size_t index) {
  Unit& unit = *units_[index];
  if (unit.pre_backward_ran || unit.reduced) return;
  unit.pre_backward_ran = true;
  finish_gather(unit);
  if (!options_.backward_prefetch()) return;
  // Backward runs the units in reverse forward order: gather the next one.
  auto it = std::find(forward_order_.begin(), forward_order_.end(), index);
  if (it != forward_order_.end() && it != forward_order_.begin()) start_gather(*units_[*(it - 1)]);
}

// Reverse forward order (backward's), then the units that did not run, the
// root unit last: the same on every rank, since all ranks run the same units
// in the same order. The engine launches a unit only once it and every unit
// before it in this order have all their gradients.
std::vector<size_t> FsdpRuntime::on_round_start(bool /*synchronised*/) {
  std::vector<size_t> order;
  std::vector<char> placed(units_.size(), 0);
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) {
    if (!placed[*it] && !units_[*it]->is_root) {
      placed[*it] = 1;
      order.push_back(*it);
    }
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!placed[u]) order.push_back(u);
  }
  launch_position_.assign(units_.size(), 0);
  for (size_t position = 0; position < order.size(); ++position) launch_position_[order[position]] = position;
  return order;
}

// The unit's gradients as one flat tensor in its reduce dtype, zeros for a
// parameter without one (unused in this forward, as DDP would send). The
// parameters' own gradients are released as they are copied.
at::Tensor FsdpRuntime::flatten_gradients(Unit& unit) {
  at::NoGradGuard no_grad;
  at::Tensor flat = at::empty({unit.padded}, unit.full.options().dtype(unit.reduce_dtype));
  if (unit.padded > unit.numel) flat.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
  for (size_t j = 0; j < unit.params.size(); ++j) {
    at::Tensor slot = flat.narrow(0, unit.offsets[j], unit.params[j].numel());
    at::Tensor& grad = unit.params[j].mutable_grad();
    if (grad.defined()) {
      slot.copy_(grad.reshape({-1}));
      grad.reset();
    } else {
      slot.zero_();
    }
  }
  return flat;
}

c10::intrusive_ptr<c10::ivalue::Future> FsdpRuntime::launch_group(size_t index) {
  Unit& unit = *units_[index];
  at::NoGradGuard no_grad;
  const int64_t world = group_->size();
  // Reduce-scattered, a unit's full gradient is needed only until its
  // collective ends: nothing here keeps it, so it is freed then. Waiting
  // for the previous unit's reduce-scatter before flattening this one
  // bounds how many exist at once when backward computes faster than the
  // reduce-scatters run (on CPUs, say), as FSDP2's one reduce-scatter in
  // flight does; the wait costs nothing when communication keeps up.
  const bool scatters = sharded() && world > 1;
  if (scatters) {
    for (auto& other : units_) {
      if (!other->scatter_in_flight) continue;
      other->scatter_in_flight->wait();  // an error reaches the engine through that unit's future
      other->scatter_in_flight.reset();
    }
  }
  at::Tensor flat = flatten_gradients(unit);
  if (unit.unsynced_gradient.defined()) {
    flat.add_(unit.unsynced_gradient);
    unit.unsynced_gradient.reset();
  }
  // Averaged over ranks (every replica's too, under HSDP), like DDP's
  // gradients; dividing first keeps the sum in range for low-precision types.
  if (data_parallel_size() > 1) flat.div_(data_parallel_size());
  unit.reduced = true;
  // All-reduced or on one rank, the full gradient is the result.
  if (!scatters) unit.gradient_flat = flat;
  c10::intrusive_ptr<c10::ivalue::Future> reduced;
  if (world == 1) {
    reduced = completed_future(flat);
  } else {
    if (sharded()) unit.gradient_shard = at::empty({unit.shard_numel}, flat.options());
    const size_t position = launch_position_[index];
    GradBucket bucket(position, flat, position + 1 == units_.size(), unit.gradient_shard);
    reduced = unit.hook->run(*group_, bucket);
    if (scatters) unit.scatter_in_flight = reduced;
  }
  flat.reset();
  // The unit's backward is over: give back its full parameters (the root's
  // too, so that between steps only shards are held).
  release(unit);
  if (!replicate_group_) return reduced;
  // HSDP: the engine waits for the shard's all-reduce across the replicas,
  // which starts once the shard group's reduction is done.
  unit.scattered = reduced;
  const auto& device = unit.shard.device();
  unit.replicated = device.is_cpu() ? c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get())
                                    : c10::make_intrusive<c10::ivalue::Future>(
                                          c10::TensorType::get(), std::vector<c10::Device>{device});
  awaiting_replicate_.push_back(index);
  launch_replicate_reductions(/*wait_for_all=*/false);
  return unit.replicated;
}

// Only the autograd thread starts replicate all-reduces, and always in
// launch order: a unit whose reduce-scatter is done waits for the ones
// before it. Starting them from the reduce-scatters' completion callbacks
// instead could order them differently on different ranks.
void FsdpRuntime::launch_replicate_reductions(bool wait_for_all) {
  size_t done = 0;
  for (; done < awaiting_replicate_.size(); ++done) {
    Unit& unit = *units_[awaiting_replicate_[done]];
    if (!wait_for_all && !unit.scattered->completed()) break;
    unit.scattered->wait();
    auto replicated = unit.replicated;
    if (unit.scattered->hasError()) {
      // Every rank still issues the all-reduce: the other replicas' would
      // otherwise wait for this one until the timeout.
      replicated->setError(unit.scattered->exception_ptr());
      at::Tensor zeros = at::zeros({unit.shard.numel()}, unit.shard.options().dtype(unit.replicate_dtype));
      CollectiveTag tag("fsdp unit '" + unit.name + "' all-reduce across replicas");
      replicate_group_->all_reduce_async(zeros);
      unit.scattered.reset();
      continue;
    }
    const c10::IValue& value = unit.scattered->value();
    at::Tensor shard = value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
    unit.scattered.reset();
    at::Tensor wire = shard.scalar_type() == unit.replicate_dtype ? shard : shard.to(unit.replicate_dtype);
    CollectiveTag tag("fsdp unit '" + unit.name + "' all-reduce across replicas");
    auto work = replicate_group_->all_reduce_async(wire);
    work->getFuture()->addCallback([replicated, wire, shard](c10::ivalue::Future& all_reduced) {
      if (all_reduced.hasError()) {
        replicated->setError(all_reduced.exception_ptr());
        return;
      }
      if (!wire.is_same(shard)) shard.copy_(wire);
      replicated->markCompleted(shard);
    });
  }
  awaiting_replicate_.erase(awaiting_replicate_.begin(), awaiting_replicate_.begin() + done);
}

void FsdpRuntime::before_waiting(const std::vector<char>& /*used_locally*/) {
  if (replicate_group_) launch_replicate_reductions(/*wait_for_all=*/true);
}

void FsdpRuntime::on_group_complete_without_sync(size_t index) {
  // Accumulating without synchronisation: no collective; the full gradient
  // is kept (as PyTorch's FSDP does) until a synchronised backward.
  Unit& unit = *units_[index];
  at::Tensor flat = flatten_gradients(unit);
  at::NoGradGuard no_grad;
  if (unit.unsynced_gradient.defined()) unit.unsynced_gradient.add_(flat);
  else unit.unsynced_gradient = flat;
  unit.reduced = true;
  release(unit);
}

void FsdpRuntime::finish_group(size_t index, const at::Tensor& result) {
  Unit& unit = *units_[index];
  at::NoGradGuard no_grad;
  DDP_CHECK(result.numel() == unit.shard.numel(), "ddp: the communication hook returned ", result.numel(),
            " elements for FSDP unit '", unit.name, "', whose shard has ", unit.shard.numel());
  at::Tensor reduced = result.dim() == 1 ? result : result.reshape({-1});
  // Ours to keep: this pass's buffers, or a cast of the result. A hook's
  // own tensor is copied.
  bool owned = reduced.is_same(unit.gradient_flat) || reduced.is_same(unit.gradient_shard);
  if (reduced.scalar_type() != unit.shard.scalar_type()) {
    reduced = reduced.to(unit.shard.scalar_type());
    owned = true;
  }
  at::Tensor& grad = unit.shard.mutable_grad();
  if (grad.defined()) {
    grad.add_(reduced);  // accumulation over several backward passes
  } else {
    grad = owned ? reduced : reduced.clone();
  }
  unit.gradient_flat.reset();
  unit.gradient_shard.reset();
}

void FsdpRuntime::on_round_end(bool /*synchronised*/) {
  // Ready for another backward through the same graph (retain_graph).
  reset_backward_state();
}

std::string FsdpRuntime::group_label(size_t index) const {
  return "the gradients of FSDP unit '" + units_[index]->name + "'";
}

std::string FsdpRuntime::collective_tag(size_t index) const {
  return "fsdp unit '" + units_[index]->name + (sharded() ? "' reduce-scatter" : "' all-reduce") +
         (replicate_group_ ? " (then across replicas)" : "");
}

}  // namespace ddp::detail
