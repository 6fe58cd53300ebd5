#pragma once

// Training over slow links: replicas that synchronise every H steps instead
// of every step. DiLoCo (Douillard et al., 2023), its streaming variant
// (Douillard et al., 2025) and post-local SGD are one composition over a
// ProcessGroup (the cross-node, "outer" dimension), wrapped around the
// user's own optimizer (the "inner" one, stepping the local model):
//
//   auto group = ddp::init_process_group();
//   auto model = Net();                               // or a DDP/FSDP module on a node's group
//   torch::optim::AdamW inner(model->parameters(), 1e-3);
//   ddp::DiLoCo diloco(model->parameters(), inner, group, ddp::DiLoCoOptions().sync_every(100));
//   for (...) {
//     inner.zero_grad();
//     loss_fn(model->forward(x), y).backward();
//     diloco.step();                                  // inner.step(), and every H steps the outer step
//   }
//
// Every H inner steps the replicas average the pseudo-gradient (global
// weights minus local weights) with one all-reduce of a flat buffer, the
// outer optimizer (SGD, Nesterov momentum 0.9, lr 0.7 by default, as the
// paper) applies it to the global copy, and the local model is reset to the
// new global weights. Construction copies rank 0's weights to every replica.
//
// Streaming DiLoCo: fragments(F) splits the parameters, in order, into F
// fragments of about equal bytes (or pass them yourself); fragment p is
// synchronised at steps t with t mod H == (p + 1) * H / F mod H, so the F
// syncs of a period are staggered. overlap_steps(τ) issues a fragment's
// all-reduce asynchronously at step t and completes it at step t + τ, while
// the inner steps go on; mixing(α) then sets the fragment's local weights
// to α·local + (1 − α)·global. outer_gradient_dtype() sends pseudo-gradients
// in fp32, bf16 (all-reduced in bf16) or 8-bit with a scale per block of
// 256 values (all-gathered, summed in fp32 on each rank).
//
// Post-local SGD (PyTorch's PostLocalSGDOptimizer with post_localSGD_hook)
// is a mode, DiLoCoOptions::post_local_sgd(K, H): the outer optimizer is
// SGD with lr 1 and no momentum, for which global − mean(global − local) is
// plain model averaging, and for the first K steps step() averages the
// gradients over the group before the inner step, as DDP would. A mode
// rather than a class of its own because it is exactly this algorithm with
// one outer optimizer and a warm-up; a second class would duplicate the
// sync schedule, the checkpoint state and the checks.
//
// With DDP or FSDP inside each node on a 2-D DeviceMesh, pass the mesh's
// cross-node group (mesh.group("replicate")) here and wrap the module in
// DDP/FSDP over the node's group (mesh.group("shard")): the inner wrapper
// averages gradients within the node every step, DiLoCo the pseudo-gradients
// across nodes every H steps.
//
// Checkpoints: built over the module (DiLoCo(model, inner, group)), a
// DiLoCo job saves into a distributed checkpoint or a sharded snapshot like
// a DDP one, with the DiLoCo object in the model's place:
//
//   ddp::save_distributed_checkpoint(dir, diloco, &inner);   // collective
//   saver.save(diloco, &inner, progress);                    // <ddp/snapshot_saver.h>
//   ddp::load_newest_sharded_snapshot(dir, diloco, &inner);  // <ddp/sharded_snapshot.h>
//
// (what they hold: distributed_checkpoint.h). Or, a file per rank:
// state_dict() holds the global copy, the outer optimizer's
// state, the inner step count and any fragment sync in flight; put it in
// Snapshot::extra (<ddp/snapshot.h>) next to the model (the local weights)
// and the inner optimizer, and load_state_dict() it back after restoring
// those: the run then continues bit for bit at the same world size. Between
// syncs every replica's local weights and inner optimizer differ, so for an
// exact resume each rank saves its own snapshot (a file per rank); a snapshot
// of rank 0 alone resumes every replica from rank 0's local state.
//
// Under fault tolerance (ddprun --fault-tolerance, <ddp/fault_tolerance.h>),
// one replica per process, DiLoCo(model, inner, ft) synchronises over the
// FaultTolerance's current members instead of a fixed group, so a lost
// replica drops out of the average and the job goes on without a restart:
//
//   ddp::FaultTolerance ft;
//   torch::optim::AdamW inner(model->parameters(), 1e-3);
//   ddp::DiLoCo diloco(*model, inner, ft, ddp::DiLoCoOptions().sync_every(100));  // joins, or heals
//   while (diloco.inner_step() < total) { ...backward(); diloco.step(); }
//
// One FaultTolerance step is one round of H inner steps: start_step() at the
// round's start (in the constructor, then after each sync), no store or
// network traffic during the inner steps, and at the sync one
// FaultTolerance::all_reduce_sum of the flat fp32 pseudo-gradient, averaged
// over the step's members (all of them contributed: a joiner joins at a
// round's start), then should_commit(). The outer step is applied only on a
// committed vote, identically on every member. A sync whose quorum lost a
// member (a crash at any point of the round fails it) is skipped by every
// survivor: the global copy and the local weights stay as they are, so the
// next sync's global − local carries the skipped round's progress too
// (nothing trained is lost; the outer step just sees two rounds at once).
// A restarted replica (a new replica id) joins at a round's start and heals
// from a live member: the global copy (which becomes its local weights), the
// outer and inner optimizers' state, and the inner step and sync counters;
// buffers are not sent (DiLoCo averages parameters only). Plain DiLoCo
// only: one fragment, no overlap, no warm-up, mixing 0, fp32; no
// state_dict() or checkpoints (healing replaces them). Without faults its
// trajectory equals DiLoCo over a Gloo group of the same members bit for
// bit (the same sum, divided by the same count).

