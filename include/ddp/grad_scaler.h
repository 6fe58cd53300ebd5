#pragma once

// Loss scaling for float16 training, with torch.amp.GradScaler's semantics
// and defaults. Small float16 gradients underflow to zero; multiplying the
// loss by a large factor before backward keeps them representable, and the
// gradients are divided by the same factor before the optimizer step. When
// the factor was too large, some gradient overflows to inf or NaN: the step
// is skipped and the factor halved; after growth_interval clean steps in a
// row it is doubled.
//
//   ddp::GradScaler scaler(ddp::GradScalerOptions(), group);  // group: skip together
//   for (...) {
//     optimizer.zero_grad();
//     at::Tensor loss;
//     {
//       ddp::AutocastGuard autocast(at::kCUDA, at::kHalf);
//       loss = loss_fn(model.forward(x), y);
//     }
//     scaler.scale(loss).backward();
//     scaler.step(optimizer);   // unscales, skips the step if any rank saw inf/NaN
//     scaler.update();          // backs off or grows the scale
//   }
//
// With a DistributedDataParallel model, scaler.step(optimizer, model) also
// refuses a model that steps its optimizer inside backward
// (step_in_backward), whose step could not be skipped.
//
// Differences from Python's: float16 gradients may be unscaled (Python's
// GradScaler refuses them; its ShardedGradScaler allows them, as here), and
// with a process group the inf/NaN flag is all-reduced (MAX) in unscale_(),
// so every rank skips the same steps even when only one rank's local
// gradients overflowed.

#include <ddp/export.h>
#include <ddp/process_group.h>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

namespace torch::optim {
class Optimizer;
}

namespace ddp {

template <typename ModuleType>
class DistributedDataParallel;

/// Options for GradScaler; the defaults are torch.amp.GradScaler's.
///
///   ddp::GradScalerOptions().init_scale(1024).growth_interval(100)
struct GradScalerOptions {
  /// The scale before the first step.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Multiplies the scale after growth_interval steps without inf/NaN; > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Multiplies the scale after a step with inf/NaN; in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps in a row before the scale grows; > 0.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Off, every method is a pass-through (scale(x) is x, step() steps), so
  /// one training loop serves float32 and float16 runs.
  TORCH_ARG(bool, enabled) = true;
};

/// Scales losses and unscales gradients; see the top of this header. All
/// state lives in tensors on the loss's device, so nothing synchronises the
/// host with the GPU except step()'s one read of the inf flag.
class DDP_API GradScaler {
 public:
  /// `group`, if given, makes the skip decision collective: unscale_() and
  /// step() must then be called in the same order on every rank.
  explicit GradScaler(GradScalerOptions options = {}, std::shared_ptr<ProcessGroup> group = nullptr);

  /// `outputs` (usually the loss) times the current scale. The scale is
  /// created on `outputs`' device at the first call.
  at::Tensor scale(const at::Tensor& outputs);

  /// Divides the gradients of `optimizer`'s parameters by the scale, in
  /// place, and records whether any is inf or NaN (on any rank, with a
  /// group). At most once per optimizer between update()s; call it before
  /// clipping gradients. step() calls it if you did not.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales if needed, then runs optimizer.step() unless an inf/NaN was
  /// found. Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);

  /// unscale_() and step() for the optimizer of a DDP model: the same, after
  /// refusing a model that steps its optimizer inside backward
  /// (step_in_backward), which used the gradients before they could be
  /// unscaled or an inf/NaN step skipped.
  template <typename M>
  void unscale_(torch::optim::Optimizer& optimizer, const DistributedDataParallel<M>& model) {
    refuse_if_stepped_in_backward(model.steps_optimizer_in_backward(), "unscale_");
    unscale_(optimizer);
  }
  template <typename M>
  bool step(torch::optim::Optimizer& optimizer, const DistributedDataParallel<M>& model) {
    refuse_if_stepped_in_backward(model.steps_optimizer_in_backward(), "step");
    return step(optimizer);
  }

  /// Ends the iteration: halves the scale (backoff_factor) if any
  /// optimizer's step found inf/NaN, else counts a clean step and grows the
  /// scale after growth_interval of them.
  void update();
  /// Ends the iteration with the scale set to `new_scale`.
  void update(double new_scale);

  /// The current scale (init_scale before the first scale()); 1 when
  /// disabled. Reads the GPU, so it synchronises: for logging, not per step.
  double get_scale() const;
  /// Clean steps since the last backoff or growth.
  int64_t get_growth_tracker() const;
  double get_growth_factor() const { return options_.growth_factor(); }
  double get_backoff_factor() const { return options_.backoff_factor(); }
  int64_t get_growth_interval() const { return options_.growth_interval(); }
  bool is_enabled() const { return options_.enabled(); }

  /// Python's keys and types: scale (float), growth_factor (float),
  /// backoff_factor (float), growth_interval (int), _growth_tracker (int);
  /// empty when disabled. ddp::save_value (checkpoint.h) writes it so that
  /// Python's torch.load + GradScaler.load_state_dict read it.
  c10::impl::GenericDict state_dict() const;
  /// Restores a state_dict() (ours or Python's). No-op when disabled.
  void load_state_dict(const c10::impl::GenericDict& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    at::Tensor found_inf;  // float32 0-dim on the scale's device; > 0: skip
  };

  void check_initialized(const char* caller) const;
  static void refuse_if_stepped_in_backward(bool stepped_in_backward, const char* method);

  GradScalerOptions options_;
  std::shared_ptr<ProcessGroup> group_;
  at::Tensor scale_;           // float32 0-dim, created by the first scale()
  at::Tensor growth_tracker_;  // int32 0-dim, beside scale_
  int64_t init_growth_tracker_ = 0;
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

}  // namespace ddp
