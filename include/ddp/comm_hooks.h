#pragma once

// Communication hooks decide how one bucket of gradients is reduced across
// ranks. The engine hands each full bucket to the hook, already divided by
// the world size (PyTorch divides before summing too: a sum of averages
// cannot overflow where a sum of gradients might), and later waits on the
// future the hook returns; its value is the sum over ranks, i.e. the average
// gradient.
//
//   ddp::DDPOptions().comm_hook(ddp::fp16_compress_hook())

#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

namespace ddp {

/// One bucket's gradients, flattened into one tensor.
class GradBucket {
 public:
  /// Bucket `index` (launch order) over `buffer`; `is_last` for the final one.
  GradBucket(size_t index, at::Tensor buffer, bool is_last)
      : index_(index), buffer_(std::move(buffer)), is_last_(is_last) {}
  /// Position of the bucket in launch order.
  size_t index() const { return index_; }
  /// This rank's gradients, flattened and divided by the world size; a hook
  /// may reduce it in place.
  at::Tensor& buffer() { return buffer_; }
  /// Whether this is the last bucket of the backward pass.
  bool is_last() const { return is_last_; }

 private:
  size_t index_;
  at::Tensor buffer_;
  bool is_last_;
};

/// Reduces buckets across ranks. Implementations must issue the same
/// collectives in the same order on every rank.
class CommHook {
 public:
  virtual ~CommHook() = default;
  /// Starts reducing `bucket` and returns a future whose value is a tensor
  /// of the buffer's shape and dtype holding the sum over all ranks.
  virtual c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) = 0;
};

/// The default: all-reduce (sum) in place.
std::shared_ptr<CommHook> allreduce_hook();
/// Casts the bucket to float16 for the all-reduce, halving the bytes sent,
/// and back to the gradients' dtype afterwards.
std::shared_ptr<CommHook> fp16_compress_hook();
/// The same with bfloat16: fewer mantissa bits, float32's range.
std::shared_ptr<CommHook> bf16_compress_hook();

}  // namespace ddp
