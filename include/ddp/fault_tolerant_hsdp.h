#pragma once

// Per-step fault tolerance for HSDP (torchft's fault-tolerant HSDP, in C++):
// a replica group of S processes (one node's ranks, say) shards the model
// with FSDP over a process group of its own; replica groups replicate each
// other, and the replicate dimension is fault tolerant. A lost process takes
// its whole replica group out as one replica (its shard group is broken):
// the other groups skip the step and train on; ddprun --fault-tolerance
// --ft-replica-size S restarts the group as one unit, and its processes
// heal their shards from the live groups' processes that hold the same
// shards, never from disk.
//
//   ddp::FaultTolerantHSDP ft;                                    // reads DDP_FT_* and LOCAL_RANK
//   ddp::FullyShardedDataParallel<Net> model(net, ft.shard_group(), ft.fsdp_options());
//   torch::optim::Adam optimizer(model.parameters(), 1e-3);
//   ddp::FaultTolerantSampler sampler(dataset_size, batch_size);
//   ft.manage(model, &optimizer, &sampler);
//   while (sampler.epoch() < epochs) {
//     ft.start_step();
//     auto indices = sampler.batch(ft.data_rank(), ft.data_size());
//     optimizer.zero_grad();
//     loss_of(model, indices).backward();   // shard group, then across the replica groups
//     if (ft.should_commit()) optimizer.step();
//   }
//
// How it composes: each shard index s has a FaultTolerance of its own (a
// quorum of the processes holding shard s, one per replica group, in the
// store under "hsdp/shard<s>/"), whose hook is FSDP's replicate_hook. Each
// step, every quorum decides identically for its members; the replica group
// then takes the minimum over its S decisions (and over whether its S
// quorums have the same members), which every group computes alike, so a
// step is applied by every process of every group or by none. A quorum that
// committed a step that another shard index skipped drops it
// (FaultTolerance::skip_committed_step). Joiners are let in only when every
// shard index's quorum of the group sees one waiting, so a restarted group
// enters all its quorums at the same step.

#include <ddp/export.h>
#include <ddp/fault_tolerance.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <torch/arg.h>

#include <chrono>
#include <memory>
#include <string>

namespace ddp {

/// Options of FaultTolerantHSDP.
struct DDP_API FaultTolerantHSDPOptions {
  FaultTolerantHSDPOptions();
  /// The options of each shard index's quorum (store, replica id, deadline,
  /// ...); their defaults come from ddprun's environment as for
  /// FaultTolerance. The replica id names the replica group: every process
  /// of a group has the same one (ddprun --ft-replica-size gives it), and
  /// initial_replicas counts groups. broadcast_buffers is turned off, as
  /// FSDP does not broadcast buffers either; joiners still receive them.
  TORCH_ARG(FaultToleranceOptions, fault_tolerance);
  /// Processes per replica group (S). Default: DDP_FT_REPLICA_SIZE, else 1.
  TORCH_ARG(int, replica_size) = 1;
  /// This process's place in its group, 0 .. S-1 (the shard it holds).
  /// Default: LOCAL_RANK % replica_size.
  TORCH_ARG(int, shard_index) = 0;
};

/// Fault-tolerant HSDP's membership, votes and healing for one process. Not
/// thread-safe: one training thread calls it.
class DDP_API FaultTolerantHSDP {
 public:
  /// Connects this process to its shard index's quorum and forms the replica
  /// group's shard group (its S processes meet through the quorum's store,
  /// waiting for each other up to the join timeout). The group's collectives
  /// time out at twice the fault-tolerance deadline plus a second, and at
  /// least 30 s: long enough for a sibling whose quorum waits out a hung
  /// member of another group (the deadline, then the vote's grace) and for a
  /// loaded machine's start-up. The group is on one host, where shared memory
  /// names a dead or stopped sibling within a second whatever the timeout,
  /// and the other groups' quorums fence this group at the deadline anyway.
  explicit FaultTolerantHSDP(FaultTolerantHSDPOptions options = {});
  ~FaultTolerantHSDP();
  FaultTolerantHSDP(const FaultTolerantHSDP&) = delete;
  FaultTolerantHSDP& operator=(const FaultTolerantHSDP&) = delete;

  /// The replica group's own processes: build FullyShardedDataParallel on it.
  std::shared_ptr<ProcessGroup> shard_group() const { return shard_group_; }
  /// `base` with the quorum's hook as its replicate_hook.
  FSDPOptions fsdp_options(FSDPOptions base = {});
  /// What a joiner receives from the live process holding the same shard:
  /// the model's shards and buffers, the optimizer's state, the sampler's
  /// position, the step and the CPU random generator. The optimizer and the
  /// sampler may be null. `model` must outlive this object's use.
  template <typename ModuleType>
  void manage(FullyShardedDataParallel<ModuleType>& model, torch::optim::Optimizer* optimizer,
              FaultTolerantSampler* sampler = nullptr) {
    manage_shards(model.parameters(), detail::as_module_ptr(model.module()), optimizer, sampler);
  }

  /// Call before each step's forward (see FaultTolerance::start_step).
  void start_step();
  /// Call after backward: whether to apply the step. The same answer on
  /// every process of every replica group. True: the managed sampler has
  /// advanced by data_size() batches.
  bool should_commit();

  /// Which slice of the step's samples this process trains on:
  /// replica_rank() * replica_size + shard index, of data_size().
  int data_rank() const;
  int data_size() const;
  /// This group's rank among the current groups (by replica id), and their number.
  int replica_rank() const;
  int replicas() const;
  int shard_index() const { return shard_index_; }
  int replica_size() const { return replica_size_; }
  /// This shard index's quorum, for its stats, members and step.
  FaultTolerance& quorum() { return *quorum_; }
  const FaultTolerance& quorum() const { return *quorum_; }

 private:
  void manage_shards(const std::vector<at::Tensor>& shards, const std::shared_ptr<torch::nn::Module>& root,
                     torch::optim::Optimizer* optimizer, FaultTolerantSampler* sampler);

  // Waits, through the quorums' store and up to the join timeout, until all
  // S processes of the group have called it with `what`.
  void wait_for_the_group(const std::string& what);

  int replica_size_;
  int shard_index_;
  std::string group_id_;     // the group's replica id, the same on its S processes
  std::string store_spec_;   // the quorums' store
  std::chrono::milliseconds join_timeout_;
  bool started_ = false;
  std::unique_ptr<FaultTolerance> quorum_;
  std::shared_ptr<ProcessGroup> shard_group_;
  std::shared_ptr<torch::nn::Module> managed_;  // the shards and buffers, as one module for healing
  FaultTolerantSampler* sampler_ = nullptr;
};

}  // namespace ddp
