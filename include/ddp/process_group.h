#pragma once

// A group of processes that run collectives together: rendezvous through a
// c10d TCPStore hosted by rank 0, then a Gloo (CPU) or NCCL (CUDA) backend.

#include <ddp/export.h>
#include <ddp/collective_trace.h>
#include <ddp/env.h>
#include <ddp/error_file.h>  // record_error(), for main()'s catch blocks
#include <ddp/init_method.h>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class Backend;
}

namespace ddp {

enum class BackendKind {
  /// NCCL when the device is CUDA; on the CPU, shared memory when every rank
  /// of the group is on one host (and DDP_SHM is not 0), Gloo otherwise
  kAuto,
  kGloo,
  kNccl,
  kMpi,  ///< MPI (Open MPI): ranks started by mpirun or srun --mpi=pmix; CPU tensors
  /// Shared memory between ranks of one host (CPU tensors): all-reduce,
  /// reduce, broadcast, all-gather, reduce-scatter and barrier through one
  /// memory segment; the other collectives over Gloo between the same ranks
  kShm,
};

/// Whether this build of ddp has the mpi backend (MPI was found when it was
/// configured).
DDP_API bool mpi_available();

/// "auto", "gloo", "nccl", "mpi" or "shm"; throws on anything else.
DDP_API BackendKind parse_backend(const std::string& name);
/// The name parse_backend accepts for `backend`.
DDP_API std::string to_string(BackendKind backend);
/// What `backend` means for tensors on `device`: kAuto is the DDP_BACKEND
/// environment variable's backend when it is set (gloo, nccl, mpi or shm),
/// else NCCL for a CUDA device and Gloo otherwise; the others stay as they
/// are. ProcessGroup::create then turns an automatic Gloo into shared memory
/// (kShm) when every rank is on one host, unless DDP_SHM=0.
DDP_API BackendKind resolve_backend(BackendKind backend, const c10::Device& device);

/// The timeout applied when none is given: DDP_TIMEOUT_SECONDS from the
/// environment if set, else 30 minutes (PyTorch's default for Gloo).
DDP_API std::chrono::milliseconds default_timeout();

/// The job's run id: DDP_RUN_ID, else TORCHELASTIC_RUN_ID (set by ddprun
/// --rdzv-id and torchrun), else "none".
DDP_API std::string default_run_id();

/// How much checking collectives get.
enum class DebugLevel {
  kOff,     ///< the trace only (always on: it costs well under 1% of a Wine step)
  kDetail,  ///< also a desync check before every collective: the ranks compare op, dtype, shape and tag
};

/// DDP_DEBUG from the environment: "detail" (or TORCH_DISTRIBUTED_DEBUG=DETAIL)
/// is kDetail, unset or "off" is kOff.
DDP_API DebugLevel default_debug_level();

/// Whether ddp installs its diagnostic handlers unless told otherwise:
/// DDP_DIAGNOSTIC_HANDLERS from the environment, "1" (ddprun exports it to
/// its workers) or "0"; unset is "0", for a program ddprun did not start.
DDP_API bool default_diagnostic_handlers();

/// Options for init_process_group.
///
///   auto pg = ddp::init_process_group(
///       ddp::ProcessGroupOptions().backend(ddp::BackendKind::kGloo)
///                                 .timeout(std::chrono::seconds(60)));
struct ProcessGroupOptions {
  /// Which collective library to use.
  TORCH_ARG(BackendKind, backend) = BackendKind::kAuto;
  /// The device the tensors live on; decides what kAuto means. For NCCL, a
  /// CUDA device with an index is the GPU this rank's communicator uses
  /// (init_device() in device.h picks it); without an index, the GPU of
  /// the rank's local rank.
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
  /// How long rendezvous and each collective may take before they fail.
  TORCH_ARG(std::chrono::milliseconds, timeout) = default_timeout();
  /// Identifies the job: ranks whose run ids differ refuse to form a group.
  TORCH_ARG(std::string, run_id) = default_run_id();
  /// How the ranks find each other (init_method.h): "env://" (rank 0 hosts
  /// the store at MASTER_ADDR:MASTER_PORT), "tcp://HOST:PORT", or
  /// "file:///shared/path" (a store file on a shared file system; no
  /// address needed). Default: DDP_INIT_METHOD, else "env://". The mpi
  /// backend checks it but meets through MPI; one process needs no store.
  TORCH_ARG(std::string, init_method) = default_init_method();
  /// kDetail compares every collective's fingerprint across ranks before it
  /// runs, so a desync is an error naming both sides instead of a hang.
  TORCH_ARG(DebugLevel, debug) = default_debug_level();
  /// Whether creating the group installs a SIGUSR1 handler that prints
  /// every thread's stack and the last collectives, then lets the program
  /// go on (stack_dump.h; `kill -USR1 PID`, or SIGUSR1 to ddprun, which
  /// forwards it). Signal handlers belong to the whole process, so ddp takes
  /// SIGUSR1 only when asked: this option, or DDP_DIAGNOSTIC_HANDLERS=1,
  /// which ddprun sets for its workers (default_diagnostic_handlers()).
  /// Under torchrun or your own launcher, export DDP_DIAGNOSTIC_HANDLERS=1
  /// or set this. Once installed it stays for the life of the process;
  /// DDP_STACK_DUMP_SIGNAL=off still refuses it.
  ///
  ///   ddp::ProcessGroupOptions().install_stack_dump_handler(true)
  TORCH_ARG(bool, install_stack_dump_handler) = default_diagnostic_handlers();
  /// Whether creating the group installs a std::terminate handler: an
  /// exception that nothing caught (one thrown in Gloo's transport thread
  /// when ranks issued different collectives, say) then ends the process
  /// with ddp's error line (rank, collectives in flight, likely cause),
  /// recorded for the launcher, and exit status 1, instead of abort()'s bare
  /// "terminate called". It replaces the program's own handler, which it
  /// calls for an exception while no process group lives; hence opt-in, with
  /// the same default as install_stack_dump_handler.
  TORCH_ARG(bool, install_terminate_handler) = default_diagnostic_handlers();
};

/// One send or receive of ProcessGroup::batch_isend_irecv, like
/// torch.distributed.P2POp:
///
///   group->batch_isend_irecv({ddp::P2POp(ddp::P2POp::kIsend, out, (rank + 1) % size),
///                             ddp::P2POp(ddp::P2POp::kIrecv, in, (rank + size - 1) % size)});
struct P2POp {
  enum Kind { kIsend, kIrecv };
  P2POp(Kind kind, at::Tensor tensor, int peer, int tag = 0)
      : kind(kind), tensor(std::move(tensor)), peer(peer), tag(tag) {}
  Kind kind;
  at::Tensor tensor;  ///< sent, or received into; keep it alive until its work is waited for
  int peer;           ///< a rank of the group
  int tag;            ///< matches a send with a receive, as send_async's tag
};

/// A process group: the ranks of one job and the collectives between them.
/// All ranks must call collectives in the same order.
class DDP_API ProcessGroup {
 public:
  /// Rendezvous with the other ranks of `world` and connect the backend.
  /// Rank 0 hosts the store on MASTER_ADDR:MASTER_PORT (or the ranks meet
  /// as options.init_method() says); a busy port, an unreachable master, a
  /// stale store file or a missing peer fails within `timeout`.
  static std::shared_ptr<ProcessGroup> create(const World& world, ProcessGroupOptions options = {});
  ~ProcessGroup();