#include <ddp/export.h>
#include <ddp/process_group.h>

#include <ATen/core/ivalue.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}
namespace torch::nn {
class Module;
}

namespace ddp {

class FaultTolerance;

/// How a pseudo-gradient travels between the replicas.
enum class OuterGradientDtype {
  kFloat32,   ///< all-reduced in fp32: exact
  kBFloat16,  ///< all-reduced in bf16: half the bytes
  kInt8,      ///< 8-bit with an fp32 scale per 256 values, all-gathered: about a quarter of fp32's bytes per rank
};

/// Makes the outer optimizer over the global copy's parameters (it must
/// optimise exactly those, every one, in one or more groups).
using OuterOptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>& global_parameters)>;

/// Options of DiLoCo. Defaults: DiLoCo as the paper, H = 100, one fragment.
///
///   ddp::DiLoCoOptions().sync_every(50).fragments(4).overlap_steps(5).mixing(0.5)
///       .outer_gradient_dtype(ddp::OuterGradientDtype::kBFloat16)
struct DiLoCoOptions {
  /// Post-local SGD: gradient averaging for `warmup` steps, then plain model
  /// averaging every `period` steps (outer SGD, lr 1, no momentum).
  static DiLoCoOptions post_local_sgd(int64_t warmup, int64_t period) {
    return DiLoCoOptions().warmup_steps(warmup).sync_every(period).outer_lr(1.0).outer_momentum(0.0).outer_nesterov(
        false);
  }

  /// H: inner steps between two syncs of each fragment; at least 1.
  TORCH_ARG(int64_t, sync_every) = 100;
  /// F: fragments synchronised in turn (Streaming DiLoCo); 1 is DiLoCo.
  /// Ignored by the constructor that is given the fragments.
  TORCH_ARG(int64_t, fragments) = 1;
  /// τ: inner steps a fragment's all-reduce overlaps; 0 waits at once. Less than H.
  TORCH_ARG(int64_t, overlap_steps) = 0;
  /// α: a synced fragment's local weights become α·local + (1 − α)·global. In [0, 1].
  TORCH_ARG(double, mixing) = 0.0;
  /// How pseudo-gradients travel.
  TORCH_ARG(OuterGradientDtype, outer_gradient_dtype) = OuterGradientDtype::kFloat32;
  /// The default outer optimizer: SGD with this lr, momentum and Nesterov.
  TORCH_ARG(double, outer_lr) = 0.7;
  TORCH_ARG(double, outer_momentum) = 0.9;
  TORCH_ARG(bool, outer_nesterov) = true;
  /// Another outer optimizer, made over the global copy (replaces the three above).
  TORCH_ARG(OuterOptimizerFactory, outer_optimizer) = nullptr;
  /// Where the global copy lives (the CPU by default, whatever the model's device).
  TORCH_ARG(c10::Device, global_device) = c10::Device(c10::kCPU);
  /// Its dtype: the parameters' own when unset; at::kBFloat16 halves its memory.
  TORCH_ARG(std::optional<at::ScalarType>, global_dtype) = std::nullopt;
  /// K: the first K steps average gradients over the group before the inner
  /// step (one flat all-reduce), as DDP; outer syncs start after them.
  TORCH_ARG(int64_t, warmup_steps) = 0;
};

