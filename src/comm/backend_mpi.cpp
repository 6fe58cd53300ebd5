// MPI process groups: c10d's collectives as MPI calls. Compiled with MPI
// when CMake finds it (DDP_WITH_MPI); otherwise every entry point says how
// to get it.
//
// Execution: MPI calls run on the one progress thread of mpi_runtime.h, in
// the order the collectives were issued, so work returns at once and DDP's
// buckets overlap backward as they do over Gloo. The exception is a small
// collective issued while that thread is idle: the caller runs it itself,
// since waking the thread and being woken back costs more than the call.
// Point-to-point transfers are posted non-blocking (a blocking send would
// wait for the peer's receive, which may sit behind a send of its own) and
// completed by polling between jobs. MPI has no timeouts: the runtime's
// watchdog ends the whole job with MPI_Abort, after naming the collective,
// when one runs longer than the process group's timeout, so mpirun tears
// every rank down.
#include <ddp/error.h>

#include "comm/backends.h"
#include "comm/threaded_work.h"

#ifdef DDP_WITH_MPI
#include "comm/mpi_runtime.h"

#include <ATen/Functions.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#endif

#include <chrono>
#include <string>

namespace ddp::detail {

#ifdef DDP_WITH_MPI
namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

// A collective's handle, finished by the progress thread.
class MpiWork final : public ThreadedWork {
 public:
  using ThreadedWork::ThreadedWork;

 protected:
  // The watchdog ends the job when a collective overruns; this bound only
  // keeps a caller from waiting past it should the abort stall.
  std::chrono::milliseconds grace_after_timeout() const override { return std::chrono::seconds(10); }
  [[noreturn]] void throw_overrun(std::chrono::milliseconds timeout) const override {
    DDP_CHECK(false, "ddp: an MPI collective did not finish within ", timeout.count(), " ms");
    std::abort();  // not reached
  }
};

// How a dtype travels. Float16 and BFloat16 have no MPI type: reductions run
// in float32 (then round back), and moves send their bits as uint16.
struct WireType {
  MPI_Datatype type;
  bool reduce_in_float32;
};

WireType wire_type(at::ScalarType dtype, bool reduces) {
  switch (dtype) {
    case at::kFloat: return {MPI_FLOAT, false};
    case at::kDouble: return {MPI_DOUBLE, false};
    case at::kLong: return {MPI_INT64_T, false};
    case at::kInt: return {MPI_INT32_T, false};
    case at::kShort: return {MPI_INT16_T, false};
    case at::kChar: return {MPI_INT8_T, false};
    case at::kByte: return {MPI_UINT8_T, false};
    case at::kBool: return {MPI_C_BOOL, false};
    case at::kHalf:
    case at::kBFloat16: return {reduces ? MPI_FLOAT : MPI_UINT16_T, reduces};
    default: break;
  }
  DDP_CHECK(false, "ddp: the mpi backend cannot send ", dtype, " tensors; it supports float32, float64, float16, ",
            "bfloat16, int64, int32, int16, int8, uint8 and bool");
}

MPI_Op mpi_op(const c10d::ReduceOp& op, at::ScalarType dtype) {
  const bool integral = c10::isIntegralType(dtype, /*includeBool=*/true);
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: return dtype == at::kBool ? MPI_LOR : MPI_SUM;
    case c10d::ReduceOp::PRODUCT: return dtype == at::kBool ? MPI_LAND : MPI_PROD;
    case c10d::ReduceOp::MIN: return dtype == at::kBool ? MPI_LAND : MPI_MIN;
    case c10d::ReduceOp::MAX: return dtype == at::kBool ? MPI_LOR : MPI_MAX;
    case c10d::ReduceOp::BAND:
      DDP_CHECK(integral, "ddp: the mpi backend's BAND needs an integer tensor, got ", dtype);
      return MPI_BAND;
    case c10d::ReduceOp::BOR:
      DDP_CHECK(integral, "ddp: the mpi backend's BOR needs an integer tensor, got ", dtype);
      return MPI_BOR;
    case c10d::ReduceOp::BXOR:
      DDP_CHECK(integral, "ddp: the mpi backend's BXOR needs an integer tensor, got ", dtype);
      return MPI_BXOR;
    default: break;
  }
  DDP_CHECK(false, "ddp: the mpi backend does not support reduce op ", static_cast<int>(op.op_),
            " (PREMUL_SUM); use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR");
}

