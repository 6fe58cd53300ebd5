#pragma once

// DistributedDataParallel: one replica of a model per process. Construction
// checks that every rank built the same model and copies rank 0's weights to
// all; afterwards every backward() leaves each parameter's gradient averaged
// over all ranks, so identical optimizer steps keep the replicas identical.
//
//   auto group = ddp::init_process_group();
//   ddp::DistributedDataParallel<Net> model(Net(), group);
//   torch::optim::Adam optimizer(model->parameters(), 1e-3);
//   ...
//   auto loss = torch::nn::functional::cross_entropy(model.forward(x), y);
//   loss.backward();   // gradients are all-reduced while backward runs
//   optimizer.step();
//
// It wraps any LibTorch module: a ModuleHolder (TORCH_MODULE types,
// torch::nn::Sequential, ...), a std::shared_ptr to a Module subclass,
// torch::nn::AnyModule, or a TorchScript torch::jit::Module from
// torch::jit::load (forward takes and returns IValues, as the module's own).

#include <ddp/bucket_reducer.h>
#include <ddp/process_group.h>

#include <ddp/checkpoint.h>
#include <ddp/detail/replica_broadcast.h>

#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <type_traits>

#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace ddp {

// A DDPOptions setter and getter that forward to its ReducerOptions, so that
// each option is declared (and documented) once, in ReducerOptions.
#define DDP_REDUCER_ARG(T, name)                             \
  DDPOptions& name(const T& value) {                         \
    reducer_.name(value);                                    \
    return *this;                                            \
  }                                                          \
  const T& name() const noexcept { return reducer_.name(); } \
  T& name() noexcept { return reducer_.name(); }

/// Options for DistributedDataParallel; the defaults are PyTorch's.
///
///   ddp::DDPOptions().bucket_cap_mb(50).find_unused_parameters(true)
///
/// How gradients are bucketed and reduced is a ReducerOptions (see
/// bucket_reducer.h for what each option does); DDPOptions sets its fields
/// directly, as above, or takes a whole one with reducer(...).
struct DDPOptions {
  /// The bucket reducer's options.
  TORCH_ARG(ReducerOptions, reducer) = {};
  /// Copy rank 0's buffers (BatchNorm statistics, say) to every rank before
  /// each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;

 public:
  DDP_REDUCER_ARG(double, bucket_cap_mb)
  DDP_REDUCER_ARG(double, first_bucket_cap_mb)
  DDP_REDUCER_ARG(bool, find_unused_parameters)
  DDP_REDUCER_ARG(bool, gradient_as_bucket_view)
  DDP_REDUCER_ARG(bool, rebuild_buckets)
  DDP_REDUCER_ARG(bool, overlap_with_backward)
  /// allreduce_hook() (null), fp16_compress_hook(), bf16_compress_hook() or
  /// your own CommHook.
  DDP_REDUCER_ARG(std::shared_ptr<CommHook>, comm_hook)
  DDP_REDUCER_ARG(bool, carry_loss)
  DDP_REDUCER_ARG(bool, static_graph)
};

#undef DDP_REDUCER_ARG

/// While alive, backward passes only accumulate gradients locally; the next
/// backward outside it all-reduces the accumulated sum (gradient
/// accumulation without communicating every micro-batch).
class NoSyncGuard {
 public:
  /// Turns synchronisation off on `reducer` until the guard is destroyed.
  explicit NoSyncGuard(BucketReducer& reducer) : reducer_(&reducer), previous_(reducer.require_sync()) {
    reducer_->set_require_sync(false);
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept : reducer_(other.reducer_), previous_(other.previous_) {
    other.reducer_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (reducer_) reducer_->set_require_sync(previous_);
  }

 private:
  BucketReducer* reducer_;
  bool previous_;
};

namespace detail {

// What stays here is what DistributedDataParallel<ModuleType> and
// FullyShardedDataParallel<ModuleType> instantiate in the user's code: how
// each kind of module is reached (ModuleAdapter, as_module_ptr), whether a
// type is a module at all (the static_assert's message must name the type at
// compile time), and the tensors of a forward's result, whose type is the
// module's own. The rest is in the library (src/).

// The tensors of a forward's result, for finding unused parameters early.
// Results of other types yield none; unused parameters are then found at
// the end of backward, and their buckets start last.
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
/// A TorchScript result: tensors inside tuples, lists and dicts, at any depth.
void collect_tensors(const c10::IValue& value, std::vector<at::Tensor>& out);
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... items) { (collect_tensors(items, out), ...); }, t);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}

