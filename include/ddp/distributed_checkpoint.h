#pragma once

// Distributed checkpoints: every rank writes its own part of the model and
// optimizer state, in parallel and with no gather, and a checkpoint loads at
// any world size and under any strategy, each rank reading only the bytes
// it needs. The files are those of PyTorch DCP's HuggingFace storage, so
// Python reads them and writes them:
//
//   # Python, any world size, FSDP2 or not
//   from torch.distributed.checkpoint import HuggingFaceStorageReader
//   from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
//   msd, osd = get_state_dict(model, optimizer)
//   state = {"model": msd, "optim": osd}
//   dcp.load(state, storage_reader=HuggingFaceStorageReader(dir),
//            planner=DefaultLoadPlanner(allow_partial_load=True))
//   set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
//
//   # C++
//   ddp::save_distributed_checkpoint(dir, fsdp_model, &optimizer);
//   ddp::load_distributed_checkpoint(dir, fsdp_model, &optimizer);  // any world size
//
// Names are those of dcp.save({"model": msd, "optim": osd}) with msd and osd
// from get_state_dict: "model.<fqn>" for parameters and buffers,
// "optim.state.<fqn>.exp_avg" (and exp_avg_sq, step, momentum_buffer...)
// for the optimizer. The files are
// DIR/shard-{rank+1:05d}-model-{k:05d}-of-{n:05d}.safetensors (rank 0's first
// of two: shard-00001-model-00001-of-00002.safetensors; k counts from 1, n
// is that rank's number of files):
// a rank's part of a tensor may be several boxes (FSDP's flat shards start
// and end inside rows), and a file holds one box per name.
//
// Why HuggingFace storage rather than DCP's native .metadata + .distcp:
// its header is JSON and its data raw bytes at known offsets, so C++ reads
// and writes it without pickling Python classes, and a rank reads just its
// boxes. What it cannot hold is Python objects: the optimizer's
// param_groups. ddp stores their hyperparameters in the files'
// __metadata__ (as "ddp_param_groups", JSON), which C++ restores and Python
// ignores; so Python loads with allow_partial_load=True and keeps the
// hyperparameters it was built with.
//
// The directory is written as DIR.partial and exchanged with DIR only once
// every rank's files are on disk, so an interrupted save leaves the previous
// DIR whole. A save replaces only a previous checkpoint: anything else at DIR
// (a file, a directory holding other files) is an error on every rank before
// anything is written. While a job saves, its rank 0 holds DIR.lock, naming
// the job; a second job saving into DIR meanwhile fails, naming the first.
// Every rank must see the same directory (a shared file system, as for DCP).

#include <ddp/export.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <ATen/core/ivalue.h>
#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp {

class DiLoCo;

/// How a distributed checkpoint names its tensors.
///
///   ddp::DistributedCheckpointOptions().model_prefix("app.model").optimizer_prefix("app.optim")
struct DistributedCheckpointOptions {
  using Metadata = std::map<std::string, std::string>;
  /// The key under which dcp.save's state dict holds the model ("model" in
  /// dcp.save({"model": msd, ...})).
  TORCH_ARG(std::string, model_prefix) = "model";
  /// The key that holds get_state_dict's optimizer state dict.
  TORCH_ARG(std::string, optimizer_prefix) = "optim";
  /// Strings saved with the checkpoint (in rank 0's first file's
  /// __metadata__, which Python's reader ignores); read them back with
  /// distributed_checkpoint_metadata().
  TORCH_ARG(Metadata, metadata);
};

/// The strings a checkpoint was saved with (DistributedCheckpointOptions::
/// metadata). Reads only the files' headers; not collective.
DDP_API std::map<std::string, std::string> distributed_checkpoint_metadata(const std::string& dir);

/// What a load read, for logs and tests.
struct DistributedCheckpointReport {
  int64_t bytes_read = 0;        ///< data bytes this rank read
  int64_t checkpoint_bytes = 0;  ///< the data bytes of the whole checkpoint
};

namespace detail {
// Called by the templates below; see src/distributed_checkpoint.cpp.
DDP_API void save_fsdp_checkpoint(const std::string& dir, const c10::IValue& sharded, ProcessGroup& group,
                                  const DistributedCheckpointOptions& options);
DDP_API c10::IValue read_fsdp_checkpoint(const std::string& dir, const c10::IValue& sharded, bool with_optimizer,
                                         const DistributedCheckpointOptions& options,
                                         DistributedCheckpointReport* report);
/// A replicated module (DDP) and its optimizer's state: `optimizer` (the
/// layout of optimizer_state_dict) covers the parameters `owned` (indices
/// into module.named_parameters(), in the optimizer's order): all of them,
/// the same on every rank, unless ZeRO shards it (`sharded_optimizer`).
DDP_API void save_replicated_checkpoint(const std::string& dir, const torch::nn::Module& module,
                                        const c10::IValue& optimizer, const std::vector<int64_t>& owned,
                                        bool sharded_optimizer, ProcessGroup& group,
                                        const DistributedCheckpointOptions& options);
/// Loads the module's state; returns the optimizer's (for `owned`) when
/// `optimizer` (the current optimizer_state_dict, for its param_groups) is
/// not None.
DDP_API c10::IValue load_replicated_checkpoint(const std::string& dir, torch::nn::Module& module,
                                               const c10::IValue& optimizer, const std::vector<int64_t>& owned,
                                               const DistributedCheckpointOptions& options,
                                               DistributedCheckpointReport* report);
/// The shapes of the checkpoint's tensors whose names start with `prefix`,
/// after checking that its files read and that none is missing; throws,
/// naming what is wrong. Reads only headers; not collective.
std::map<std::string, std::vector<int64_t>> checkpoint_shapes(const std::string& dir, const std::string& prefix);
DDP_API std::vector<int64_t> all_indices(const torch::nn::Module& module);
DDP_API c10::IValue optimizer_state_or_none(torch::optim::Optimizer* optimizer);
DDP_API void load_optimizer_state_or_none(torch::optim::Optimizer* optimizer, const c10::IValue& state);
}  // namespace detail

