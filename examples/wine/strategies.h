#pragma once

// How wine_ddp spreads the model and Adam over the ranks (--strategy):
//   ddp           every rank holds everything; gradients all-reduced
//   zero1         DDP, with Adam's moments sharded (ZeroRedundancyOptimizer)
//   fsdp-full     FullyShardedDataParallel, FULL_SHARD (ZeRO-3)
//   fsdp-grad-op  FullyShardedDataParallel, SHARD_GRAD_OP (ZeRO-2)
//   hsdp          FullyShardedDataParallel, HYBRID_SHARD: FULL_SHARD within each
//                 node, replicated across nodes (2-D mesh from the launcher)
//   hsdp-grad-op  the same with SHARD_GRAD_OP within each node
// The training loop is the same for all of them. Checkpoints are too (the
// full model's state dict, gathered on rank 0), and so are snapshots:
// sharded ones, every rank writing its own part with no gather, in PyTorch
// DCP's layout, so a run resumes under another strategy or world size.

#include "simple_nn.h"

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/sharded_snapshot.h>
#include <ddp/snapshot.h>
#include <ddp/snapshot_saver.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <torch/optim/adam.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace wine {

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual at::Tensor forward(const at::Tensor& features) = 0;
  virtual void zero_grad() = 0;
  virtual void step() = 0;
  /// The full model's state dict, on rank 0 (empty elsewhere). Collective.
  virtual ddp::StateDict model_state() = 0;
  /// Adam's state for the full model in Python's layout, on rank 0. Collective.
  virtual c10::IValue optimizer_state() = 0;
  /// Loads a snapshot that every rank holds.
  virtual void restore(const ddp::Snapshot& snapshot) = 0;
  /// Writes DIR/sharded_step_<step>, each rank its part. Collective.
  virtual void save_sharded(ddp::SnapshotSaver& saver, const ddp::TrainingProgress& progress) = 0;
  /// Loads the newest sharded snapshot in DIR, whatever world size and
  /// strategy wrote it. Collective.
  virtual std::optional<ddp::TrainingProgress> load_newest_sharded(const std::string& dir,
                                                                   std::vector<std::string>* skipped) = 0;
  /// Runs `evaluate` with the full model's parameters present. Collective.
  virtual double with_full_model(const std::function<double()>& evaluate) { return evaluate(); }
};

class DdpStrategy : public Strategy {
 public:
  DdpStrategy(SimpleNN model, std::shared_ptr<ddp::ProcessGroup> group)
      : ddp_model(model, group),
        optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-3)) {}
  at::Tensor forward(const at::Tensor& features) override { return ddp_model.forward(features); }
  void zero_grad() override { optimizer.zero_grad(); }
  void step() override { optimizer.step(); }
  ddp::StateDict model_state() override { return ddp::state_dict(*ddp_model.module()); }
  c10::IValue optimizer_state() override { return ddp::optimizer_state_dict(optimizer); }
  void restore(const ddp::Snapshot& snapshot) override {
    ddp::restore_snapshot(snapshot, *ddp_model.module(), optimizer);
  }
  void save_sharded(ddp::SnapshotSaver& saver, const ddp::TrainingProgress& progress) override {
    saver.save(ddp_model, &optimizer, progress);
  }
  std::optional<ddp::TrainingProgress> load_newest_sharded(const std::string& dir,
                                                           std::vector<std::string>* skipped) override {
    return ddp::load_newest_sharded_snapshot(dir, ddp_model, &optimizer, skipped);
  }

 private:
  ddp::DistributedDataParallel<SimpleNN> ddp_model;
  torch::optim::Adam optimizer;
};

class ZeroStrategy : public Strategy {
 public:
  ZeroStrategy(SimpleNN model, std::shared_ptr<ddp::ProcessGroup> group)
      : ddp_model(model, group),
        optimizer(ddp_model->parameters(), group, [](std::vector<at::Tensor> shard) {
          return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
        }) {}
  at::Tensor forward(const at::Tensor& features) override { return ddp_model.forward(features); }
  void zero_grad() override { optimizer.zero_grad(); }
  void step() override { optimizer.step(); }
  ddp::StateDict model_state() override { return ddp::state_dict(*ddp_model.module()); }
  c10::IValue optimizer_state() override { return optimizer.consolidate_state_dict(0); }
  void restore(const ddp::Snapshot& snapshot) override {
    ddp::load_state_dict(*ddp_model.module(), snapshot.model);
    optimizer.load_state_dict(snapshot.optimizer);
    ddp::restore_rng_state(snapshot);
  }
  void save_sharded(ddp::SnapshotSaver& saver, const ddp::TrainingProgress& progress) override {
    saver.save(ddp_model, optimizer, progress);
  }
  std::optional<ddp::TrainingProgress> load_newest_sharded(const std::string& dir,
                                                           std::vector<std::string>* skipped) override {
    return ddp::load_newest_sharded_snapshot(dir, ddp_model, optimizer, skipped);
  }