  /// This process's rank in this group: its global rank in the world's
  /// group, its place among the members in a subgroup, -1 where it is not
  /// a member (as torch.distributed.get_rank(group)).
  int rank() const;
  int size() const;  ///< how many ranks the group has
  /// Where this process stands. In a subgroup, rank and world_size are the
  /// group's (as rank() and size()); local rank, node and master stay the
  /// process's.
  const World& world() const;
  BackendKind backend() const;  ///< gloo, nccl, mpi or shm, never kAuto
  std::chrono::milliseconds timeout() const;  ///< of every collective
  /// Where small bookkeeping tensors (flags, sizes, hashes) must live for
  /// this backend's collectives: the CPU for Gloo, this rank's GPU for NCCL.
  at::TensorOptions control_options() const;
  /// `tensor` moved to control_options()'s device, to send.
  at::Tensor to_control(const at::Tensor& tensor) const;

  /// Starts an all-reduce of `tensor` in place and returns at once; call
  /// wait() on the result before reading `tensor`.
  c10::intrusive_ptr<c10d::Work> all_reduce_async(at::Tensor& tensor,
                                                  c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// All-reduces `tensor` in place and waits for it.
  void all_reduce(at::Tensor& tensor, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// Copies `tensor` from `root` to every rank, in place.
  void broadcast(at::Tensor& tensor, int root = 0);
  /// Returns every rank's `tensor`, indexed by rank. Shapes must match.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor);
  /// Starts gathering every rank's `input` into `output` (world size times
  /// as long, rank r's part at r * input.numel()). Wait before reading.
  c10::intrusive_ptr<c10d::Work> all_gather_into_async(at::Tensor& output, at::Tensor& input);
  /// Starts a reduce-scatter: `input` (world size times as long as `output`)
  /// is summed over ranks and rank r receives part r in `output`.
  ///
  /// On Gloo, CPU tensors are reduce-scattered (sum) and all-gathered by
  /// rings of send/recv on a thread of their own, one thread for each of
  /// the two (bench/MEMORY.md: Gloo's own are slower). So reduce-scatters
  /// match each other across ranks by the order in which they were started,
  /// and all-gathers likewise, independently of each other and of the other
  /// collectives.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_async(at::Tensor& output, at::Tensor& input,
                                                      c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// Reduce-scatters `input` into `output` as reduce_scatter_async does,
  /// and waits (torch.distributed.reduce_scatter_tensor).
  void reduce_scatter(at::Tensor& output, at::Tensor& input, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// Starts sending `tensor` to rank `to`, matched by a recv_async with the
  /// same tag there. Keep `tensor` alive and unchanged until waited for.
  c10::intrusive_ptr<c10d::Work> send_async(at::Tensor& tensor, int to, int tag = 0);
  /// Starts receiving into `tensor` from rank `from`.
  c10::intrusive_ptr<c10d::Work> recv_async(at::Tensor& tensor, int from, int tag = 0);
  /// Returns when every rank has reached it.
  void barrier();

  /// The c10d backend itself, for benchmarks that compare its collectives
  /// with the rings above (bench/memory_bench.cpp). Collectives issued on it
  /// bypass this class: they get no sequence number, no trace record, no
  /// DDP_DEBUG=detail desync check and no explain_stall report, and take
  /// the backend's own ranks. Every collective has a traced method here
  /// (reduce, gather, scatter, all_to_all, batch_isend_irecv, ... below);
  /// use those in programs.
  const c10::intrusive_ptr<c10d::Backend>& c10d_backend() const;

  /// Waits for `work`; on failure throws an error that names `operation`,
  /// this rank and the timeout. With NCCL this does not block the host: the
  /// current CUDA stream waits for the collective (read the result with
  /// .item() or .cpu(), which synchronise, or keep using it on the GPU), and
  /// NCCL's watchdog enforces the timeout.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* operation) const;

  /// The rendezvous store, shared by all ranks (keys live under "ddp/"); a
  /// subgroup's is its own prefix of it, shared by its members.
  c10d::Store& store();
  /// A fresh store key prefix for one use of the store, "ddp/<purpose>/<n>/".
  /// Ranks that make the same calls in the same order get the same prefixes.
  std::string unique_store_prefix(const std::string& purpose);

  /// Releases the backend and the store. Idempotent; also run by the
  /// destructor.
  void shutdown();

  // ---- Subgroups -----------------------------------------------------------
  //
  //   auto world = ddp::init_process_group();
  //   auto low = world->new_group({0, 1});                 // every rank calls it; ranks 2, 3 get a non-member
  //   auto row = world->split(world->rank() / 2);          // every rank gets the group of its colour
  //
  // Each subgroup has its own backend (Gloo over its own prefix of the
  // store, NCCL likewise, MPI_Comm_split under MPI), its own store prefix
  // and its own trace, so collectives on disjoint subgroups run at the same
  // time without mixing. Collectives on a subgroup take ranks of the
  // subgroup (a broadcast's root, a send's peer), as in torch.distributed.

  /// Passed to split() by a rank that joins no group (MPI_UNDEFINED).
  static constexpr int kNoColour = -1;

  /// A group of some of this group's ranks, like torch.distributed.new_group.
  /// Collective over this group: every rank calls it, in the same order among
  /// its other collectives, with the same `ranks` (ranks of this group, in
  /// any order; the new group's rank i is the i-th smallest). A rank not in
  /// `ranks` gets a group it is not a member of, which refuses collectives.
  /// A rank that never calls it is named by the stall report after the
  /// timeout, as for any collective.
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks);
  /// Splits this group by colour, like MPI_Comm_split: every rank passes its
  /// colour and gets the group of the ranks that passed the same one, ordered
  /// by `key`, then by rank in this group (`key` defaults to this rank).
  /// kNoColour gives a group this rank is not a member of. Collective over
  /// this group, as new_group.
  std::shared_ptr<ProcessGroup> split(int colour, std::optional<int> key = std::nullopt);

  /// Whether this process is one of the group's ranks.
  bool is_member() const;
  /// This process's rank in the world's group.
  int global_rank() const;
  /// The global ranks of the group's members, indexed by rank in the group.
  const std::vector<int>& global_ranks() const;
  /// The global rank of the member whose rank in this group is `group_rank`.
  int global_rank_of(int group_rank) const;
  /// The rank in this group of global rank `global_rank`, or -1 when it is
  /// not a member.
  int group_rank_of(int global_rank) const;
  /// "world", or for a subgroup its number among its parent's subgroups, in
  /// the order they were made (the same on every rank): "0", "1", nested "0.0".
  const std::string& name() const;

  /// This rank's record of its collectives (sequence numbers, tags, times).
  const CollectiveTrace& trace() const;
  /// After a collective failed or timed out: asks every rank that can still
  /// reach the store how far it got, and says which ranks are behind and in
  /// which collective, e.g. "rank 1 never entered collective #532
  /// (all_reduce, ddp bucket 2/3, 1.0 MiB); its last completed collective is
  /// #531 (...)". Also writes this rank's trace (trace_path()). Never throws.
  /// `cause` is the backend's error: when it says a peer's connection
  /// closed or reset (the peer is gone), nobody is asked and it returns at once.
  std::string explain_stall(const std::string& cause = "") const;
  /// Where this rank's trace goes as JSON lines: DDP_TRACE_DIR, else
  /// ddprun's --log-dir (DDP_LOG_DIR), else the snapshot directory last used;
  /// empty when none is known.
  std::string trace_path() const;
  /// Writes the trace to trace_path(); returns the path, or "" if none.
  std::string write_trace() const;

  // ---- More collectives (src/comm/process_group_collectives.cpp) ---------------
  //
  // The rest of torch.distributed's collectives, each traced and checked
  // like the ones above (a sequence number, a trace record, the
  // DDP_DEBUG=detail desync check), on Gloo, NCCL and MPI. Roots and peers
  // are ranks of this group; a rank outside it gets require_usable's error.
  // tests/python/collectives_reference.py runs the same calls in Python.

  /// Starts reducing every rank's `tensor` into `root`'s, in place there
  /// (torch.distributed.reduce). Elsewhere `tensor` may be changed.
  c10::intrusive_ptr<c10d::Work> reduce_async(at::Tensor& tensor, int root,
                                              c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// Reduces every rank's `tensor` into `root`'s, and waits.
  void reduce(at::Tensor& tensor, int root = 0, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// On `root`: every rank's `input`, indexed by rank (shapes must match).
  /// Elsewhere: an empty vector (torch.distributed.gather).
  std::vector<at::Tensor> gather(const at::Tensor& input, int root = 0);
  /// Starts sending `inputs[r]` from `root` to rank r's `output`
  /// (torch.distributed.scatter). `inputs` has size() tensors on the root,
  /// shaped like `output`, and is empty on every other rank. `output` must
  /// be contiguous.
  c10::intrusive_ptr<c10d::Work> scatter_async(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                               int root = 0);
  /// As scatter_async, and waits.
  void scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int root = 0);
  /// Starts an all-to-all along dimension 0, as
  /// torch.distributed.all_to_all_single: `input`'s rows are cut into
  /// size() consecutive chunks, of input_split_sizes[r] rows each (equal
  /// chunks when empty), chunk r going to rank r; `output` receives rank
  /// r's chunk for this rank at row sum(output_split_sizes[0..r)). Both
  /// contiguous, same dtype and row shape.
  c10::intrusive_ptr<c10d::Work> all_to_all_async(at::Tensor& output, at::Tensor& input,
                                                  std::vector<int64_t> output_split_sizes = {},
                                                  std::vector<int64_t> input_split_sizes = {});
  /// As all_to_all_async, and waits.
  void all_to_all(at::Tensor& output, at::Tensor& input, std::vector<int64_t> output_split_sizes = {},
                  std::vector<int64_t> input_split_sizes = {});
  /// Starts every send and receive of `ops` and returns their works, in the
  /// same order (torch.distributed.batch_isend_irecv). Each is traced as a
  /// send or recv, tagged "batch_isend_irecv"; not a collective, so only the
  /// peers named must take part.
  std::vector<c10::intrusive_ptr<c10d::Work>> batch_isend_irecv(std::vector<P2POp> ops);
  /// A barrier that names who is missing (torch.distributed.monitored_barrier):
  /// rank 0 waits up to `timeout` (the group's when not given) for every
  /// other rank to arrive, through the store (Gloo, NCCL) or point-to-point
  /// messages (MPI). If some did not, rank 0 throws an error naming the
  /// first missing rank, or every missing rank with `wait_all_ranks`, and
  /// tells the ranks that arrived, which throw naming them too. The others
  /// wait for rank 0's verdict up to `timeout` plus a grace of at most 5 s
  /// (rank 0 may arrive after them), then throw saying rank 0 gave none. No
  /// rank waits longer. Unlike the other collectives it has no desync check,
  /// which would wait for the missing ranks itself. A rank that skipped a
  /// failed monitored_barrier is one call behind the others: use a new
  /// group afterwards, as the error says.
  void monitored_barrier(std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                         bool wait_all_ranks = false);
  /// Copies `value` from `root` into every rank's `value`
  /// (torch.distributed.broadcast_object_list of one object). Strings,
  /// numbers, booleans, None, tensors (arriving on the CPU), lists, tuples
  /// and dicts keyed by strings or ints travel: serialised as torch.save
  /// does (checkpoint.h's serialize_value), the size broadcast first, then
  /// the bytes, and read back by the weights-only unpickler, so bytes from
  /// a peer can never run code.
  void broadcast_object(c10::IValue& value, int root = 0);
  /// Every rank's `value`, indexed by rank (torch.distributed.all_gather_object):
  /// the sizes are all-gathered first, then the bytes padded to the largest.
  /// The same values travel as for broadcast_object.
  std::vector<c10::IValue> all_gather_object(const c10::IValue& value);

 private:
  ProcessGroup();

  // Issues a broadcast that the trace records as `op` (broadcast_object).
  void broadcast_as(const char* op, at::Tensor& tensor, int root);

  // Every collective goes through these: a sequence number and trace record,
  // the desync check under DebugLevel::kDetail, and the record's end when
  // the work completes.
  uint64_t enter(const char* op, const at::Tensor& tensor);
  c10::intrusive_ptr<c10d::Work> track(uint64_t seq, c10::intrusive_ptr<c10d::Work> work);
  void check_in_sync(uint64_t seq, const char* op, const at::Tensor& tensor);
  // Answers another rank's explain_stall() from a thread of its own, so a
  // rank that is merely behind still says how far it got.
  void start_progress_responder();
  std::string describe_or_number(uint64_t seq) const;
  // Issues an all_gather that the trace records as `op` (new_group, split).
  std::vector<at::Tensor> all_gather_as(const char* op, const at::Tensor& tensor);
  // Throws unless collectives can run on this group: a member's, not shut down.
  void require_usable(const char* op) const;
  // After every rank's colour and key are known (new_group, split): the
  // subgroup of `members` (ranks of this group, in the new group's order),
  // or a non-member's group when this rank's colour is kNoColour.
  std::shared_ptr<ProcessGroup> make_subgroup(const char* op, const std::vector<int>& members, int colour, int key);
  // "rank 3 of 4" in the world; "rank 3 (rank 1 of 2 in process group 0, global ranks 2, 3)" in a subgroup.
  std::string where_am_i() const;
  // The global rank of `group_rank`, as a message names it: "rank 3".
  std::string rank_label(int group_rank) const;

  // Gloo's CPU reduce-scatter and all-gather (made on first use), which
  // talk through send_async and recv_async.
  bool uses_rings(const at::Tensor& tensor) const;
  c10::intrusive_ptr<c10d::Work> ring_reduce_scatter(at::Tensor& output, at::Tensor& input);
  c10::intrusive_ptr<c10d::Work> ring_all_gather(at::Tensor& output, at::Tensor& input);

  // What a group holds (backend, store, trace, rings, the thread that
  // answers other ranks' explain_stall) is the library's own, in
  // src/comm/process_group_impl.h, so that none of it is part of libddp's ABI.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Reads the world from the environment (see env.h) and creates its process
/// group. A one-process world gets a group of size 1, so the same program
/// runs alone or under a launcher.
DDP_API std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options = {});

}  // namespace ddp
