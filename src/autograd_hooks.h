#pragma once

// Hooks on autograd's gradient accumulators, shared by DDP's and FSDP's
// engines.

#include <torch/csrc/autograd/function_hook.h>

#include <functional>
#include <utility>

namespace ddp::detail {

// Runs a callback after a parameter's gradient has been accumulated into
// .grad, i.e. when the gradient is final for this backward pass.
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

}  // namespace ddp::detail
