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

#include <ddp/export.h>
#include <ddp/comm_hooks.h>
#include <ddp/process_group.h>

#include <ddp/checkpoint.h>
#include <ddp/detail/replica_broadcast.h>
#include <ddp/nonfinite.h>

#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <type_traits>

#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp {
namespace detail {
class BucketReducer;  // src/engine/bucket_reducer.h
class DdpRuntime;
class LossRiderHook;  // src/engine/ddp_hooks.h
}  // namespace detail

/// Options for DistributedDataParallel; the defaults are PyTorch's, except
/// that buckets are fitted to the link unless bucket_cap_mb is set.
///
///   ddp::DDPOptions().bucket_cap_mb(50).find_unused_parameters(true)
struct DDPOptions {
  /// Cap of every bucket after the first, in MiB. Unset (the default), ddp
  /// fits it to the link: the first iteration runs with PyTorch's 25 MiB,
  /// then, when buckets are rebuilt, every rank measures the group's
  /// all-reduce (latency, bandwidth) and the backward pass it just ran, and
  /// all ranks take the cap that the slowest rank's figures say exposes the
  /// least communication: a few MiB when a slow link can hide behind a long
  /// backward, one or few buckets when latency dominates (see README,
  /// "Buckets"). Needs rebuild_buckets; without it the cap stays 25 MiB.
  /// Set, it is used as given and never changed: bucket_cap_mb(25) is
  /// PyTorch's fixed default.
  TORCH_ARG(std::optional<double>, bucket_cap_mb) = std::nullopt;
  /// Cap of the first bucket (the last layers' gradients, ready first), in
  /// MiB: small, so communication starts early in backward. Unset, it
  /// follows PyTorch: bucket_cap_mb when that is set (so
  /// bucket_cap_mb(100) makes every bucket 100 MiB), else 1 MiB (PyTorch's
  /// dist._DEFAULT_FIRST_BUCKET_BYTES; a model under 1 MiB travels in one
  /// bucket). Set, it is used as given.
  ///
  ///   ddp::DDPOptions().bucket_cap_mb(25).first_bucket_cap_mb(1)  // PyTorch's defaults, pinned
  TORCH_ARG(std::optional<double>, first_bucket_cap_mb) = std::nullopt;
  /// Allow parameters that take no part in a forward: they count as ready
  /// with a zero gradient. Off, such a parameter is an error naming it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Make each .grad share memory with its bucket, saving the copy back
  /// after the all-reduce and the memory of a second gradient copy. The
  /// gradients are plain tensors (not views), so optimizer.zero_grad() works.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// After the first iteration, regroup buckets in the order gradients
  /// actually became ready (rank 0's order, so all ranks agree).
  TORCH_ARG(bool, rebuild_buckets) = true;
  /// Start each bucket's reduction as soon as it is full. Off, every bucket
  /// waits for the end of backward; only useful to measure what overlap buys.
  TORCH_ARG(bool, overlap_with_backward) = true;
  /// How a bucket is reduced: null (ddp's choice: the plain all-reduce, or
  /// the hierarchical one across hosts, see hierarchical_allreduce), fp16_compress_hook(),
  /// bf16_compress_hook(), compress_hook(dtype, inner), powersgd_hook(),
  /// hierarchical_allreduce_hook(mesh) or your own CommHook.
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;
  /// Without a comm_hook, whether buckets are reduced hierarchically: summed
  /// within each host (shared memory, Gloo when DDP_SHM=0), all-reduced
  /// between one leader rank per host over Gloo, and broadcast back within
  /// the host, so one copy per host crosses the network instead of one per
  /// rank (hierarchical_allreduce_hook, with the ranks grouped by host).
  /// Unset (the default), ddp decides from the group's host layout, alike on
  /// every rank: hierarchical when DDP's Gloo group over CPU tensors spans
  /// more than one host and some host runs more than one rank (the hosts may
  /// run different numbers), flat otherwise; DDP_HIERARCHICAL=0 in the
  /// environment keeps the flat all-reduce. false: always flat. true: always
  /// hierarchical, and an error where the layout cannot take it. The sums
  /// equal the flat all-reduce's within float rounding (another order).
  /// Rank 0 prints the choice at start-up:
  /// `ddp: all-reduce hierarchical: shm within each host, gloo between 2 hosts ...`.
  ///
  ///   ddp::DDPOptions().hierarchical_allreduce(false)  // the flat all-reduce, bit for bit as before
  TORCH_ARG(std::optional<bool>, hierarchical_allreduce) = std::nullopt;
  /// The graph is the same every iteration (PyTorch's static_graph): the
  /// same parameters take part and their gradients arrive in the same order.
  /// With find_unused_parameters, the first iteration's findings are then
  /// kept: later iterations skip the search of the autograd graph for
  /// parameters the outputs cannot reach and the all-reduce of the
  /// per-parameter "used" flags. Without find_unused_parameters there is
  /// nothing to skip (the buckets are rebuilt once either way).
  TORCH_ARG(bool, static_graph) = false;
  /// Copy rank 0's buffers (BatchNorm statistics, say) to every rank before
  /// each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// The last bucket's all-reduce also carries each rank's loss, given to
  /// note_loss() before backward, as world size + 1 extra elements: a flag
  /// per rank and the loss divided by the world size. So the non-finite
  /// check and the loss averaged for the log cost no collective of their own
  /// (reduced_loss()). Only without a comm_hook: it rides on ddp's own
  /// all-reduce, flat or hierarchical.
  TORCH_ARG(bool, carry_loss) = false;
};

