#pragma once

// Communication hooks decide how one bucket of gradients is reduced across
// ranks. The engine hands each full bucket to the hook, already divided by
// the world size (PyTorch divides before summing too: a sum of averages
// cannot overflow where a sum of gradients might), and later waits on the
// future the hook returns; its value is the sum over ranks, i.e. the average
// gradient.
//
//   ddp::DDPOptions().comm_hook(ddp::fp16_compress_hook())

#include <ddp/export.h>
#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace ddp {

/// One bucket's gradients, flattened into one tensor: a DDP bucket, or one
/// FSDP unit's flat gradient.
class GradBucket {
 public:
  /// Bucket `index` (launch order) over `buffer`; `is_last` for the final one.
  /// With a defined `shard`, the bucket is reduce-scattered: rank r's sum is
  /// the r-th of size() equal parts of `buffer`, and it goes into `shard`.
  /// `gradients`, when given, are views of `buffer` in each parameter's
  /// shape (what PowerSGD compresses), and `parameters` the parameters they
  /// belong to, in the same order; the engine keeps both, so they are
  /// borrowed, not copied, and valid while the hook's run() runs.
  GradBucket(size_t index, at::Tensor buffer, bool is_last, at::Tensor shard = {},
             const std::vector<at::Tensor>* gradients = nullptr, const std::vector<at::Tensor>* parameters = nullptr)
      : index_(index),
        buffer_(std::move(buffer)),
        shard_(std::move(shard)),
        gradients_(gradients),
        parameters_(parameters),
        is_last_(is_last) {}
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
  /// Each parameter's gradient as a view of buffer(), in its own shape (DDP's
  /// buckets; empty where the engine has no per-parameter layout).
  const std::vector<at::Tensor>& gradients() const {
    static const std::vector<at::Tensor> none;
    return gradients_ ? *gradients_ : none;
  }
  /// The parameters whose gradients the bucket holds, in gradients()' order
  /// (DDP's buckets): what a continuation that steps an optimizer over the
  /// bucket updates. Empty where nothing may be updated (Join's shadow pass
  /// over zeros) or the engine does not say (FSDP).
  const std::vector<at::Tensor>& parameters() const {
    static const std::vector<at::Tensor> none;
    return parameters_ ? *parameters_ : none;
  }

 private:
  size_t index_;
  at::Tensor buffer_;
  at::Tensor shard_;
  const std::vector<at::Tensor>* gradients_;
  const std::vector<at::Tensor>* parameters_;
  bool is_last_;
};

/// Reduces buckets across ranks. Implementations must issue the same
/// collectives in the same order on every rank.
class DDP_API CommHook {
 public:
  virtual ~CommHook() = default;
  /// Starts reducing `bucket` and returns a future whose value is a tensor
  /// holding the sum over all ranks: of the buffer's shape and dtype, or,
  /// when bucket.scatters(), this rank's part of it, of the shard's shape and
  /// dtype (the shard itself, or a tensor the engine copies into it).
  virtual c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) = 0;
};

/// The default: all-reduce (sum) in place, or reduce-scatter into the shard.
DDP_API std::shared_ptr<CommHook> allreduce_hook();
/// A decorator (PyTorch's fp16_compress_wrapper, for any dtype): casts the
/// bucket (its buffer, and its shard when it scatters) to `dtype`, lets
/// `inner` reduce that, and casts the result back into the bucket's dtype.
/// The bytes on the wire are `dtype`'s whatever `inner` sends.
///
///   ddp::DDPOptions().comm_hook(ddp::compress_hook(at::kHalf, ddp::powersgd_hook()))
DDP_API std::shared_ptr<CommHook> compress_hook(at::ScalarType dtype,
                                                std::shared_ptr<CommHook> inner = allreduce_hook());
/// compress_hook(at::kHalf): half the bytes of float32.
DDP_API std::shared_ptr<CommHook> fp16_compress_hook();
/// compress_hook(at::kBFloat16): fewer mantissa bits, float32's range.
DDP_API std::shared_ptr<CommHook> bf16_compress_hook();

