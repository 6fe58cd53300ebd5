#pragma once

// Internal, not API: what a ProcessGroup holds. process_group.cpp,
// process_group_collectives.cpp and collective_debug.cpp share it; the
// public header shows only a pointer to it, so none of it is part of
// libddp's ABI.

#include <ddp/collective_trace.h>
#include <ddp/env.h>
#include <ddp/process_group.h>

#include "comm/ring_collectives.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddp {

namespace detail {
struct ProgressResponder;  // collective_debug.cpp
}

struct ProcessGroup::Impl {
  bool member_ = true;
  int global_rank_ = 0;
  std::vector<int> global_ranks_;
  std::string name_ = "world";
  int subgroups_made_ = 0;

  std::shared_ptr<CollectiveTrace> trace_;
  bool tracing_ = true;
  std::shared_ptr<detail::ProgressResponder> responder_;

  World world_;
  ProcessGroupOptions options_;
  BackendKind backend_kind_ = BackendKind::kGloo;
  // c10d's asyncOp for a collective whose caller waits for it at once
  // (all_reduce, reduce, broadcast, barrier): false lets a backend that runs
  // collectives itself (shared memory) run it on the caller's thread instead
  // of handing it to its worker and being woken back. NCCL keeps asyncOp
  // true, its stream handling as before.
  bool async_op_when_waited() const { return backend_kind_ == BackendKind::kNccl; }
  // Each rank's host (shm_host_identity), by rank in this group, and whether
  // a subgroup whose ranks share a host gets shared memory: the backend was
  // left to ddp (kAuto on the CPU, DDP_SHM not 0).
  std::vector<std::string> hosts_;
  bool shm_allowed_ = false;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int64_t store_prefixes_issued_ = 0;
  at::TensorOptions control_options_;
  // How many monitored_barriers this rank has entered: their MPI tags.
  int64_t monitored_barriers_ = 0;

  // Gloo's CPU reduce-scatter and all-gather, made on first use; declared
  // last, so that they go first.
  std::mutex rings_mutex_;
  std::unique_ptr<detail::RingCollectives> reduce_scatter_ring_;
  std::unique_ptr<detail::RingCollectives> all_gather_ring_;
};

}  // namespace ddp