 private:
  ddp::DistributedDataParallel<SimpleNN> ddp_model;
  ddp::ZeroRedundancyOptimizer optimizer;
};

// The Wine model is far too small to split into several units: it is one
// unit, sharded as a whole.
class FsdpStrategy : public Strategy {
 public:
  FsdpStrategy(SimpleNN model, std::shared_ptr<ddp::ProcessGroup> group, ddp::ShardingStrategy sharding)
      : fsdp_model(model, group, ddp::FSDPOptions().sharding_strategy(sharding)),
        optimizer(fsdp_model.parameters(), torch::optim::AdamOptions(1e-3)) {}
  // HSDP: sharded along the mesh's "shard" dimension, replicated along "replicate".
  FsdpStrategy(SimpleNN model, const ddp::DeviceMesh& mesh, ddp::ShardingStrategy sharding)
      : fsdp_model(model, mesh, ddp::FSDPOptions().sharding_strategy(sharding)),
        optimizer(fsdp_model.parameters(), torch::optim::AdamOptions(1e-3)) {}
  at::Tensor forward(const at::Tensor& features) override { return fsdp_model.forward(features); }
  void zero_grad() override { optimizer.zero_grad(); }
  void step() override { optimizer.step(); }
  ddp::StateDict model_state() override { return fsdp_model.full_state_dict(); }
  c10::IValue optimizer_state() override { return fsdp_model.full_optim_state_dict(optimizer); }
  void restore(const ddp::Snapshot& snapshot) override {
    fsdp_model.load_full_state_dict(snapshot.model);
    fsdp_model.load_full_optim_state_dict(optimizer, snapshot.optimizer);
    ddp::restore_rng_state(snapshot);
  }
  void save_sharded(ddp::SnapshotSaver& saver, const ddp::TrainingProgress& progress) override {
    saver.save(fsdp_model, &optimizer, progress);
  }
  std::optional<ddp::TrainingProgress> load_newest_sharded(const std::string& dir,
                                                           std::vector<std::string>* skipped) override {
    return ddp::load_newest_sharded_snapshot(dir, fsdp_model, &optimizer, skipped);
  }
  double with_full_model(const std::function<double()>& evaluate) override {
    auto gathered = fsdp_model.summon_full_params();
    return evaluate();
  }

 private:
  ddp::FullyShardedDataParallel<SimpleNN> fsdp_model;
  torch::optim::Adam optimizer;
};

inline std::unique_ptr<Strategy> make_strategy(const std::string& name, SimpleNN model,
                                               std::shared_ptr<ddp::ProcessGroup> group) {
  if (name == "ddp") return std::make_unique<DdpStrategy>(model, group);
  if (name == "zero1") return std::make_unique<ZeroStrategy>(model, group);
  if (name == "fsdp-full") return std::make_unique<FsdpStrategy>(model, group, ddp::ShardingStrategy::kFullShard);
  if (name == "fsdp-grad-op") return std::make_unique<FsdpStrategy>(model, group, ddp::ShardingStrategy::kShardGradOp);
  if (name == "hsdp" || name == "hsdp-grad-op") {
    // Nodes x local ranks, from the launcher's variables: {"replicate", "shard"}.
    auto mesh = ddp::DeviceMesh::from_launcher(group);
    auto within_node = name == "hsdp" ? ddp::ShardingStrategy::kFullShard : ddp::ShardingStrategy::kShardGradOp;
    return std::make_unique<FsdpStrategy>(model, mesh, within_node);
  }
  TORCH_CHECK(false, "--strategy must be ddp, zero1, fsdp-full, fsdp-grad-op, hsdp or hsdp-grad-op, got '", name,
              "'");
}

}  // namespace wine