void check_mpi(int rc, const char* call) {
  DDP_CHECK(rc == MPI_SUCCESS, "ddp: ", call, " failed: ", mpi_error_text(rc));
}

class MpiBackend : public c10d::Backend {
 public:
  MpiBackend(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), comm_(comm), timeout_(timeout) {
    // Blocking all-reduces on the progress thread by default: bench/RESULTS.md
    // measures both (DDP_MPI_NONBLOCKING=1 posts MPI_Iallreduce instead).
    const char* nonblocking = std::getenv("DDP_MPI_NONBLOCKING");
    nonblocking_ = nonblocking && std::string(nonblocking) == "1";
    // Collectives this small run on the caller's thread when the progress
    // thread is idle (MpiRuntime::try_run_here): the hand-off to that
    // thread and back cost 12-16 us, several times a 4 KB MPI_Allreduce.
    // Larger ones keep to the progress thread so that DDP's backward goes
    // on while they travel. DDP_MPI_INLINE_BYTES=0 turns this off
    // (bench/run_bench.py --only-collectives measures both).
    if (const char* limit = std::getenv("DDP_MPI_INLINE_BYTES")) {
      run_here_max_bytes_ = std::stoll(limit);
    }
  }

  ~MpiBackend() override {
    MPI_Comm comm = comm_;
    MpiRuntime::get().enqueue([comm]() mutable {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Comm_free(&comm);
    });
  }