/// DiLoCo, Streaming DiLoCo and post-local SGD (see the top of this header).
/// Not thread-safe; every rank of the group calls step() alike.
class DDP_API DiLoCo {
 public:
  /// Over `parameters` (the local model's, in a fixed order), stepped by
  /// `inner` (which must outlive this object), synchronised over `group`,
  /// split into options.fragments() fragments. Broadcasts rank 0's
  /// parameters to every rank (collective).
  DiLoCo(std::vector<at::Tensor> parameters, torch::optim::Optimizer& inner, std::shared_ptr<ProcessGroup> group,
         DiLoCoOptions options = {});
  /// The same with the fragments given: each a list of `parameters`'
  /// tensors, every parameter in exactly one of them.
  DiLoCo(std::vector<at::Tensor> parameters, std::vector<std::vector<at::Tensor>> fragments,
         torch::optim::Optimizer& inner, std::shared_ptr<ProcessGroup> group, DiLoCoOptions options = {});
  /// Over model.parameters(), split as the first constructor does; knowing
  /// the module lets distributed checkpoints and sharded snapshots name its
  /// tensors and hold its buffers (save_distributed_checkpoint(dir, diloco,
  /// &inner), <ddp/distributed_checkpoint.h>). `model` must outlive this.
  DiLoCo(torch::nn::Module& model, torch::optim::Optimizer& inner, std::shared_ptr<ProcessGroup> group,
         DiLoCoOptions options = {});
  /// Under fault tolerance (see the top of this header): over
  /// model.parameters(), synchronised over `ft`'s current members. Calls
  /// ft.start_step() (joining the job, or healing from a live member), so
  /// make it before any other step of `ft`; `model`, `inner` and `ft` must
  /// outlive this. Do not also manage() the model or `inner` with `ft`.
  DiLoCo(torch::nn::Module& model, torch::optim::Optimizer& inner, FaultTolerance& ft, DiLoCoOptions options = {});
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  /// One inner step (after backward): the warm-up's gradient average,
  /// inner.step(), then whatever syncs fall on this step: fragments whose
  /// overlap ends complete first, then due fragments start. Collective
  /// when a sync falls on the step.
  void step();

  /// Inner steps taken (the resumed count after load_state_dict).
  int64_t inner_step() const;
  /// The global copy, one tensor per parameter (what the outer optimizer steps).
  const std::vector<at::Tensor>& global_parameters() const;
  torch::optim::Optimizer& outer_optimizer();
  /// Each fragment's parameter indices (into the constructor's `parameters`).
  const std::vector<std::vector<size_t>>& fragments() const;
  /// Fragments whose all-reduce is issued and not yet completed.
  std::vector<size_t> in_flight() const;
  /// Pseudo-gradient syncs started so far (one collective each).
  int64_t syncs_started() const;
  /// Under fault tolerance: syncs that every member skipped (their quorum
  /// lost a member); 0 over a group.
  int64_t skipped_syncs() const;
  /// The FaultTolerance given to the constructor, or nullptr.
  FaultTolerance* fault_tolerance() const;
  const DiLoCoOptions& options() const;
  /// The group the replicas synchronise over (the outer dimension); nullptr
  /// under fault tolerance.
  std::shared_ptr<ProcessGroup> process_group() const;
  /// The module given to the constructor, or nullptr when given parameters.
  torch::nn::Module* module() const;
  /// The local model's parameters, in the constructor's order.
  const std::vector<at::Tensor>& local_parameters() const;
  /// The inner optimizer given to the constructor.
  torch::optim::Optimizer& inner_optimizer();

  /// Waits for every fragment in flight and applies it now, as at the end of training.
  void flush();

  /// {"version", "inner_step", "global": [tensors], "outer_optimizer": Python's
  /// optimizer layout, "in_flight": [{"fragment", "due", "sum"}]}. A fragment
  /// in flight is waited for (every rank issued it already) and its summed
  /// pseudo-gradient saved, so the resumed run applies it at the same step.
  c10::IValue state_dict();
  /// Restores what state_dict() returned, at the same world size: the global
  /// copy, the outer optimizer, the step count and the syncs in flight. The
  /// local model and the inner optimizer are the caller's to restore.
  void load_state_dict(const c10::IValue& state);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Each fragment's parameter indices for `numels` split in order into
/// `count` runs of about equal size (every fragment gets at least one
/// parameter). A pure function, for tests.
DDP_API std::vector<std::vector<size_t>> split_into_fragments(const std::vector<int64_t>& numels, int64_t count);

}  // namespace ddp