inline std::shared_ptr<torch::nn::Module> as_module_ptr(std::shared_ptr<torch::nn::Module> module) {
  return module;
}
template <typename Impl>
std::shared_ptr<torch::nn::Module> as_module_ptr(const torch::nn::ModuleHolder<Impl>& holder) {
  return holder.ptr();
}
template <typename Impl, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, Impl>>>
std::shared_ptr<torch::nn::Module> as_module_ptr(const std::shared_ptr<Impl>& module) {
  return module;
}
inline std::shared_ptr<torch::nn::Module> as_module_ptr(const torch::nn::AnyModule& module) {
  return module.ptr();
}

template <typename T>
struct IsModuleHolder {
  template <typename Impl>
  static std::true_type test(const torch::nn::ModuleHolder<Impl>*);
  static std::false_type test(...);
  static constexpr bool value = decltype(test(std::declval<T*>()))::value;
};
template <typename T>
struct IsModulePtr : std::false_type {};
template <typename Impl>
struct IsModulePtr<std::shared_ptr<Impl>> : std::is_base_of<torch::nn::Module, Impl> {};
template <typename T>
constexpr bool kIsJitModule = std::is_same_v<T, torch::jit::Module>;

/// How DistributedDataParallel reaches each kind of module.
template <typename M>
struct ModuleAdapter {
  static constexpr bool kSupported = IsModuleHolder<M>::value || IsModulePtr<M>::value ||
                                     std::is_same_v<M, torch::nn::AnyModule> || kIsJitModule<M>;
  static std::shared_ptr<ModuleTensors> tensors(const M& m) {
    if constexpr (kIsJitModule<M>) {
      return module_tensors(m);
    } else {
      return module_tensors(as_module_ptr(m));
    }
  }
  template <typename... Args>
  static decltype(auto) forward(M& m, Args&&... args) {
    if constexpr (kIsJitModule<M>) {
      if constexpr (sizeof...(Args) == 1 && (std::is_convertible_v<Args, std::vector<c10::IValue>> && ...)) {
        return m.forward(std::forward<Args>(args)...);
      } else {
        return m.forward(std::vector<c10::IValue>{c10::IValue(std::forward<Args>(args))...});
      }
    } else if constexpr (std::is_same_v<M, torch::nn::AnyModule>) {
      return m.forward(std::forward<Args>(args)...);
    } else {
      using Impl = std::remove_reference_t<decltype(*m)>;
      static_assert(!std::is_same_v<Impl, torch::nn::Module>,
                    "ddp: torch::nn::Module has no forward(). Wrap the concrete module type, or run your "
                    "forward through model.forward_with([&] { return net->forward(x); })");
      return m->forward(std::forward<Args>(args)...);
    }
  }
  static auto arrow(M& m) {
    if constexpr (kIsJitModule<M> || std::is_same_v<M, torch::nn::AnyModule>) {
      return &m;
    } else {
      return &*m;
    }
  }
};

