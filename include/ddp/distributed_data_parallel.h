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
#include <utility>

namespace ddp {

/// Options for DistributedDataParallel; the defaults are PyTorch's.
///
///   ddp::DDPOptions().bucket_cap_mb(50).broadcast_buffers(false)
struct DDPOptions {
  /// Cap of every gradient bucket after the first, in MiB.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Cap of the first bucket, in MiB.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Copy rank 0's buffers (BatchNorm statistics, say) to every rank before
  /// each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
};

namespace detail {

/// Checks that every rank's module has the same parameters and buffers
/// (names, shapes, dtypes, in order). On a mismatch every rank throws an
/// error naming the first differing tensor and the ranks involved.
void verify_replicas_match(const torch::nn::Module& module, ProcessGroup& group);

/// Copies rank 0's parameters and/or buffers to every rank.
void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, bool parameters,
                            bool buffers);

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

/// Wraps a module (a ModuleHolder such as torch::nn::Sequential or a
/// TORCH_MODULE, or a std::shared_ptr to a Module subclass) for data-parallel
/// training over `group`.
template <typename ModuleType>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleType module, std::shared_ptr<ProcessGroup> group,
                          DDPOptions options = {})
      : module_(std::move(module)),
        core_(detail::as_module_ptr(module_), std::move(group), options) {}

  /// Runs the wrapped module's forward. Call this rather than the module's
  /// own forward, so buffers are synchronised first.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    core_.before_forward();
    return module_->forward(std::forward<Args>(args)...);
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

  const GradientReducer& reducer() const { return core_.reducer(); }
  const std::shared_ptr<ProcessGroup>& process_group() const { return core_.group(); }

 private:
  ModuleType module_;
  detail::DataParallelCore core_;
};

}  // namespace ddp
