#pragma once

// Per-step fault tolerance for data-parallel training (torchft's Manager, in
// C++ over c10d): every worker process is one replica; the replicas form a
// quorum through a store that outlives any one of them (ddprun
// --fault-tolerance serves it); each step's gradients are averaged over the
// current members; each step ends in a commit decision that every survivor
// reads identically; a lost member costs one skipped step, not a restart;
// a restarted worker joins at a step boundary and copies the state from a
// live member, never from disk. docs/fault_tolerance.md has the guarantees.
//
//   ddp::FaultTolerance ft;                                    // reads DDP_FT_* (set by ddprun)
//   ddp::DistributedDataParallel<Net> model(net, ft.local_group(), ft.ddp_options());
//   torch::optim::Adam optimizer(model->parameters(), 1e-3);
//   ddp::FaultTolerantSampler sampler(dataset_size, batch_size);
//   ft.manage(net.ptr(), &optimizer, &sampler);
//   while (sampler.epoch() < epochs) {
//     ft.start_step();                                         // joins, reconfigures, heals
//     auto indices = sampler.batch(ft.rank(), ft.size());
//     optimizer.zero_grad();
//     loss_of(indices).backward();                             // all-reduced over the members
//     if (ft.should_commit()) optimizer.step();                // identical on every survivor
//   }

