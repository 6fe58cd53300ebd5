// One FSDP step (see src/sharding/fsdp_runtime.h): a unit's lifecycle and states, how
// it is gathered and how its gradient is reduced, and the runtime that drives
// them. The forward gathers each unit as it runs and arranges its gather for
// backward; in backward FSDP is the gradient engine's policy
// (src/engine/gradient_sync_engine.h): a unit is a group, launched in reverse
// forward order, flattened, reduced into the shard and freed.

#include "sharding/fsdp_runtime.h"

#include <ddp/error.h>

#include "engine/gradient_sync_engine.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>

namespace ddp::detail {

// --- a unit's dtypes and lifecycle -----------------------------------------------

UnitPrecision UnitPrecision::resolve(const MixedPrecisionPolicy& policy, at::ScalarType own) {
  UnitPrecision resolved;
  resolved.own = own;
  resolved.param = policy.param_dtype.value_or(own);
  const at::ScalarType reduce = policy.reduce_dtype.value_or(resolved.param);
  resolved.flat_gradient =
      c10::elementSize(reduce) > c10::elementSize(resolved.param) ? reduce : resolved.param;
  resolved.reduce = reduce;
  return resolved;
}

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

}  // namespace

void FsdpUnit::unshard() {
  if (sharded_state_ != ShardedState::kSharded) return;
  allocate_storage(full);
  if (on_allocate) on_allocate();
  at::NoGradGuard no_grad;
  gather_input_ = shard.detach();
  if (gather_input_.scalar_type() != full.scalar_type()) gather_input_ = gather_input_.to(full.scalar_type());
  pending_gather_ = gather->start(*this, gather_input_);
  sharded_state_ = pending_gather_ ? ShardedState::kUnsharding : ShardedState::kUnsharded;
  if (!pending_gather_) gather_input_.reset();
}

void FsdpUnit::wait_for_unshard() {
  unshard();
  if (sharded_state_ != ShardedState::kUnsharding) return;
  auto work = std::move(pending_gather_);
  pending_gather_.reset();
  // Unsharded even if the wait throws: reshard() must not wait for it again.
  sharded_state_ = ShardedState::kUnsharded;
  gather->wait(work);
  gather_input_.reset();
}

void FsdpUnit::reshard() {
  if (!gather->frees_full()) return;
  // A collective still writing into `full` must end before its memory goes.
  if (sharded_state_ == ShardedState::kUnsharding) wait_for_unshard();
  release_storage(full);
  sharded_state_ = ShardedState::kSharded;
}

void FsdpUnit::regather() {
  if (!gathered() || !gather->frees_full()) return;
  sharded_state_ = ShardedState::kSharded;
  wait_for_unshard();
}

void FsdpUnit::pre_forward() {
  training_state_ = next_training_state(training_state_, UnitEvent::kPreForward, name);
  wait_for_unshard();
}

void FsdpUnit::post_forward(bool reshard_now) {
  training_state_ = next_training_state(training_state_, UnitEvent::kPostForward, name);
  if (reshard_now) reshard();
}

bool FsdpUnit::pre_backward() {
  const TrainingState before = training_state_;
  training_state_ = next_training_state(training_state_, UnitEvent::kPreBackward, name);
  if (training_state_ == before) return false;
  wait_for_unshard();
  return true;
}

at::Tensor FsdpUnit::post_backward() {
  training_state_ = next_training_state(training_state_, UnitEvent::kPostBackward, name);
  at::Tensor flat = flatten_gradients();
  if (unsynced_gradient.defined()) {
    flat.add_(unsynced_gradient);
    unsynced_gradient.reset();
  }
  // The unit's backward is over: give back its full parameters (the root's
  // too, so that between steps only shards are held).
  reshard();
  return flat;
}

void FsdpUnit::end_pass() {
  training_state_ = next_training_state(training_state_, UnitEvent::kEndOfPass, name);
  // Left by a backward that failed part-way; nobody waits for them now.
  gradient_flat.reset();
  gradient_shard.reset();
}