class DeviceMesh;
/// Hierarchical all-reduce for DDP (Horovod's, and NCCL's trees, in spirit):
/// each bucket is reduced to the first rank of its node, all-reduced between
/// those node leaders, and broadcast back within the node, so only one copy
/// per node crosses the links between nodes. `mesh` is
/// DeviceMesh::from_launcher(group) (or any 2-D mesh whose second dimension
/// holds each node's ranks) over DDP's own group. The three steps run in
/// order on a thread of the hook's own, so buckets still overlap backward.
/// The result equals the flat all-reduce's within float rounding (the sum is
/// taken in another order). DDP with no comm hook takes this path by itself
/// when its Gloo group spans hosts with several ranks on one, grouping the
/// ranks by host (DDPOptions::hierarchical_allreduce, DDP_HIERARCHICAL=0).
///
///   auto mesh = ddp::DeviceMesh::from_launcher(group);
///   ddp::DistributedDataParallel model(
///       net, group, ddp::DDPOptions().comm_hook(ddp::hierarchical_allreduce_hook(mesh)));
DDP_API std::shared_ptr<CommHook> hierarchical_allreduce_hook(const DeviceMesh& mesh);

/// PowerSGD (Vogels et al., 2019) with the options of PyTorch's
/// powerSGD_hook (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook).
///
///   auto hook = ddp::powersgd_hook(ddp::PowerSGDOptions().matrix_approximation_rank(4).start_powerSGD_iter(10));
///   ddp::DistributedDataParallel model(net, group, ddp::DDPOptions().comm_hook(hook));
struct PowerSGDOptions {
  /// r: each gradient matrix (n x m, a parameter's gradient viewed as
  /// shape[0] rows) is sent as an n x r and an m x r matrix.
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  /// Backward passes reduced by a plain all-reduce before compressing: the
  /// warm-up that PyTorch's paper and docs recommend (at least 2 with error
  /// feedback or warm start, so that DDP's bucket rebuild happens first).
  TORCH_ARG(int64_t, start_powerSGD_iter) = 1000;
  /// A matrix is compressed only if (n + m) * r * this < n * m; smaller
  /// ones, and every 1-D gradient (biases), go uncompressed.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  /// Adds what compression lost last time to this time's gradient.
  TORCH_ARG(bool, use_error_feedback) = true;
  /// Starts each step's power iteration from the previous step's Q.
  TORCH_ARG(bool, warm_start) = true;
  /// Added to each column's norm when orthogonalising; 0 uses a QR
  /// factorisation.
  TORCH_ARG(double, orthogonalization_epsilon) = 0.0;
  /// Seeds the random initial Q, the same on every rank.
  TORCH_ARG(uint64_t, random_seed) = 0;
  /// PyTorch's batched_powerSGD_hook: the whole bucket as one square matrix
  /// (fewer, larger matrix products; less accurate for the same rank).
  TORCH_ARG(bool, batched) = false;
};

/// PowerSGD as a CommHook, for DDP (not FSDP's reduce-scatter). A bucket's
/// three collectives (uncompressed gradients, P, Q) depend on each other, so
/// they run one after the other on a thread of the hook's own, over a copy of
/// DDP's group that the hook makes at its first compressed bucket, while
/// backward goes on. One hook serves one DDP model.
class DDP_API PowerSGDHook : public CommHook {
 public:
  explicit PowerSGDHook(PowerSGDOptions options);
  ~PowerSGDHook() override;
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override;
  /// Elements the compressed steps would have sent uncompressed, and those
  /// they sent, over every bucket since compression started (warm-up not
  /// counted, as PyTorch's PowerSGDState.compression_stats()): the
  /// compression ratio is the first over the second.
  std::pair<int64_t, int64_t> compression_stats() const;
  const PowerSGDOptions& options() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

DDP_API std::shared_ptr<PowerSGDHook> powersgd_hook(PowerSGDOptions options = {});

}  // namespace ddp