#include <ddp/export.h>
#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/error.h>
#include <ddp/process_group.h>

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace ddp {

/// Whether the launcher asked for fault tolerance: DDP_FAULT_TOLERANCE=1
/// (ddprun --fault-tolerance sets it).
DDP_API bool fault_tolerance_requested();

/// Thrown on a member that the others removed while it was hung or cut off
/// (its generation is stale): it must not touch the job again. Exit (the
/// launcher restarts it under a new replica id, and it heals) or make a new
/// FaultTolerance to rejoin.
class DDP_API FencedOut : public Error {
 public:
  using Error::Error;
};

/// Options of FaultTolerance. The defaults come from the environment that
/// ddprun --fault-tolerance gives each worker.
///
///   ddp::FaultToleranceOptions().deadline(std::chrono::seconds(2)).min_replicas(2)
struct DDP_API FaultToleranceOptions {
  FaultToleranceOptions();
  /// Where the quorum lives: "tcp://HOST:PORT" (a c10d TCPStore served by a
  /// process other than the workers) or "etcd://HOST:PORT[,...][/PREFIX]".
  /// Default: DDP_FT_STORE.
  TORCH_ARG(std::string, store);
  /// This worker incarnation's id, unique for the life of the job (a
  /// restarted worker gets a new one). Default: DDP_FT_REPLICA_ID.
  TORCH_ARG(std::string, replica_id);
  /// A key prefix for this quorum in the store, so that several quorums
  /// share one store (FaultTolerantHSDP's, one per shard index: "hsdp/shard0/").
  /// Default: none.
  TORCH_ARG(std::string, scope);
  /// How many replicas the first quorum waits for (up to join_timeout).
  /// Default: DDP_FT_INITIAL_REPLICAS, else 1.
  TORCH_ARG(int, initial_replicas) = 1;
  /// Fewer members than this is an error rather than a smaller job.
  TORCH_ARG(int, min_replicas) = 1;
  /// Fixed-size mode with spares (torchft's FIXED_WITH_SPARES): 0 (the
  /// default) averages each step over all its members, so the global batch
  /// shrinks while one is missing. N > 0: only the first N members (in rank
  /// order: members carried over before joiners) take part in the average,
  /// divided by N; the others are spares, which compute and receive every
  /// step like the rest but add zeros, so they hold the job's state and take
  /// a lost participant's place at the next step without a heal. The global
  /// batch stays N x batch_size; with fewer than N members the next group
  /// waits (up to join_timeout) for a joiner, as min_replicas(N) would.
  /// Train on sampler.batch(ft.participating() ? ft.rank() : 0,
  /// ft.participants()): a spare's batch is thrown away.
  TORCH_ARG(int, fixed_size) = 0;
  /// How long a step's collectives, its vote and the forming of a new group
  /// may take before the members that did not keep up are fenced out (a
  /// hung process, a partition). Default: DDP_FT_DEADLINE_MS, else 5 s.
  TORCH_ARG(std::chrono::milliseconds, deadline) = std::chrono::milliseconds(5000);
  /// How often each worker proves it is alive in the store.
  TORCH_ARG(std::chrono::milliseconds, heartbeat_interval) = std::chrono::milliseconds(100);
  /// A member whose heartbeat has not changed for this long, and that did
  /// not come to a new quorum, is left out of it.
  TORCH_ARG(std::chrono::milliseconds, heartbeat_timeout) = std::chrono::milliseconds(1000);
  /// How long the first quorum waits for initial_replicas, and a joiner to
  /// be let in.
  TORCH_ARG(std::chrono::milliseconds, join_timeout) = std::chrono::seconds(120);
  /// How many of the members that hold the state send it to a joiner, each
  /// a share of the tensors balanced by bytes, concurrently; 0: all of them.
  /// 1 is the single-sender path (rank 0 sends everything). Default:
  /// DDP_FT_HEAL_SENDERS, else 0.
  TORCH_ARG(int, heal_senders) = 0;
  /// Make the managed module's buffers (BatchNorm's statistics, say) equal
  /// on every member at each start_step(): the generation's rank 0 sends
  /// its own, as DDP's broadcast_buffers does before each forward (the
  /// local group DDP is built on has only this process). One broadcast of
  /// all the buffers' bytes, under the step's deadline; a failure skips the
  /// step like a bucket's. A module without buffers pays nothing. Off: each
  /// member keeps its own, and only joiners receive rank 0's.
  ///
  ///   ddp::FaultToleranceOptions().broadcast_buffers(false)
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Print one line per membership change on stderr.
  TORCH_ARG(bool, log_membership) = true;
};

/// What fault tolerance has cost so far, on this member.
struct FaultToleranceStats {
  int64_t committed_steps = 0;     ///< steps applied (by this member)
  int64_t skipped_steps = 0;       ///< step attempts dropped by every member
  double seconds_lost = 0;         ///< in skipped attempts and in reconfiguring
  int64_t membership_changes = 0;  ///< generations this member went through after its first
  int64_t heal_bytes_sent = 0;     ///< state sent to joiners by this member (its share, when several send)
  int64_t heal_bytes_received = 0; ///< state received when this member joined
  /// Store operations of this member's vote per committed step, measured: 0
  /// without faults (the vote is the group's own all-reduce); a skipped step,
  /// or a vote whose answer was lost, costs one or two.
  double store_ops_per_step = 0;
  /// The last recovery: from the step's failure to the new group's being ready.
  double last_recovery_ms = 0;
};

/// The sampler of a fault-tolerant job: each epoch's order is
/// DistributedSampler's permutation (same seed, same epoch), consumed by a
/// global cursor that advances by members x batch_size only on committed
/// steps; member i of n trains on the i-th slice of that window. A skipped
/// step is redone by the survivors, so every sample of an epoch is trained
/// once among the members, whatever they were when it came up. The last
/// step of an epoch may be short; its window wraps to the epoch's first
/// samples when it has fewer samples than members. Its cursor is part of
/// the state a joiner receives.
class DDP_API FaultTolerantSampler {
 public:
  FaultTolerantSampler(int64_t dataset_size, int64_t batch_size, uint64_t seed = 0, bool shuffle = true);
  /// The epoch's order: DistributedSampler's permutation for seed + epoch.
  const std::vector<int64_t>& order() const { return order_; }
  /// The indices member `rank` of `members` trains on in the current step.
  std::vector<int64_t> batch(int rank, int members) const;
  /// Every member's indices of the current step, in rank order (a window of
  /// the order).
  std::vector<int64_t> window(int members) const;
  /// Called on a committed step (FaultTolerance does, for a managed sampler):
  /// moves the cursor past the window; at the end of the order, starts the
  /// next epoch.
  void advance(int members);
  int64_t epoch() const { return epoch_; }
  int64_t cursor() const { return cursor_; }
  int64_t dataset_size() const { return dataset_size_; }
  int64_t batch_size() const { return batch_size_; }
  uint64_t seed() const { return seed_; }
  /// Sets the position (from a joiner's state, or to start at an epoch).
  void set_position(int64_t epoch, int64_t cursor);

 private:
  int64_t dataset_size_;
  int64_t batch_size_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = 0;
  int64_t cursor_ = 0;
  std::vector<int64_t> order_;
};

/// The window of `members` x `batch_size` samples starting at `cursor` of
/// `order` (shorter at the end; wrapped to its start when fewer than
/// `members`), and member `rank`'s part of it: the pure rule behind
/// FaultTolerantSampler.
DDP_API std::vector<int64_t> fault_tolerant_window(const std::vector<int64_t>& order, int64_t cursor,
                                                   int64_t batch_size, int members);
DDP_API std::vector<int64_t> fault_tolerant_slice(const std::vector<int64_t>& window, int rank, int members);

/// Membership, per-step commit votes, recovery and healing of one replica.
/// Not thread-safe: one training thread calls it.
class DDP_API FaultTolerance {
 public:
  explicit FaultTolerance(FaultToleranceOptions options = {});
  ~FaultTolerance();
  FaultTolerance(const FaultTolerance&) = delete;
  FaultTolerance& operator=(const FaultTolerance&) = delete;

  /// A process group of this process alone (Gloo), for DistributedDataParallel
  /// to be built on: it then divides by 1 and leaves the reduction across
  /// replicas to comm_hook().
  std::shared_ptr<ProcessGroup> local_group();
  /// The hook that all-reduces each bucket over the current members and
  /// averages it over them; a failure marks the step as failed instead of
  /// throwing, so backward always completes. The hook shares this object's
  /// state: run after the FaultTolerance is destroyed, it throws rather than
  /// touching freed memory.
  std::shared_ptr<CommHook> comm_hook();
  /// `base` with comm_hook() and the settings every member must share:
  /// buckets never rebuilt (a joiner's first step must bucket as the
  /// others' do), so not fitted to the link either; without a
  /// bucket_cap_mb in `base` the cap is 2 MiB, which overlaps the
  /// all-reduce with backward where PyTorch's 25 MiB would leave a small
  /// model in one or two buckets.
  DDPOptions ddp_options(DDPOptions base = {});

  /// What a joiner receives from a live member, with the step number and the
  /// CPU random generator's state: the module's parameters and buffers, the
  /// optimizer's state and the sampler's position. Any may be null.
  void manage(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer* optimizer,
              FaultTolerantSampler* sampler = nullptr);
  /// More state for joiners: `save` writes it on a live member, `load` reads
  /// it on the joiner.
  void manage_state(std::function<void(torch::serialize::OutputArchive&)> save,
                    std::function<void(torch::serialize::InputArchive&)> load);

  /// Call before each step's forward. The first call joins the job (the first
  /// quorum, or as a joiner healed from a live member); later calls form a
  /// new group first when the last step failed or a joiner waits. Then the
  /// managed module's buffers become rank 0's on every member
  /// (FaultToleranceOptions::broadcast_buffers).
  void start_step();
  /// Sums `tensor` in place over the current step's members, for state that
  /// is not a DDP bucket (DiLoCo's pseudo-gradient). Call between
  /// start_step() and should_commit(), with the same shapes in the same
  /// order on every member. False when the step failed (this collective, an
  /// earlier one, or a lost member): `tensor` is then unchanged and
  /// should_commit() answers false on every member. Blocks up to the deadline.
  bool all_reduce_sum(at::Tensor& tensor);
  /// Call after backward: whether every member of the step's quorum finished
  /// its all-reduce. The answer is the same on every member. True: apply
  /// the step (optimizer.step()); the managed sampler has advanced. False:
  /// drop it (the random generator is as before the step).
  bool should_commit();
  /// After should_commit() answered true: drops the step after all, because
  /// something outside this quorum failed it (FaultTolerantHSDP: another
  /// shard index's quorum skipped it). The step count, the managed
  /// sampler, the random generator and the buffers go back to before the
  /// step, and the next start_step() forms a new group, as after a skipped
  /// step. Every member must call it on the same step, or none: the caller's
  /// reason to drop the step must be one every member sees alike.
  void skip_committed_step(const std::string& cause);
  /// Leaves the job cleanly at a step boundary: the others drop the current
  /// attempt and go on without this member.
  void leave();

  int rank() const;  ///< this member's rank among the current members
  int size() const;  ///< how many members the current step has
  /// How many members the step's average is over: size(), or at most
  /// FaultToleranceOptions::fixed_size in fixed-size mode.
  int participants() const;
  /// Whether this member's gradients count (false: a spare, in fixed-size mode).
  bool participating() const;
  int64_t step() const;  ///< committed steps of the job
  int64_t generation() const;  ///< how many memberships the job has had
  const std::string& replica_id() const;
  /// The current members' replica ids, in rank order.
  std::vector<std::string> members() const;
  /// Whether a joiner waits to be let in at the next step boundary.
  bool join_pending() const;
  /// While true, joiners wait (this member's vote never lets them in): for
  /// scripting a membership sequence in tests and replays.
  void hold_joiners(bool hold);
  FaultToleranceStats stats() const;
  /// The stats as one JSON object, for a metrics file.
  std::string stats_json() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with comm_hook()'s hooks, which may outlive this
};

}  // namespace ddp