/// Writes this rank's shards of `model` (and `optimizer`'s state, built over
/// model.parameters()) into `dir`. Collective.
template <typename M>
void save_distributed_checkpoint(const std::string& dir, FullyShardedDataParallel<M>& model,
                                 torch::optim::Optimizer* optimizer = nullptr,
                                 const DistributedCheckpointOptions& options = {}) {
  detail::save_fsdp_checkpoint(dir, model.sharded_state_dict(optimizer), *model.process_group(), options);
}

/// Loads what save_distributed_checkpoint (or Python's dcp.save) wrote, at
/// any world size: each rank reads the parts of its shards. Collective.
template <typename M>
DistributedCheckpointReport load_distributed_checkpoint(const std::string& dir, FullyShardedDataParallel<M>& model,
                                                        torch::optim::Optimizer* optimizer = nullptr,
                                                        const DistributedCheckpointOptions& options = {}) {
  DistributedCheckpointReport report;
  model.load_sharded_state_dict(
      detail::read_fsdp_checkpoint(dir, model.sharded_state_dict(optimizer), optimizer != nullptr, options, &report),
      optimizer);
  return report;
}

/// DDP with an optimizer over model.parameters() (or none): the state is the
/// same on every rank, so each writes an equal part of every tensor.
template <typename M>
void save_distributed_checkpoint(const std::string& dir, DistributedDataParallel<M>& model,
                                 torch::optim::Optimizer* optimizer = nullptr,
                                 const DistributedCheckpointOptions& options = {}) {
  const auto& module = *model.module();
  detail::save_replicated_checkpoint(dir, module, detail::optimizer_state_or_none(optimizer),
                                     detail::all_indices(module), false, *model.process_group(), options);
}

template <typename M>
DistributedCheckpointReport load_distributed_checkpoint(const std::string& dir, DistributedDataParallel<M>& model,
                                                        torch::optim::Optimizer* optimizer = nullptr,
                                                        const DistributedCheckpointOptions& options = {}) {
  DistributedCheckpointReport report;
  auto& module = *model.module();
  auto state = detail::load_replicated_checkpoint(dir, module, detail::optimizer_state_or_none(optimizer),
                                                  detail::all_indices(module), options, &report);
  detail::load_optimizer_state_or_none(optimizer, state);
  return report;
}

/// DDP with ZeRO-1 (built over model.parameters()): each rank writes the
/// optimizer state of the parameters it owns.
template <typename M>
void save_distributed_checkpoint(const std::string& dir, DistributedDataParallel<M>& model,
                                 ZeroRedundancyOptimizer& optimizer, const DistributedCheckpointOptions& options = {}) {
  const auto& local = optimizer.local_indices();
  detail::save_replicated_checkpoint(
      dir, *model.module(), detail::optimizer_state_or_none(&optimizer.local_optimizer()),
      std::vector<int64_t>(local.begin(), local.end()), true, *model.process_group(), options);
}

template <typename M>
DistributedCheckpointReport load_distributed_checkpoint(const std::string& dir, DistributedDataParallel<M>& model,
                                                        ZeroRedundancyOptimizer& optimizer,
                                                        const DistributedCheckpointOptions& options = {}) {
  DistributedCheckpointReport report;
  const auto& local = optimizer.local_indices();
  auto state = detail::load_replicated_checkpoint(dir, *model.module(),
                                                  detail::optimizer_state_or_none(&optimizer.local_optimizer()),
                                                  std::vector<int64_t>(local.begin(), local.end()), options, &report);
  detail::load_optimizer_state_or_none(&optimizer.local_optimizer(), state);
  return report;
}

/// DiLoCo (<ddp/diloco.h>), built over the module (DiLoCo(model, inner,
/// group)), with `inner` its inner optimizer or nullptr. The checkpoint holds
///  - "model.<fqn>": the global copy for parameters, rank 0's buffers: the
///    averaged model, what Python's dcp.load reads as the model;
///  - "diloco.replica_<r>.model.<fqn>" and "diloco.replica_<r>.optim.state.
///    <fqn>.<key>": replica r's local weights and buffers and its inner
///    optimizer's state, which differ between syncs;
///  - "diloco.outer.state.<fqn>.<key>": the outer optimizer's state, and
///    "diloco.in_flight.<fragment>": the summed pseudo-gradient of each
///    fragment sync in flight (waited for, as state_dict() does);
///  - in the metadata: the inner step, the syncs started and in flight, and
///    both optimizers' hyperparameters.
/// Collective over diloco's group, which must be the job's (one rank per
/// replica). The options' prefixes rename "model" and "optim".
DDP_API void save_distributed_checkpoint(const std::string& dir, DiLoCo& diloco,
                                         torch::optim::Optimizer* inner = nullptr,
                                         const DistributedCheckpointOptions& options = {});

/// Loads it. At the saved world size every replica resumes its own local
/// state and the run continues bit for bit; at another, replica r resumes
/// replica (r mod saved replicas)'s, and every replica the global copy, the
/// outer optimizer, the step and the syncs in flight. Collective.
DDP_API DistributedCheckpointReport load_distributed_checkpoint(const std::string& dir, DiLoCo& diloco,
                                                                torch::optim::Optimizer* inner = nullptr,
                                                                const DistributedCheckpointOptions& options = {});

}  // namespace ddp
