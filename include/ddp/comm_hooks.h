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

/// One bucket's gradients, flattened into one tensor: a DDP bucket, or one
/// FSDP unit's flat gradient.
class GradBucket {
 public:
  /// Bucket `index` (launch order) over `buffer`; `is_last` for the final one.
  /// With a defined `shard`, the bucket is reduce-scattered: rank r's sum is
  /// the r-th of size() equal parts of `buffer`, and it goes into `shard`.
  GradBucket(size_t index, at::Tensor buffer, bool is_last, at::Tensor shard = {})
      : index_(index), buffer_(std::move(buffer)), shard_(std::move(shard)), is_last_(is_last) {}
  /// Position of the bucket in launch order.
  size_t index() const { return index_; }
  /// This rank's gradients, flattened and divided by the world size; a hook
  /// may reduce it in place.
  at::Tensor& buffer() { return buffer_; }
  /// Whether the bucket is reduce-scattered into shard() (FSDP's sharded
  /// strategies) rather than all-reduced in place (DDP, FSDP's kNoShard).
  bool scatters() const { return shard_.defined(); }
  /// Where this rank's part of the sum goes when scatters(): buffer().numel()
  /// / world size elements, in the dtype the engine wants the result in.
  at::Tensor& shard() { return shard_; }
  /// Whether this is the last bucket of the backward pass.
  bool is_last() const { return is_last_; }

 private:
  size_t index_;
  at::Tensor buffer_;
  at::Tensor shard_;
  bool is_last_;
};

/// Reduces buckets across ranks. Implementations must issue the same
/// collectives in the same order on every rank.
class CommHook {
 public:
  virtual ~CommHook() = default;
  /// Starts reducing `bucket` and returns a future whose value is a tensor
  /// holding the sum over all ranks: of the buffer's shape and dtype, or,
  /// when bucket.scatters(), this rank's part of it, of the shard's shape and
  /// dtype (the shard itself, or a tensor the engine copies into it).
  virtual c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) = 0;
};

/// The default: all-reduce (sum) in place, or reduce-scatter into the shard.
std::shared_ptr<CommHook> allreduce_hook();
/// Casts the bucket to float16 for the all-reduce (or reduce-scatter),
/// halving the bytes sent, and back to the gradients' dtype afterwards.
std::shared_ptr<CommHook> fp16_compress_hook();
/// The same with bfloat16: fewer mantissa bits, float32's range.
std::shared_ptr<CommHook> bf16_compress_hook();

}  // namespace ddp