  const std::string getBackendName() const override { return "mpi"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    at::Tensor tensor = single(tensors, "all_reduce");
    const auto op = opts.reduceOp;
    MPI_Op mpi = mpi_op(op, tensor.scalar_type());
    WireType wire = wire_type(tensor.scalar_type(), /*reduces=*/true);
    const int world = size_;
    if (nonblocking_) {
      // MPI_Iallreduce, completed by the progress thread's polling: several
      // buckets can be in flight at once.
      auto staged = std::make_shared<at::Tensor>();
      return launch_p2p(
          c10d::OpType::ALLREDUCE, tensor, "all_reduce",
          [=, comm = comm_](MPI_Request* request) {
            *staged = wire.reduce_in_float32 ? tensor.to(at::kFloat) : tensor.contiguous();
            return MPI_Iallreduce(MPI_IN_PLACE, staged->data_ptr(), count(*staged), wire.type, mpi, comm, request);
          },
          [=]() mutable {
            if (op.op_ == c10d::ReduceOp::AVG) staged->div_(world);
            if (!staged->is_same(tensor)) tensor.copy_(*staged);
          });
    }
    return launch(c10d::OpType::ALLREDUCE, {tensor}, "all_reduce", [=, comm = comm_]() mutable {
      at::Tensor work = wire.reduce_in_float32 ? tensor.to(at::kFloat) : tensor.contiguous();
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, work.data_ptr(), count(work), wire.type, mpi, comm), "MPI_Allreduce");
      if (op.op_ == c10d::ReduceOp::AVG) work.div_(world);
      if (!work.is_same(tensor)) tensor.copy_(work);
    });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    at::Tensor tensor = single(tensors, "broadcast");
    WireType wire = wire_type(tensor.scalar_type(), false);
    const int root = static_cast<int>(opts.rootRank);
    return launch(c10d::OpType::BROADCAST, {tensor}, "broadcast", [=, comm = comm_]() mutable {
      at::Tensor work = tensor.contiguous();
      check_mpi(MPI_Bcast(work.data_ptr(), count(work), wire.type, root, comm), "MPI_Bcast");
      if (!work.is_same(tensor)) tensor.copy_(work);
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    at::Tensor input = single(inputs, "all_gather");
    DDP_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
              "ddp: the mpi backend's all_gather needs one list of ", size_, " output tensors");
    std::vector<at::Tensor> targets = outputs[0];
    WireType wire = wire_type(input.scalar_type(), false);
    const int world = size_;
    return launch(c10d::OpType::ALLGATHER, targets, "all_gather", [=, comm = comm_]() mutable {
      at::Tensor send = input.contiguous();
      at::Tensor flat = at::empty({world * send.numel()}, send.options());
      check_mpi(MPI_Allgather(send.data_ptr(), count(send), wire.type, flat.data_ptr(), count(send), wire.type, comm),
                "MPI_Allgather");
      for (int r = 0; r < world; ++r) {
        targets[r].copy_(flat.narrow(0, r * send.numel(), send.numel()).view(targets[r].sizes()));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    DDP_CHECK(output.is_contiguous() && output.numel() == input.numel() * size_,
              "ddp: the mpi backend's all_gather_into needs a contiguous output of ", size_, " x ", input.numel(),
              " elements");
    WireType wire = wire_type(input.scalar_type(), false);
    at::Tensor out = output;
    at::Tensor in = input;
    return launch(c10d::OpType::_ALLGATHER_BASE, {out}, "all_gather", [=, comm = comm_]() mutable {
      at::Tensor send = in.contiguous();
      check_mpi(MPI_Allgather(send.data_ptr(), count(send), wire.type, out.data_ptr(), count(send), wire.type, comm),
                "MPI_Allgather");
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    DDP_CHECK(input.numel() == output.numel() * size_, "ddp: the mpi backend's reduce_scatter needs an input of ",
              size_, " x ", output.numel(), " elements");
    const auto op = opts.reduceOp;
    MPI_Op mpi = mpi_op(op, input.scalar_type());
    WireType wire = wire_type(input.scalar_type(), true);
    at::Tensor out = output;
    at::Tensor in = input;
    const int world = size_;
    return launch(c10d::OpType::_REDUCE_SCATTER_BASE, {out}, "reduce_scatter", [=, comm = comm_]() mutable {
      at::Tensor send = wire.reduce_in_float32 ? in.to(at::kFloat) : in.contiguous();
      at::Tensor recv = (wire.reduce_in_float32 || !out.is_contiguous()) ? at::empty(out.sizes(), send.options()) : out;
      check_mpi(MPI_Reduce_scatter_block(send.data_ptr(), recv.data_ptr(), count(recv), wire.type, mpi, comm),
                "MPI_Reduce_scatter_block");
      if (op.op_ == c10d::ReduceOp::AVG) recv.div_(world);
      if (!recv.is_same(out)) out.copy_(recv);
    });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int to, int tag) override {
    at::Tensor tensor = single(tensors, "send").contiguous();
    WireType wire = wire_type(tensor.scalar_type(), false);
    return launch_p2p(c10d::OpType::SEND, tensor, "send", [=, comm = comm_](MPI_Request* request) mutable {
      return MPI_Isend(tensor.data_ptr(), count(tensor), wire.type, to, tag, comm, request);
    });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int from, int tag) override {
    at::Tensor tensor = single(tensors, "recv");
    DDP_CHECK(tensor.is_contiguous(), "ddp: the mpi backend receives into contiguous tensors only");
    WireType wire = wire_type(tensor.scalar_type(), false);
    return launch_p2p(c10d::OpType::RECV, tensor, "recv", [=, comm = comm_](MPI_Request* request) mutable {
      return MPI_Irecv(tensor.data_ptr(), count(tensor), wire.type, from, tag, comm, request);
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return launch(c10d::OpType::BARRIER, {}, "barrier",
                  [comm = comm_] { check_mpi(MPI_Barrier(comm), "MPI_Barrier"); });
  }

  // MPI_Comm_split on the progress thread, in order after the collectives
  // already issued; blocks until it has run. Guarded by the watchdog like a
  // collective, since a rank that never calls it holds the others there.
  c10::intrusive_ptr<c10d::Backend> split(int colour, int key, std::chrono::milliseconds timeout) {
    ++issued_;
    auto& runtime = MpiRuntime::get();
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0, size = 0;
    const uint64_t id = runtime.next_id();
    runtime.watch(id, describe("MPI_Comm_split (making a subgroup)"), timeout);
    try {
      runtime.run_now([&, parent = comm_] {
        check_mpi(MPI_Comm_split(parent, colour < 0 ? MPI_UNDEFINED : colour, key, &comm), "MPI_Comm_split");
        if (comm != MPI_COMM_NULL) {
          MPI_Comm_rank(comm, &rank);
          MPI_Comm_size(comm, &size);
        }
      });
    } catch (...) {
      runtime.unwatch(id);
      throw;
    }
    runtime.unwatch(id);
    if (comm == MPI_COMM_NULL) return {};
    return c10::make_intrusive<MpiBackend>(comm, rank, size, timeout);
  }

  // ---- reduce, gather, scatter, all_to_all, monitored_barrier ------------
  // (ProcessGroup's methods of process_group_collectives.cpp; the
  // conventions are Gloo's: gather's outputs and scatter's inputs exist on
  // the root only.)

  using BarrierClock = std::chrono::steady_clock;

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    at::Tensor tensor = single(tensors, "reduce");
    const int root = root_of(opts.rootRank, "reduce");
    const auto op = opts.reduceOp;
    MPI_Op mpi = mpi_op(op, tensor.scalar_type());
    WireType wire = wire_type(tensor.scalar_type(), /*reduces=*/true);
    const int world = size_;
    const bool at_root = rank_ == root;
    return launch(c10d::OpType::REDUCE, {tensor}, "reduce", [=, comm = comm_]() mutable {
      at::Tensor work = wire.reduce_in_float32 ? tensor.to(at::kFloat) : tensor.contiguous();
      if (!at_root) {
        check_mpi(MPI_Reduce(work.data_ptr(), nullptr, count(work), wire.type, mpi, root, comm), "MPI_Reduce");
        return;
      }
      check_mpi(MPI_Reduce(MPI_IN_PLACE, work.data_ptr(), count(work), wire.type, mpi, root, comm), "MPI_Reduce");
      if (op.op_ == c10d::ReduceOp::AVG) work.div_(world);
      if (!work.is_same(tensor)) tensor.copy_(work);
    });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    at::Tensor input = single(inputs, "gather");
    const int root = root_of(opts.rootRank, "gather");
    const bool at_root = rank_ == root;
    std::vector<at::Tensor> targets;
    if (at_root) {
      DDP_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                "ddp: the mpi backend's gather needs, on its root, one list of ", size_, " output tensors");
      targets = outputs[0];
      for (const at::Tensor& t : targets) {
        DDP_CHECK(t.is_cpu() && t.numel() == input.numel() && t.scalar_type() == input.scalar_type(),
                  "ddp: the mpi backend's gather needs CPU outputs of the input's dtype and size");
      }
    } else {
      DDP_CHECK(outputs.empty(), "ddp: the mpi backend's gather takes no outputs on a rank other than its root");
    }
    WireType wire = wire_type(input.scalar_type(), false);
    const int world = size_;
    return launch(c10d::OpType::GATHER, targets, "gather", [=, comm = comm_]() mutable {
      at::Tensor send = input.contiguous();
      at::Tensor flat = at_root ? at::empty({world * send.numel()}, send.options()) : at::Tensor();
      check_mpi(MPI_Gather(send.data_ptr(), count(send), wire.type, at_root ? flat.data_ptr() : nullptr, count(send),
                           wire.type, root, comm),
                "MPI_Gather");
      if (!at_root) return;
      for (int r = 0; r < world; ++r) {
        targets[r].copy_(flat.narrow(0, r * send.numel(), send.numel()).view(targets[r].sizes()));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    at::Tensor output = single(outputs, "scatter");
    const int root = root_of(opts.rootRank, "scatter");
    const bool at_root = rank_ == root;
    std::vector<at::Tensor> sources;
    if (at_root) {
      DDP_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                "ddp: the mpi backend's scatter needs, on its root, one list of ", size_, " input tensors");
      for (const at::Tensor& t : inputs[0]) {
        DDP_CHECK(t.is_cpu() && t.numel() == output.numel() && t.scalar_type() == output.scalar_type(),
                  "ddp: the mpi backend's scatter needs CPU inputs of the output's dtype and size");
        sources.push_back(t.reshape({-1}));
      }
    } else {
      DDP_CHECK(inputs.empty(), "ddp: the mpi backend's scatter takes no inputs on a rank other than its root");
    }
    WireType wire = wire_type(output.scalar_type(), false);
    return launch(c10d::OpType::SCATTER, {output}, "scatter", [=, comm = comm_]() mutable {
      at::Tensor flat = at_root ? at::cat(sources) : at::Tensor();
      at::Tensor recv = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
      check_mpi(MPI_Scatter(at_root ? flat.data_ptr() : nullptr, count(recv), wire.type, recv.data_ptr(), count(recv),
                            wire.type, root, comm),
                "MPI_Scatter");
      if (!recv.is_same(output)) output.copy_(recv);
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
    DDP_CHECK(input.is_cpu() && output.is_cpu(), "ddp: the mpi backend's all_to_all moves CPU tensors only");
    DDP_CHECK(output.is_contiguous() && input.scalar_type() == output.scalar_type(),
              "ddp: the mpi backend's all_to_all needs a contiguous output of the input's dtype");
    WireType wire = wire_type(input.scalar_type(), false);
    const Layout send = layout(input, input_split_sizes, "input");
    const Layout recv = layout(output, output_split_sizes, "output");
    at::Tensor in = input;
    at::Tensor out = output;
    return launch(c10d::OpType::ALLTOALL_BASE, {out}, "all_to_all", [=, comm = comm_]() mutable {
      at::Tensor source = in.contiguous();
      check_mpi(MPI_Alltoallv(source.data_ptr(), send.counts.data(), send.displs.data(), wire.type, out.data_ptr(),
                              recv.counts.data(), recv.displs.data(), wire.type, comm),
                "MPI_Alltoallv");
    });
  }

  // ProcessGroup::monitored_barrier: on the progress thread, after the
  // operations issued before it, rank 0 posts a receive for every other
  // rank's token and polls them until `deadline`, cancels those that did not
  // come, and sends each rank that arrived the list of those that did not;
  // the others send their token and poll for that list until
  // `verdict_deadline`. Nothing stays posted past its deadline but sends of
  // a few bytes, which MPI delivers eagerly. Tags count down from MPI_TAG_UB,
  // far from the tags programs use.
  std::optional<std::vector<int>> monitored_barrier(int64_t call, BarrierClock::time_point deadline,
                                                    BarrierClock::time_point verdict_deadline, bool wait_all_ranks) {
    ++issued_;
    auto result = std::make_shared<std::optional<std::vector<int>>>();
    const int rank = rank_, size = size_;
    auto job = [=, comm = comm_] {
      int* upper = nullptr;
      int found = 0;
      MPI_Comm_get_attr(comm, MPI_TAG_UB, &upper, &found);
      const int tag = (found && upper ? *upper : 32767) - static_cast<int>(call % 1024);
      *result = rank == 0 ? std::optional<std::vector<int>>(collect_arrivals(comm, size, tag, deadline, wait_all_ranks))
                          : await_verdict(comm, size, tag, verdict_deadline);
    };
    // A progress thread still busy with earlier operations must not hold
    // this rank past the deadlines either.
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(verdict_deadline - BarrierClock::now()) +
                       std::chrono::seconds(2);
    DDP_CHECK(MpiRuntime::get().run_now(job, std::max<std::chrono::milliseconds>(limit, std::chrono::seconds(2))),
              "ddp: monitored_barrier could not start on rank ", rank_, " of ", size_, " (mpi): this rank's earlier ",
              "MPI operations had not finished by its deadline");
    return *result;
  }

 private:
  struct Layout {
    std::vector<int> counts, displs;  // elements, per rank
  };

  // all_to_all's counts and displacements for `tensor`, cut along its first
  // dimension by `splits` (equal parts when empty).
  Layout layout(const at::Tensor& tensor, const std::vector<int64_t>& splits, const char* which) const {
    DDP_CHECK(tensor.dim() >= 1, "ddp: the mpi backend's all_to_all needs an ", which, " of at least one dimension");
    int64_t row = 1;
    for (int64_t d = 1; d < tensor.dim(); ++d) row *= tensor.size(d);
    const int64_t rows = tensor.size(0);
    std::vector<int64_t> parts = splits;
    if (parts.empty()) {
      DDP_CHECK(rows % size_ == 0, "ddp: all_to_all's ", which, " has ", rows, " rows, not a multiple of ", size_);
      parts.assign(size_, rows / size_);
    }
    DDP_CHECK(static_cast<int>(parts.size()) == size_, "ddp: all_to_all's ", which, " split sizes need ", size_,
              " entries, got ", parts.size());
    Layout out;
    int64_t offset = 0;
    for (int64_t part : parts) {
      DDP_CHECK(part >= 0 && (offset + part) * row <= std::numeric_limits<int>::max(),
                "ddp: the mpi backend's all_to_all moves at most 2^31 - 1 elements per tensor; its ", which,
                " split sizes are negative or too large");
      out.counts.push_back(static_cast<int>(part * row));
      out.displs.push_back(static_cast<int>(offset * row));
      offset += part;
    }
    DDP_CHECK(offset == rows, "ddp: all_to_all's ", which, " split sizes add up to ", offset, ", not its ", rows,
              " rows");
    return out;
  }

  int root_of(int64_t root, const char* what) const {
    DDP_CHECK(root >= 0 && root < size_, "ddp: the mpi backend's ", what, " was given root ", root,
              ", but the group has ranks 0 to ", size_ - 1);
    return static_cast<int>(root);
  }

  // Rank 0's side of monitored_barrier; returns the ranks that did not
  // arrive (only the first unless `wait_all_ranks`).
  static std::vector<int> collect_arrivals(MPI_Comm comm, int size, int tag, BarrierClock::time_point deadline,
                                           bool wait_all_ranks) {
    std::vector<int> tokens(size, 0);
    std::vector<MPI_Request> requests(size, MPI_REQUEST_NULL);
    std::vector<bool> arrived(size, false);
    arrived[0] = true;
    for (int r = 1; r < size; ++r) {
      check_mpi(MPI_Irecv(&tokens[r], 1, MPI_INT, r, tag, comm, &requests[r]), "MPI_Irecv");
    }
    for (;;) {
      bool all = true;
      for (int r = 1; r < size; ++r) {
        if (arrived[r]) continue;
        int done = 0;
        MPI_Test(&requests[r], &done, MPI_STATUS_IGNORE);
        arrived[r] = done != 0;
        all = all && arrived[r];
      }
      if (all || BarrierClock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::vector<int> missing;
    for (int r = 1; r < size; ++r) {
      if (arrived[r]) continue;
      MPI_Cancel(&requests[r]);
      MPI_Status status;
      MPI_Wait(&requests[r], &status);
      int cancelled = 0;
      MPI_Test_cancelled(&status, &cancelled);
      arrived[r] = cancelled == 0;  // it came just as the deadline passed
      if (!arrived[r]) missing.push_back(r);
    }
    if (!missing.empty() && !wait_all_ranks) missing.resize(1);
    // [how many, ranks...]; kept alive until every send is done, or leaked
    // (a few bytes, after a failure) if one is not done within a second.
    auto* verdict = new std::vector<int>(size, -1);
    (*verdict)[0] = static_cast<int>(missing.size());
    std::copy(missing.begin(), missing.end(), verdict->begin() + 1);
    std::vector<MPI_Request> sends;
    for (int r = 1; r < size; ++r) {
      if (!arrived[r]) continue;
      sends.emplace_back();
      check_mpi(MPI_Isend(verdict->data(), size, MPI_INT, r, tag, comm, &sends.back()), "MPI_Isend");
    }
    const auto give_up = BarrierClock::now() + std::chrono::seconds(1);
    int done = 0;
    for (;;) {
      MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE);
      if (done || BarrierClock::now() >= give_up) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (done) {
      delete verdict;
    } else {
      for (MPI_Request& send : sends) {
        if (send != MPI_REQUEST_NULL) MPI_Request_free(&send);
      }
    }
    return missing;
  }

  // The other ranks' side: the missing ranks rank 0 names, or nullopt when
  // its verdict did not come by `deadline`.
  static std::optional<std::vector<int>> await_verdict(MPI_Comm comm, int size, int tag,
                                                       BarrierClock::time_point deadline) {
    static const int kToken = 1;
    std::vector<int> verdict(size, -1);
    MPI_Request send = MPI_REQUEST_NULL, recv = MPI_REQUEST_NULL;
    check_mpi(MPI_Isend(&kToken, 1, MPI_INT, 0, tag, comm, &send), "MPI_Isend");
    check_mpi(MPI_Irecv(verdict.data(), size, MPI_INT, 0, tag, comm, &recv), "MPI_Irecv");
    int got = 0;
    for (;;) {
      MPI_Test(&recv, &got, MPI_STATUS_IGNORE);
      if (got || BarrierClock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!got) {
      MPI_Cancel(&recv);
      MPI_Status status;
      MPI_Wait(&recv, &status);
      int cancelled = 0;
      MPI_Test_cancelled(&status, &cancelled);
      got = cancelled == 0;
    }
    int sent = 0;
    MPI_Test(&send, &sent, MPI_STATUS_IGNORE);
    if (!sent) MPI_Request_free(&send);  // kToken is static: MPI may finish it whenever
    if (!got) return std::nullopt;
    const int named = std::clamp(verdict[0], 0, size - 1);
    return std::vector<int>(verdict.begin() + 1, verdict.begin() + 1 + named);
  }

 public:

 private:
  static int count(const at::Tensor& t) {
    DDP_CHECK(t.numel() <= std::numeric_limits<int>::max(), "ddp: the mpi backend moves at most 2^31 - 1 ",
              "elements per collective; got ", t.numel(), ". Use smaller buckets (DDPOptions::bucket_cap_mb)");
    return static_cast<int>(t.numel());
  }

  at::Tensor single(std::vector<at::Tensor>& tensors, const char* what) const {
    DDP_CHECK(tensors.size() == 1, "ddp: the mpi backend's ", what, " takes one tensor, got ", tensors.size());
    DDP_CHECK(tensors[0].is_cpu(), "ddp: the mpi backend's ", what, " got a ", tensors[0].device().str(),
              " tensor; this MPI is not CUDA-aware for ddp, so only CPU tensors travel (use nccl for GPUs)");
    return tensors[0];
  }

  MpiRuntime::CollectiveName name_of(const char* what) const { return {what, issued_, rank_, size_}; }
  std::string describe(const char* what) const { return name_of(what).text(); }

  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, std::vector<at::Tensor> outputs, const char* what,
                                        std::function<void()> body) {
    ++issued_;
    int64_t bytes = 0;
    for (const at::Tensor& t : outputs) bytes += static_cast<int64_t>(t.nbytes());
    auto work = c10::make_intrusive<MpiWork>(rank_, type, std::move(outputs));
    const MpiRuntime::CollectiveName name = name_of(what);
    const auto timeout = timeout_;
    auto execute = [](MpiWork& work, const std::function<void()>& body, const MpiRuntime::CollectiveName& name,
                      std::chrono::milliseconds timeout) {
      auto& runtime = MpiRuntime::get();
      const uint64_t id = runtime.next_id();
      runtime.watch(id, name, timeout);
      std::exception_ptr error;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      runtime.unwatch(id);
      work.finish(error);
    };
    auto& runtime = MpiRuntime::get();
    // Here: nothing is copied to the heap for the job (std::ref fits in
    // std::function's own storage).
    auto here = [&] { execute(*work, body, name, timeout); };
    if (bytes <= run_here_max_bytes_ && runtime.try_run_here(std::ref(here))) return work;
    runtime.enqueue([work, body = std::move(body), name, timeout, execute] { execute(*work, body, name, timeout); });
    return work;
  }

  c10::intrusive_ptr<c10d::Work> launch_p2p(c10d::OpType type, at::Tensor tensor, const char* what,
                                            std::function<int(MPI_Request*)> post,
                                            std::function<void()> after = nullptr) {
    ++issued_;
    auto work = c10::make_intrusive<MpiWork>(rank_, type, std::vector<at::Tensor>{tensor});
    std::string label = describe(what);
    const auto timeout = timeout_;
    MpiRuntime::get().enqueue([work, post = std::move(post), after = std::move(after), label, timeout] {
      auto& runtime = MpiRuntime::get();
      MPI_Request request;
      int rc = MPI_SUCCESS;
      try {
        rc = post(&request);
      } catch (...) {
        work->finish(std::current_exception());
        return;
      }
      if (rc != MPI_SUCCESS) {
        work->finish(std::make_exception_ptr(
            Error(c10::str("ddp: ", label, " could not start: ", mpi_error_text(rc)))));
        return;
      }
      const uint64_t id = runtime.next_id();
      runtime.watch(id, label, timeout);
      runtime.add_pending(request, [work, label, id, after](int status) {
        MpiRuntime::get().unwatch(id);
        if (status != MPI_SUCCESS) {
          work->finish(std::make_exception_ptr(Error(c10::str("ddp: ", label, " failed: ", mpi_error_text(status)))));
          return;
        }
        std::exception_ptr error;
        try {
          if (after) after();
        } catch (...) {
          error = std::current_exception();
        }
        work->finish(error);
      });
    });
    return work;
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  bool nonblocking_ = false;
  int64_t run_here_max_bytes_ = 64 << 10;
  int64_t issued_ = 0;
};

bool started_by_mpi_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS",
                           "MV2_COMM_WORLD_SIZE"}) {
    if (std::getenv(name)) return true;
  }
  return false;
}

}  // namespace

bool mpi_available() { return true; }

c10::intrusive_ptr<c10d::Backend> make_mpi_backend(World& world, std::chrono::milliseconds timeout) {
  DDP_CHECK(started_by_mpi_launcher() || world.world_size == 1, "ddp: the mpi backend needs ranks started by an ",
            "MPI launcher (mpirun -np ", world.world_size, " ..., or srun --mpi=pmix), but this process of a ",
            world.world_size, "-rank job was not (no OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_SIZE). Launch it with ",
            "mpirun, or use --backend gloo under ddprun or torchrun.");
  auto& runtime = MpiRuntime::get(timeout);
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0, local_rank = 0, local_size = 0;
  // Collective over every rank of the launch: guarded as a collective is.
  const uint64_t setup_id = runtime.next_id();
  runtime.watch(setup_id, "MPI_Comm_dup of MPI_COMM_WORLD (the process group's set-up)", timeout);
  runtime.run_now([&] {
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    // The ranks sharing this node's memory: local rank and local size.
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
  });
  runtime.unwatch(setup_id);
  DDP_CHECK(size == world.world_size && rank == world.rank, "ddp: MPI says this is rank ", rank, " of ", size,
            " but the environment says rank ", world.rank, " of ", world.world_size,
            ". Start every rank with the same MPI launcher and no leftover RANK/WORLD_SIZE variables.");
  world.local_rank = local_rank;
  world.local_world_size = local_size;
  return c10::make_intrusive<MpiBackend>(comm, rank, size, timeout);
}

c10::intrusive_ptr<c10d::Backend> split_mpi_backend(const c10::intrusive_ptr<c10d::Backend>& parent, int colour,
                                                    int key, std::chrono::milliseconds timeout) {
  auto* mpi = dynamic_cast<MpiBackend*>(parent.get());
  DDP_CHECK(mpi != nullptr, "ddp: a subgroup of an mpi process group needs its mpi backend, got ",
            parent ? parent->getBackendName() : std::string("none"));
  return mpi->split(colour, key, timeout);
}

std::optional<std::vector<int>> mpi_monitored_barrier(const c10::intrusive_ptr<c10d::Backend>& backend, int64_t call,
                                                      std::chrono::steady_clock::time_point deadline,
                                                      std::chrono::steady_clock::time_point verdict_deadline,
                                                      bool wait_all_ranks) {
  auto* mpi = dynamic_cast<MpiBackend*>(backend.get());
  DDP_CHECK(mpi != nullptr, "ddp: monitored_barrier on an mpi process group needs its mpi backend, got ",
            backend ? backend->getBackendName() : std::string("none"));
  return mpi->monitored_barrier(call, deadline, verdict_deadline, wait_all_ranks);
}

#else

bool mpi_available() { return false; }

c10::intrusive_ptr<c10d::Backend> split_mpi_backend(const c10::intrusive_ptr<c10d::Backend>&, int, int,
                                                    std::chrono::milliseconds) {
  DDP_CHECK(false, "ddp: this build of ddp has no MPI support, so it has no mpi process group to split");
}

std::optional<std::vector<int>> mpi_monitored_barrier(const c10::intrusive_ptr<c10d::Backend>&, int64_t,
                                                      std::chrono::steady_clock::time_point,
                                                      std::chrono::steady_clock::time_point, bool) {
  DDP_CHECK(false, "ddp: this build of ddp has no MPI support, so it has no mpi process group");
}

c10::intrusive_ptr<c10d::Backend> make_mpi_backend(World&, std::chrono::milliseconds) {
  DDP_CHECK(false, "ddp: this build of ddp has no MPI support (no MPI was found when it was configured). ",
            "Install Open MPI's headers (apt-get install libopenmpi-dev; scripts/setup.sh does) and rebuild, or ",
            "use the gloo backend.");
}

#endif

}  // namespace ddp::detail
