#include <ddp/comm_hooks.h>

#include <ddp/error.h>

#include <ATen/Functions.h>

#include <utility>
#include <vector>

namespace ddp {
namespace {

class AllreduceHook : public CommHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
    if (bucket.scatters()) return group.reduce_scatter_async(bucket.shard(), bucket.buffer())->getFuture();
    return group.all_reduce_async(bucket.buffer())->getFuture();
  }
};

// PyTorch's fp16_compress_wrapper for any dtype and any inner hook. Nothing
// here assumes the CPU. On CUDA the cast is queued on the current stream
// before the inner hook's collectives (which NCCL's stream waits for), and
// the decompression runs in then(), whose CUDA futures order it after them
// by events, without blocking the host.
class CompressHook : public CommHook {
 public:
  CompressHook(at::ScalarType dtype, std::shared_ptr<CommHook> inner) : dtype_(dtype), inner_(std::move(inner)) {
    DDP_CHECK(inner_, "ddp: compress_hook needs an inner hook to run on the compressed bucket; pass allreduce_hook() "
              "for a plain all-reduce");
  }

  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
    at::Tensor compressed = bucket.buffer().to(dtype_);
    // The result goes back into the bucket, or into the shard when the
    // bucket is reduce-scattered: only this rank's part comes back.
    at::Tensor result = bucket.scatters() ? bucket.shard() : bucket.buffer();
    at::Tensor compressed_shard = bucket.scatters() ? at::empty(result.sizes(), compressed.options()) : at::Tensor();
    // Hooks that work per parameter (PowerSGD) see the compressed gradients.
    std::vector<at::Tensor> gradients;
    for (const at::Tensor& g : bucket.gradients()) {
      gradients.push_back(
          compressed.narrow(0, g.storage_offset() - bucket.buffer().storage_offset(), g.numel()).view(g.sizes()));
    }
    GradBucket narrow(bucket.index(), compressed, bucket.is_last(), compressed_shard,
                      bucket.gradients().empty() ? nullptr : &gradients, &bucket.parameters());
    return inner_->run(group, narrow)->then(
        [compressed, compressed_shard, result](c10::ivalue::Future& done) -> c10::IValue {
          const c10::IValue& value = done.value();  // rethrows the inner hook's error, if any
          const at::Tensor reduced = value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
          result.copy_(reduced.view_as(result));
          return result;
        },
        c10::TensorType::get());
  }

 private:
  at::ScalarType dtype_;
  std::shared_ptr<CommHook> inner_;
};

}  // namespace

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllreduceHook>(); }
std::shared_ptr<CommHook> compress_hook(at::ScalarType dtype, std::shared_ptr<CommHook> inner) {
  return std::make_shared<CompressHook>(dtype, std::move(inner));
}
std::shared_ptr<CommHook> fp16_compress_hook() { return compress_hook(at::kHalf); }
std::shared_ptr<CommHook> bf16_compress_hook() { return compress_hook(at::kBFloat16); }

}  // namespace ddp