// The unit's gradients as one flat tensor, zeros for a parameter without one
// (unused in this forward, as DDP would send). The parameters' own gradients
// are released as they are copied.
at::Tensor FsdpUnit::flatten_gradients() {
  at::NoGradGuard no_grad;
  at::Tensor flat = at::empty({layout.padded}, full.options().dtype(precision.flat_gradient));
  if (layout.padded > layout.numel) flat.narrow(0, layout.numel, layout.padded - layout.numel).zero_();
  for (size_t j = 0; j < params.size(); ++j) {
    at::Tensor slot = flat.narrow(0, layout.offsets[j], layout.numel_of(j));
    at::Tensor& grad = params[j].mutable_grad();
    if (grad.defined()) {
      slot.copy_(grad.reshape({-1}));
      grad.reset();
    } else {
      slot.zero_();
    }
  }
  return flat;
}

// --- gathering -----------------------------------------------------------------

namespace {

class AllGather : public UnitGather {
 public:
  explicit AllGather(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

  ShardRange shard_of(const FlatLayout& layout) const override {
    return padded_shard(layout.numel, group_->size(), group_->rank());
  }
  c10::intrusive_ptr<c10d::Work> start(FsdpUnit& unit, at::Tensor& input) override {
    CollectiveTag tag("fsdp unit '" + unit.name + "' all-gather");
    return group_->all_gather_into_async(unit.full, input);
  }
  void wait(const c10::intrusive_ptr<c10d::Work>& work) override {
    group_->wait(work, "FSDP all_gather of parameters");
  }
  at::Tensor gather_now(const at::Tensor& part, int64_t padded, const std::string& what) override {
    at::Tensor full = at::empty({padded}, part.options());
    at::Tensor input = part.contiguous();
    CollectiveTag tag("fsdp " + what);
    const std::string failure = "FSDP all_gather of " + what;
    group_->wait(group_->all_gather_into_async(full, input), failure.c_str());
    return full;
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

// kNoShard: the shard is the whole padded flat tensor.
class KeepWhole : public UnitGather {
 public:
  explicit KeepWhole(bool casts) : casts_(casts) {}

  ShardRange shard_of(const FlatLayout& layout) const override { return {0, layout.padded}; }
  // Without a cast `full` is the shard's own storage, never freed.
  bool frees_full() const override { return casts_; }
  c10::intrusive_ptr<c10d::Work> start(FsdpUnit& unit, at::Tensor& input) override {
    unit.full.copy_(input);
    return {};
  }
  void wait(const c10::intrusive_ptr<c10d::Work>& /*work*/) override {}
  at::Tensor gather_now(const at::Tensor& part, int64_t /*padded*/, const std::string& /*what*/) override {
    return part;
  }

 private:
  bool casts_;
};

}  // namespace

std::shared_ptr<UnitGather> all_gather(std::shared_ptr<ProcessGroup> group) {
  return std::make_shared<AllGather>(std::move(group));
}

std::shared_ptr<UnitGather> keep_whole(bool casts) { return std::make_shared<KeepWhole>(casts); }

// --- reducing ------------------------------------------------------------------

namespace {

class ReduceScatter : public UnitReduce {
 public:
  explicit ReduceScatter(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

  // A reduce-scatter's input is not kept: nothing here holds a unit's full
  // gradient past its collective.
  void before_flatten() override {
    if (!in_flight_) return;
    in_flight_->wait();  // an error reaches the engine through that unit's future
    in_flight_.reset();
  }
  c10::intrusive_ptr<c10::ivalue::Future> launch(FsdpUnit& unit, at::Tensor flat, size_t position,
                                                bool is_last) override {
    unit.gradient_shard = at::empty({unit.layout.shard.numel()}, flat.options());
    if (!unit.hook) {
      in_flight_ = group_->reduce_scatter_async(unit.gradient_shard, flat)->getFuture();
    } else {
      GradBucket bucket(position, std::move(flat), is_last, unit.gradient_shard);
      in_flight_ = unit.hook->run(*group_, bucket);
    }
    return in_flight_;
  }
  void reset() override { in_flight_.reset(); }
  std::string collectives() const override { return "reduce-scatters"; }
  std::string tag() const override { return "reduce-scatter"; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  // The previous unit's reduction, from its launch until the next unit's.
  c10::intrusive_ptr<c10::ivalue::Future> in_flight_;
};

class AllReduce : public UnitReduce {
 public:
  explicit AllReduce(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

  c10::intrusive_ptr<c10::ivalue::Future> launch(FsdpUnit& unit, at::Tensor flat, size_t position,
                                                bool is_last) override {
    unit.gradient_flat = flat;
    if (!unit.hook) return group_->all_reduce_async(flat)->getFuture();
    GradBucket bucket(position, std::move(flat), is_last);
    return unit.hook->run(*group_, bucket);
  }
  std::string collectives() const override { return "all-reduces"; }
  std::string tag() const override { return "all-reduce"; }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

// One rank: neither the hook nor a compression runs.
class LocalReduce : public UnitReduce {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> launch(FsdpUnit& unit, at::Tensor flat, size_t /*position*/,
                                                bool /*is_last*/) override {
    unit.gradient_flat = flat;
    return completed_future(flat);
  }
  std::string collectives() const override { return "all-reduces"; }
  std::string tag() const override { return "all-reduce"; }
};

// A hook's result: a tensor, or a list whose first is it.
at::Tensor first_tensor(const c10::IValue& value) {
  DDP_CHECK(value.isTensor() || (value.isTensorList() && !value.toTensorList().empty()),
            "ddp: FSDPOptions::replicate_hook's future must hold a tensor (or a list of them), got ", value.tagKind());
  return value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
}

// How ReplicateStage sends a unit's shard across the replicas.
class AcrossReplicas {
 public:
  virtual ~AcrossReplicas() = default;
  /// Starts the exchange of `wire` (the shard in the reduce dtype); the
  /// future completes when the result is there (see in_place()).
  virtual c10::intrusive_ptr<c10::ivalue::Future> send(at::Tensor wire, size_t position, bool is_last) = 0;
  /// Whether the result is `wire` itself (reduced in place), not the
  /// future's value.
  virtual bool in_place() const = 0;
  /// For the collective trace and the stage's tag.
  virtual std::string what() const = 0;
};

// HSDP's replicate group: an all-reduce in place. FSDP divided by every
// replica already, so the sum is the average.
class ReplicateAllReduce : public AcrossReplicas {
 public:
  explicit ReplicateAllReduce(std::shared_ptr<ProcessGroup> replicate) : replicate_(std::move(replicate)) {}

  c10::intrusive_ptr<c10::ivalue::Future> send(at::Tensor wire, size_t /*position*/, bool /*is_last*/) override {
    return replicate_->all_reduce_async(wire)->getFuture();
  }
  bool in_place() const override { return true; }
  std::string what() const override { return "all-reduce across replicas"; }

 private:
  std::shared_ptr<ProcessGroup> replicate_;
};

// FSDPOptions::replicate_hook: the replicas are the hook's business, and it
// averages over them itself.
class ReplicateHook : public AcrossReplicas {
 public:
  ReplicateHook(std::shared_ptr<CommHook> hook, std::shared_ptr<ProcessGroup> group)
      : hook_(std::move(hook)), group_(std::move(group)) {}

  c10::intrusive_ptr<c10::ivalue::Future> send(at::Tensor wire, size_t position, bool is_last) override {
    GradBucket bucket(position, std::move(wire), is_last);
    try {
      return hook_->run(*group_, bucket);
    } catch (...) {
      // As a failed future: the units after this one must still be sent.
      auto failed = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
      failed->setError(std::current_exception());
      return failed;
    }
  }
  bool in_place() const override { return false; }
  std::string what() const override { return "replicate hook"; }

 private:
  std::shared_ptr<CommHook> hook_;
  std::shared_ptr<ProcessGroup> group_;
};

// HSDP: the engine waits for the shard's exchange across the replicas,
// which starts once the shard group's reduction is done. Only the autograd
// thread starts them, always in launch order: a unit whose reduction is done
// waits for the ones before it. Starting them from the reductions'
// completion callbacks instead could order them differently on different
// ranks.
class ReplicateStage : public UnitReduce {
 public:
  ReplicateStage(std::unique_ptr<UnitReduce> shard_reduce, std::unique_ptr<AcrossReplicas> across)
      : shard_reduce_(std::move(shard_reduce)), across_(std::move(across)) {}

  void before_flatten() override { shard_reduce_->before_flatten(); }
  c10::intrusive_ptr<c10::ivalue::Future> launch(FsdpUnit& unit, at::Tensor flat, size_t position,
                                                bool is_last) override {
    Pending pending{&unit, position, is_last, shard_reduce_->launch(unit, std::move(flat), position, is_last), {}};
    const auto& device = unit.shard.device();
    pending.replicated = device.is_cpu() ? c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get())
                                         : c10::make_intrusive<c10::ivalue::Future>(
                                               c10::TensorType::get(), std::vector<c10::Device>{device});
    auto replicated = pending.replicated;
    awaiting_.push_back(std::move(pending));
    launch_in_order(/*wait_for_all=*/false);
    return replicated;
  }
  void before_waiting() override {
    shard_reduce_->before_waiting();
    launch_in_order(/*wait_for_all=*/true);
  }
  void reset() override {
    shard_reduce_->reset();
    awaiting_.clear();
  }
  std::string collectives() const override { return shard_reduce_->collectives(); }
  std::string tag() const override { return shard_reduce_->tag() + " (then " + across_->what() + ")"; }

 private:
  struct Pending {
    FsdpUnit* unit;
    size_t position;
    bool is_last;
    c10::intrusive_ptr<c10::ivalue::Future> scattered;   // the shard group's reduction
    c10::intrusive_ptr<c10::ivalue::Future> replicated;  // what the engine waits for
  };

  // Sends the shards of units whose shard-group reduction has finished, up
  // to the first unfinished one; with `wait_for_all`, of every unit.
  void launch_in_order(bool wait_for_all) {
    size_t done = 0;
    for (; done < awaiting_.size(); ++done) {
      Pending& pending = awaiting_[done];
      if (!wait_for_all && !pending.scattered->completed()) break;
      pending.scattered->wait();
      const FsdpUnit& unit = *pending.unit;
      CollectiveTag tag("fsdp unit '" + unit.name + "' " + across_->what());
      if (pending.scattered->hasError()) {
        // Every rank still sends: the other replicas' exchange would
        // otherwise wait for this one until the timeout.
        pending.replicated->setError(pending.scattered->exception_ptr());
        at::Tensor zeros = at::zeros({unit.shard.numel()}, unit.shard.options().dtype(unit.precision.reduce));
        across_->send(zeros, pending.position, pending.is_last);
        continue;
      }
      const c10::IValue& value = pending.scattered->value();
      at::Tensor shard = value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
      at::Tensor wire = shard.scalar_type() == unit.precision.reduce ? shard : shard.to(unit.precision.reduce);
      across_->send(wire, pending.position, pending.is_last)
          // Tensors only: the callback outlives the stage on a collective's own
          // thread, where the last reference to a process group must not die.
          ->addCallback([in_place = across_->in_place(), replicated = pending.replicated, wire, shard,
                         name = unit.name](c10::ivalue::Future& exchanged) {
            if (exchanged.hasError()) {
              replicated->setError(exchanged.exception_ptr());
              return;
            }
            try {
              const at::Tensor averaged = in_place ? wire : first_tensor(exchanged.constValue());
              DDP_CHECK(averaged.numel() == shard.numel(), "ddp: FSDPOptions::replicate_hook returned ",
                        averaged.numel(), " elements for FSDP unit '", name, "', whose shard has ", shard.numel());
              if (!averaged.is_same(shard)) shard.copy_(averaged.reshape({-1}));
              replicated->markCompleted(shard);
            } catch (...) {
              replicated->setError(std::current_exception());
            }
          });
    }
    awaiting_.erase(awaiting_.begin(), awaiting_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  std::unique_ptr<UnitReduce> shard_reduce_;
  std::unique_ptr<AcrossReplicas> across_;
  std::vector<Pending> awaiting_;  // launched in the shard group, not yet across the replicas; in launch order
};

}  // namespace

std::unique_ptr<UnitReduce> reduce_scatter(std::shared_ptr<ProcessGroup> group) {
  return std::make_unique<ReduceScatter>(std::move(group));
}
std::unique_ptr<UnitReduce> all_reduce(std::shared_ptr<ProcessGroup> group) {
  return std::make_unique<AllReduce>(std::move(group));
}
std::unique_ptr<UnitReduce> local_reduce() { return std::make_unique<LocalReduce>(); }
std::unique_ptr<UnitReduce> then_across_replicas(std::unique_ptr<UnitReduce> shard_reduce,
                                                 std::shared_ptr<ProcessGroup> replicate) {
  return std::make_unique<ReplicateStage>(std::move(shard_reduce),
                                          std::make_unique<ReplicateAllReduce>(std::move(replicate)));
}
std::unique_ptr<UnitReduce> then_replicate_hook(std::unique_ptr<UnitReduce> shard_reduce,
                                                std::shared_ptr<CommHook> hook, std::shared_ptr<ProcessGroup> group) {
  return std::make_unique<ReplicateStage>(std::move(shard_reduce),
                                          std::make_unique<ReplicateHook>(std::move(hook), std::move(group)));
}

// --- forward -------------------------------------------------------------------

void FsdpRuntime::end_pass() {
  for (auto& unit : units_) unit->end_pass();
  reduce_->reset();
}

void FsdpRuntime::begin_forward() {
  // A backward pass that failed part-way (some reductions may have started
  // on this rank only) is an error, raised by the engine.
  if (engine_->round_active()) end_pass();
  engine_->check_previous_round_finished();
  // Whatever an earlier forward left gathered (one whose backward never ran)
  // is released, so every forward starts from the current shards.
  free_all();
  end_pass();
  if (!forward_order_.empty()) last_forward_order_ = forward_order_;
  forward_order_.clear();
  if (units_.back()->is_root) {
    FsdpUnit& root = *units_.back();
    root.unshard();
    // The first unit's gather overlaps the root's.
    if (options_.forward_prefetch() && !last_forward_order_.empty()) units_[last_forward_order_.front()]->unshard();
    root.pre_forward();
  }
}

void FsdpRuntime::unit_before_forward(size_t index) {
  FsdpUnit& unit = *units_[index];
  size_t position = forward_order_.size();
  forward_order_.push_back(index);
  unit.pre_forward();
  if (options_.forward_prefetch() && position + 1 < last_forward_order_.size() &&
      last_forward_order_[position] == index) {
    units_[last_forward_order_[position + 1]]->unshard();
  }
}

void FsdpRuntime::unit_after_forward(size_t index, const std::vector<at::Tensor>& outputs) {
  FsdpUnit& unit = *units_[index];
  const bool backward_follows = at::GradMode::is_enabled();
  unit.post_forward(/*reshard_now=*/!backward_follows || unit.reshard_after_forward);
  if (backward_follows) register_pre_backward(index, outputs);
}

void FsdpRuntime::end_forward(const std::vector<at::Tensor>& outputs) {
  const bool backward_follows = at::GradMode::is_enabled() &&
                                std::any_of(outputs.begin(), outputs.end(),
                                            [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  // The root unit stays gathered from forward to backward.
  if (units_.back()->is_root) units_.back()->post_forward(/*reshard_now=*/false);
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
      if (units_.back()->is_root) units_.back()->wait_for_unshard();
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

// --- backward ------------------------------------------------------------------

void FsdpRuntime::register_pre_backward(size_t index, const std::vector<at::Tensor>& outputs) {
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([this, index](const at::Tensor&) { pre_backward(index); });
  }
}

void FsdpRuntime::pre_backward(size_t index) {
  if (!units_[index]->pre_backward() || !options_.backward_prefetch()) return;
  // Backward runs the units in reverse forward order: gather the next one.
  auto it = std::find(forward_order_.begin(), forward_order_.end(), index);
  if (it != forward_order_.end() && it != forward_order_.begin()) units_[*(it - 1)]->unshard();
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

c10::intrusive_ptr<c10::ivalue::Future> FsdpRuntime::launch_group(size_t index) {
  FsdpUnit& unit = *units_[index];
  at::NoGradGuard no_grad;
  reduce_->before_flatten();
  at::Tensor flat = unit.post_backward();
  // Averaged over ranks (every replica's too, under HSDP), like DDP's
  // gradients; dividing first keeps the sum in range for low-precision types.
  if (data_parallel_size_ > 1) flat.div_(data_parallel_size_);
  const size_t position = launch_position_[index];
  return reduce_->launch(unit, std::move(flat), position, position + 1 == units_.size());
}

void FsdpRuntime::before_waiting(const std::vector<char>& /*used_locally*/) { reduce_->before_waiting(); }

void FsdpRuntime::on_group_complete_without_sync(size_t index) {
  // Accumulating without synchronisation: no collective; the full gradient
  // is kept (as PyTorch's FSDP does) until a synchronised backward.
  FsdpUnit& unit = *units_[index];
  at::NoGradGuard no_grad;
  unit.unsynced_gradient = unit.post_backward();
}

void FsdpRuntime::finish_group(size_t index, const at::Tensor& result) {
  FsdpUnit& unit = *units_[index];
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
  end_pass();
}

std::string FsdpRuntime::group_label(size_t index) const {
  return "the gradients of FSDP unit '" + units_[index]->name + "'";
}

std::string FsdpRuntime::collective_tag(size_t index) const {
  return "fsdp unit '" + units_[index]->name + "' " + reduce_->tag();
}

}  // namespace ddp::detail