/// DistributedDataParallel's runtime, the part that does not depend on the
/// module's type: at construction the replica check and rank 0's broadcast,
/// before each forward the buffer broadcast, the bucket reducer, and Join's
/// shadow step. DistributedDataParallel<ModuleType> holds it by value and
/// calls it inline, so it is declared here.
class DdpRuntime {
 public:
  DdpRuntime(std::shared_ptr<ModuleTensors> module, std::shared_ptr<ProcessGroup> group, DDPOptions options);
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);
  /// One training step of the others, mirrored by a rank without data.
  void shadow_step();
  const ModuleTensors& tensors() const { return *module_; }
  bool wants_outputs() const { return options_.find_unused_parameters(); }
  BucketReducer& reducer() { return *reducer_; }
  const BucketReducer& reducer() const { return *reducer_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  std::shared_ptr<ModuleTensors> module_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  bool has_buffers_ = false;
  std::unique_ptr<BucketReducer> reducer_;
};

/// Rank 0 loads `path` into `module`; then its values go to every rank.
void load_on_root_and_broadcast(const ModuleTensors& module, ProcessGroup& group, const std::string& path);
}  // namespace detail

/// Lets ranks with different numbers of batches finish without hanging:
///
///   auto join = model.join();
///   for (auto& batch : my_batches) {   // fewer on some ranks than others
///     join.step();                     // before each forward
///     ... forward, backward, optimizer step ...
///   }
///   join.finish();                     // mirrors the others' remaining steps
///
/// A rank that runs out of data takes part in the others' collectives with
/// zero gradients (so their averages are over the full world size, as in
/// PyTorch's Join). At the end, every rank takes the weights of the rank
/// that trained longest. step() costs one small all-reduce per step.
///
/// A joined rank mirrors the gradient all-reduces and buffer broadcasts of
/// DDP only: it does not mirror ZeroRedundancyOptimizer::step()'s broadcasts,
/// and every step of the others must be a synchronised one (no no_sync()).
class Join {
 public:
  Join(detail::DdpRuntime& runtime, ProcessGroup& group) : runtime_(runtime), group_(group) {}
  /// Call once per training step, before the forward. Returns the number of
  /// ranks still training.
  int step();
  /// Call once this rank is out of data; returns when every rank is.
  void finish();
  int64_t steps() const { return steps_; }
  int64_t shadowed_steps() const { return shadowed_; }

 private:
  detail::DdpRuntime& runtime_;
  ProcessGroup& group_;
  int64_t steps_ = 0;
  int64_t shadowed_ = 0;
  bool finished_ = false;
};

/// Wraps a module for data-parallel training over `group`: a ModuleHolder
/// (torch::nn::Sequential, a TORCH_MODULE type), a std::shared_ptr to a
/// Module subclass, torch::nn::AnyModule, or a torch::jit::Module.
template <typename ModuleType>
class DistributedDataParallel {
  static_assert(detail::ModuleAdapter<ModuleType>::kSupported,
                "ddp::DistributedDataParallel wraps a torch::nn::ModuleHolder (a TORCH_MODULE type, "
                "torch::nn::Sequential, ...), a std::shared_ptr to a torch::nn::Module subclass, "
                "torch::nn::AnyModule or a torch::jit::Module; this type is none of them");
  using Adapter = detail::ModuleAdapter<ModuleType>;

 public:
  /// Checks that every rank built the same model, copies rank 0's weights
  /// and buffers to all ranks, and attaches the gradient engine. Collective.
  DistributedDataParallel(ModuleType module, std::shared_ptr<ProcessGroup> group,
                          DDPOptions options = {})
      : module_(std::move(module)), runtime_(Adapter::tensors(module_), std::move(group), options) {}

