#include <ddp/comm_hooks.h>

#include <ATen/Functions.h>

namespace ddp {
namespace {

class AllreduceHook : public CommHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
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
    at::Tensor buffer = bucket.buffer();
    auto future = group.all_reduce_async(compressed)->getFuture();
    return future->then(
        [compressed, buffer](c10::ivalue::Future& done) -> c10::IValue {
          done.value();  // rethrows the collective's error, if any
          buffer.copy_(compressed);
          return buffer;
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
