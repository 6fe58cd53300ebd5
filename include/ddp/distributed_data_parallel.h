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

#include <ddp/gradient_reducer.h>
#include <ddp/process_group.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace ddp {

/// Options for DistributedDataParallel; the defaults are PyTorch's.
///
///   ddp::DDPOptions().bucket_cap_mb(50).find_unused_parameters(true)
struct DDPOptions {
  /// Cap of every gradient bucket after the first, in MiB.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Cap of the first bucket, in MiB.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Copy rank 0's buffers (BatchNorm statistics, say) to every rank before
  /// each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Allow parameters that take no part in some forward passes.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Make each .grad a view into its communication bucket (less memory, no
  /// copies).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Regroup buckets once, after the first iteration, in the order gradients
  /// became ready.
  TORCH_ARG(bool, rebuild_buckets) = true;
  /// Reduce buckets while backward runs; off only to measure the benefit.
  TORCH_ARG(bool, overlap_with_backward) = true;
  /// How buckets are reduced: allreduce_hook() (null), fp16_compress_hook(),
  /// bf16_compress_hook() or your own CommHook.
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;

 public:
  /// The engine's share of these options.
  ReducerOptions reducer_options() const {
    return ReducerOptions()
        .bucket_cap_mb(bucket_cap_mb_)
        .first_bucket_cap_mb(first_bucket_cap_mb_)
        .find_unused_parameters(find_unused_parameters_)
        .gradient_as_bucket_view(gradient_as_bucket_view_)
        .rebuild_buckets(rebuild_buckets_)
        .overlap_with_backward(overlap_with_backward_)
        .comm_hook(comm_hook_);
  }
};

/// While alive, backward passes only accumulate gradients locally; the next
/// backward outside it all-reduces the accumulated sum (gradient
/// accumulation without communicating every micro-batch).
class NoSyncGuard {
 public:
  /// Turns synchronisation off on `reducer` until the guard is destroyed.
  explicit NoSyncGuard(GradientReducer& reducer) : reducer_(&reducer), previous_(reducer.require_sync()) {
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
  GradientReducer* reducer_;
  bool previous_;
};

namespace detail {

/// Checks that every rank's module has the same parameters and buffers
/// (names, shapes, dtypes, in order). On a mismatch every rank throws an
/// error naming the first differing tensor and the ranks involved.
void verify_replicas_match(const torch::nn::Module& module, ProcessGroup& group);

/// Copies `root`'s parameters and/or buffers to every rank.
void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, bool parameters,
                            bool buffers, int root = 0);

// The tensors of a forward's result, for finding unused parameters early.
// Results of other types yield none; unused parameters are then found at
// the end of backward, and their buckets start last.
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
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

/// The part of DistributedDataParallel that does not depend on the module's
/// type.
class DataParallelCore {
 public:
  DataParallelCore(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                   DDPOptions options);
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);
  /// One training step of the others, mirrored by a rank without data.
  void shadow_step();
  torch::nn::Module& module() { return *module_; }
  bool wants_outputs() const { return options_.find_unused_parameters(); }
  GradientReducer& reducer() { return *reducer_; }
  const GradientReducer& reducer() const { return *reducer_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  bool has_buffers_ = false;
  std::unique_ptr<GradientReducer> reducer_;
};

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
  Join(detail::DataParallelCore& core, ProcessGroup& group) : core_(core), group_(group) {}
  /// Call once per training step, before the forward. Returns the number of
  /// ranks still training.
  int step();
  /// Call once this rank is out of data; returns when every rank is.
  void finish();
  int64_t steps() const { return steps_; }
  int64_t shadowed_steps() const { return shadowed_; }

 private:
  detail::DataParallelCore& core_;
  ProcessGroup& group_;
  int64_t steps_ = 0;
  int64_t shadowed_ = 0;
  bool finished_ = false;
};

/// Wraps a module (a ModuleHolder such as torch::nn::Sequential or a
/// TORCH_MODULE, or a std::shared_ptr to a Module subclass) for data-parallel
/// training over `group`.
template <typename ModuleType>
class DistributedDataParallel {
 public:
  /// Checks that every rank built the same model, copies rank 0's weights
  /// and buffers to all ranks, and attaches the gradient engine. Collective.
  DistributedDataParallel(ModuleType module, std::shared_ptr<ProcessGroup> group,
                          DDPOptions options = {})
      : module_(std::move(module)),
        core_(detail::as_module_ptr(module_), std::move(group), options) {}

  /// Runs the wrapped module's forward. Call this rather than the module's
  /// own forward, so buffers are synchronised first.
  template <typename... Args>
  auto forward(Args&&... args) {
    core_.before_forward();
    auto result = module_->forward(std::forward<Args>(args)...);
    if (core_.wants_outputs()) {
      std::vector<at::Tensor> outputs;
      detail::collect_tensors(result, outputs);
      core_.after_forward(outputs);
    }
    return result;
  }

  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// The wrapped module, e.g. for parameters(), state_dict-style saving, or
  /// evaluation without synchronisation.
  ModuleType& module() { return module_; }
  const ModuleType& module() const { return module_; }
  auto operator->() { return &*module_; }
  auto operator->() const { return &*module_; }

  /// Skip gradient synchronisation inside a scope:
  ///
  ///   { auto guard = model.no_sync(); loss_of(micro_batch_1).backward(); }
  ///   loss_of(micro_batch_2).backward();  // all-reduces the sum of both
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(core_.reducer()); }

  /// Uneven data across ranks: see Join.
  Join join() { return Join(core_, *core_.group()); }

  const GradientReducer& reducer() const { return core_.reducer(); }
  const std::shared_ptr<ProcessGroup>& process_group() const { return core_.group(); }

 private:
  ModuleType module_;
  detail::DataParallelCore core_;
};

}  // namespace ddp