  /// Runs the wrapped module's forward after synchronising buffers. Call
  /// this (or operator()), not model->forward(x): that bypasses the
  /// buffer broadcast, and ddp warns once at the next backward.
  /// A torch::jit::Module takes tensors or IValues (or one
  /// std::vector<IValue>) and returns an IValue, as its own forward does.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    return forward_with([&]() -> decltype(auto) { return Adapter::forward(module_, std::forward<Args>(args)...); });
  }

  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// Runs `run()` as this step's forward: buffers are synchronised first,
  /// and its result is inspected for unused parameters. For a forward that
  /// is not the module's own forward(), e.g. a method of your module.
  template <typename Fn>
  decltype(auto) forward_with(Fn&& run) {
    runtime_.before_forward();
    decltype(auto) result = run();
    if (runtime_.wants_outputs()) {
      std::vector<at::Tensor> outputs;
      detail::collect_tensors(result, outputs);
      runtime_.after_forward(outputs);
    }
    return result;
  }

  /// The wrapped module, e.g. for evaluation without synchronisation.
  ModuleType& module() { return module_; }
  const ModuleType& module() const { return module_; }
  auto operator->() { return Adapter::arrow(module_); }
  auto operator->() const { return Adapter::arrow(const_cast<ModuleType&>(module_)); }

  /// The trainable parameters, for the optimizer, whatever the module kind.
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> params;
    for (auto& [name, p] : runtime_.tensors().named_parameters()) {
      if (p.requires_grad()) params.push_back(p);
    }
    return params;
  }
  /// Parameters and buffers in Python's state_dict() order.
  StateDict state_dict() const { return runtime_.tensors().state_dict(); }

  /// Skip gradient synchronisation inside a scope:
  ///
  ///   { auto guard = model.no_sync(); loss_of(micro_batch_1).backward(); }
  ///   loss_of(micro_batch_2).backward();  // all-reduces the sum of both
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(runtime_.reducer()); }

  /// With DDPOptions().carry_loss(true): this rank's `loss` rides on the next
  /// backward's gradient all-reduce, so that afterwards every rank knows,
  /// with no collective of its own, which ranks had a non-finite loss and
  /// the loss averaged over ranks (reduced_loss(); check it with
  /// ddp::check_loss_is_finite(model.reduced_loss(), policy, where)).
  void note_loss(const at::Tensor& loss) { runtime_.reducer().note_loss(loss); }
  /// What the last synchronised backward carried (see note_loss).
  const ReducedLoss& reduced_loss() const { return runtime_.reducer().reduced_loss(); }

  /// From now on backward() also steps `optimizer`, bucket by bucket as each
  /// bucket's averaged gradients arrive, so the update hides behind the
  /// later buckets' all-reduces (worth it when the link, not the CPU or GPU,
  /// bounds the step):
  ///
  ///   model.step_in_backward(optimizer);
  ///   for (...) {
  ///     optimizer.zero_grad();
  ///     loss_of(batch).backward();   // all-reduces and steps; no optimizer.step()
  ///   }
  ///
  /// The result is the same as optimizer.step() after backward. See
  /// BucketReducer::step_in_backward for what it cannot be combined with.
  /// `optimizer` must outlive the model, or stop_stepping_in_backward() first.
  void step_in_backward(torch::optim::Optimizer& optimizer) { runtime_.reducer().step_in_backward(&optimizer); }
  /// Back to stepping the optimizer yourself after backward.
  void stop_stepping_in_backward() { runtime_.reducer().step_in_backward(nullptr); }

  /// Uneven data across ranks: see Join.
  Join join() { return Join(runtime_, *runtime_.group()); }

  const BucketReducer& reducer() const { return runtime_.reducer(); }
  const std::shared_ptr<ProcessGroup>& process_group() const { return runtime_.group(); }

 private:
  ModuleType module_;
  detail::DdpRuntime runtime_;
};

/// Saves a wrapped model's state dict to `path` from rank 0 only (every
/// replica holds the same weights); other ranks return at once. The file
/// loads in Python with torch.load(path) and load_state_dict(strict=True).
template <typename M>
void save(const DistributedDataParallel<M>& model, const std::string& path) {
  if (model.process_group()->rank() == 0) save_state_dict(model.state_dict(), path);
}

/// Loads `path` into a wrapped model: rank 0 reads the file, every rank
/// gets its values by broadcast, so only rank 0 needs the file. Names and
/// shapes must match (the error names the first that does not).
template <typename M>
void load(DistributedDataParallel<M>& model, const std::string& path) {
  detail::load_on_root_and_broadcast(*detail::ModuleAdapter<M>::tensors(model.module()), *model.process_group(),
                                     path);
}

}  // namespace ddp
