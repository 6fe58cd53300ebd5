#include <ddp/comm_hooks.h>

#include <ATen/Functions.h>

namespace ddp {
namespace {

class AllreduceHook : public CommHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
    if (bucket.scatters()) return group.reduce_scatter_async(bucket.shard(), bucket.buffer())->getFuture();
    return group.all_reduce_async(bucket.buffer())->getFuture();
  }
};

class CompressHook : public CommHook {
 public:
  explicit CompressHook(at::ScalarType wire_dtype) : wire_dtype_(wire_dtype) {}

  // Nothing here assumes the CPU. On CUDA the cast is queued on the current
  // stream before the collective (which NCCL's stream waits for), and the
  // decompression runs in then(), whose CUDA futures order it after the
  // collective by events, without blocking the host.
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
    at::Tensor compressed = bucket.buffer().to(wire_dtype_);
    // The result goes back into the bucket, or into the shard when the
    // bucket is reduce-scattered: only this rank's part is sent back.
    at::Tensor result = bucket.scatters() ? bucket.shard() : bucket.buffer();
    at::Tensor received = compressed;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    if (bucket.scatters()) {
      received = at::empty({result.numel()}, compressed.options());
      future = group.reduce_scatter_async(received, compressed)->getFuture();
    } else {
      future = group.all_reduce_async(compressed)->getFuture();
    }
    return future->then(
        [compressed, received, result](c10::ivalue::Future& done) -> c10::IValue {
          done.value();  // rethrows the collective's error, if any
          result.copy_(received.view_as(result));
          return result;
        },
        c10::TensorType::get());
  }

 private:
  at::ScalarType wire_dtype_;
};

}  // namespace

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllreduceHook>(); }
std::shared_ptr<CommHook> fp16_compress_hook() { return std::make_shared<CompressHook>(at::kHalf); }
std::shared_ptr<CommHook> bf16_compress_hook() { return std::make_shared<CompressHook>(at::kBFloat16); }

}  // namespace ddp