/// While alive, backward passes only accumulate gradients locally; the next
/// backward outside it all-reduces the accumulated sum (gradient
/// accumulation without communicating every micro-batch). Made by
/// DistributedDataParallel::no_sync().
class DDP_API NoSyncGuard {
 public:
  /// Turns synchronisation off on `runtime` until the guard is destroyed.
  explicit NoSyncGuard(detail::DdpRuntime& runtime);
  NoSyncGuard(NoSyncGuard&& other) noexcept : runtime_(other.runtime_), previous_(other.previous_) {
    other.runtime_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  detail::DdpRuntime* runtime_;
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
DDP_API void collect_tensors(const c10::IValue& value, std::vector<at::Tensor>& out);
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
/// before each forward the buffer broadcast, the bucket reducer (internal,
/// src/engine/bucket_reducer.h) with the hooks composed from DDPOptions, and Join's
/// shadow step. DistributedDataParallel<ModuleType> holds it by value and
/// calls it inline, so it is declared here.
class DDP_API DdpRuntime {
 public:
  DdpRuntime(std::shared_ptr<ModuleTensors> module, std::shared_ptr<ProcessGroup> group, DDPOptions options);
  ~DdpRuntime();
  DdpRuntime(const DdpRuntime&) = delete;
  DdpRuntime& operator=(const DdpRuntime&) = delete;
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);
  /// One training step of the others, mirrored by a rank without data.
  void shadow_step();
  /// DDPOptions::carry_loss: see DistributedDataParallel::note_loss.
  void note_loss(const at::Tensor& loss);
  const ReducedLoss& reduced_loss() const;
  /// See DistributedDataParallel::step_in_backward; null stops it.
  void step_in_backward(torch::optim::Optimizer* optimizer);
  torch::optim::Optimizer* optimizer_in_backward() const { return optimizer_in_backward_; }
  const ModuleTensors& tensors() const { return *module_; }
  bool wants_outputs() const { return options_.find_unused_parameters(); }
  void set_require_sync(bool require_sync);
  bool require_sync() const;
  const std::vector<std::vector<size_t>>& bucket_assignment() const;
  double bucket_cap_mb() const;
  bool buckets_rebuilt() const;
  const at::Tensor& bucket_buffer(size_t index) const;
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  std::shared_ptr<ModuleTensors> module_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  bool has_buffers_ = false;
  // options_.comm_hook(), or ddp's own choice (the hierarchical all-reduce)
  // when that is null; null: the plain all-reduce.
  std::shared_ptr<CommHook> comm_hook_;
  std::shared_ptr<LossRiderHook> rider_;  // carry_loss
  torch::optim::Optimizer* optimizer_in_backward_ = nullptr;
  std::unique_ptr<BucketReducer> reducer_;
};

/// Rank 0 loads `path` into `module`; then its values go to every rank.
DDP_API void load_on_root_and_broadcast(const ModuleTensors& module, ProcessGroup& group, const std::string& path);
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
class DDP_API Join {
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
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(runtime_); }

  /// With DDPOptions().carry_loss(true): this rank's `loss` rides on the next
  /// backward's gradient all-reduce, so that afterwards every rank knows,
  /// with no collective of its own, which ranks had a non-finite loss and
  /// the loss averaged over ranks (reduced_loss(); check it with
  /// ddp::check_loss_is_finite(model.reduced_loss(), policy, where)).
  void note_loss(const at::Tensor& loss) { runtime_.note_loss(loss); }
  /// What the last synchronised backward carried (see note_loss).
  const ReducedLoss& reduced_loss() const { return runtime_.reduced_loss(); }

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
  /// Per parameter the update is exactly optimizer.step()'s after backward,
  /// since LibTorch's optimizers keep their state per parameter; no_sync()
  /// passes still only accumulate. Every parameter of `optimizer` must be
  /// this model's. Not with carry_loss, nor with LBFGS, nor with anything
  /// that must see every gradient before the step: GradScaler::step(optimizer,
  /// model) refuses such a model, and so does ddp::clip_grad_norm_.
  /// `optimizer` must outlive the model, or stop_stepping_in_backward() first.
  void step_in_backward(torch::optim::Optimizer& optimizer) { runtime_.step_in_backward(&optimizer); }
  /// Back to stepping the optimizer yourself after backward.
  void stop_stepping_in_backward() { runtime_.step_in_backward(nullptr); }
  /// Whether backward steps an optimizer (step_in_backward): its gradients
  /// are then used before backward returns.
  bool steps_optimizer_in_backward() const { return runtime_.optimizer_in_backward() != nullptr; }

  /// Uneven data across ranks: see Join.
  Join join() { return Join(runtime_, *runtime_.group()); }

  /// Parameter indices (in parameters()' order) of each gradient bucket, in
  /// launch order.
  const std::vector<std::vector<size_t>>& bucket_assignment() const { return runtime_.bucket_assignment(); }
  /// Whether the buckets were regrouped after the first iteration.
  bool buckets_rebuilt() const { return runtime_.buckets_rebuilt(); }
  /// The cap of every bucket after the first, in MiB: DDPOptions's
  /// bucket_cap_mb when set; otherwise 25 until the first iteration ends,
  /// then the cap fitted to the link.
  double bucket_cap_mb() const { return runtime_.bucket_cap_mb(); }
  /// The flat gradient buffer of bucket `index`, for inspection.
  const at::Tensor& bucket_buffer(size_t index) const { return runtime_.bucket_buffer(index); }
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
