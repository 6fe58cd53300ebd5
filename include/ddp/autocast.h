#pragma once

// Mixed-precision forward passes: inside an AutocastGuard, eligible ops
// (matmuls, convolutions, linear layers) run in a lower precision and
// precision-sensitive ones (softmax, losses, norms) in float32, as under
// Python's `with torch.autocast(device_type, dtype)`.
//
//   {
//     ddp::AutocastGuard autocast(at::kCUDA, at::kBFloat16);
//     loss = loss_fn(model.forward(x), y);   // matmuls in bfloat16
//   }
//   loss.backward();                         // outside, as in Python
//
// bfloat16 has float32's range, so it needs no GradScaler; float16 does.

#include <ddp/error.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace ddp {

/// Turns autocast on for `device_type` with `dtype` for its lifetime and
/// restores the previous state after; nests like Python's torch.autocast.
/// Not movable: it restores thread-local state on the thread that made it.
class AutocastGuard {
 public:
  /// `enabled` false makes a guard that turns autocast off inside it.
  AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled = true)
      : device_type_(device_type),
        previous_enabled_(at::autocast::is_autocast_enabled(device_type)),
        previous_dtype_(at::autocast::get_autocast_dtype(device_type)),
        previous_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {
    DDP_CHECK(at::autocast::is_autocast_available(device_type), "ddp: autocast is not available for ",
                c10::DeviceTypeName(device_type), "; use cpu or cuda");
    at::autocast::set_autocast_enabled(device_type, enabled);
    at::autocast::set_autocast_dtype(device_type, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    // The cache of casted weights lives until the outermost guard exits,
    // as in Python; it would otherwise hold a lower-precision copy of every
    // weight between steps.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
    at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
    at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_enabled_;
};

}  // namespace ddp
