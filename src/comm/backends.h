#pragma once

// Backend factories, one translation unit each, so that Gloo's and NCCL's
// headers are seen by exactly one file of ddp.

#include <ddp/env.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout);

/// An NCCL backend whose rank works on `device` (a CUDA device with an
/// index), which becomes the current device.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world, const c10::Device& device,
                                                    std::chrono::milliseconds timeout);

/// The shared-memory backend (backend_shm.cpp) over ranks of one host:
/// all-reduce, reduce, broadcast, all-gather, reduce-scatter and barrier
/// through one memfd segment; everything else goes to `fallback` (a Gloo
/// backend of the same ranks). `global_ranks` name the ranks in errors.
c10::intrusive_ptr<c10d::Backend> make_shm_backend(const c10::intrusive_ptr<c10d::Store>& store, const World& world,
                                                   std::vector<int> global_ranks, std::chrono::milliseconds timeout,
                                                   c10::intrusive_ptr<c10d::Backend> fallback);

/// What ranks on one host share, for the shared-memory choice: host name,
/// boot id, pid and network namespace (DDP_SHM_HOST_ID overrides it).
std::string shm_host_identity();

/// DDP_SHM: unset or "1" lets kAuto pick shared memory, "0" never.
bool shm_enabled_by_env();

/// Whether this build of ddp can create NCCL process groups.
bool nccl_available();

/// An MPI backend over a duplicate of MPI_COMM_WORLD. Checks that MPI's rank
/// and size are `world`'s and fills in its local rank and local world size
/// from the ranks sharing this node's memory (MPI_COMM_TYPE_SHARED).
c10::intrusive_ptr<c10d::Backend> make_mpi_backend(World& world, std::chrono::milliseconds timeout);

/// A subgroup's MPI backend: MPI_Comm_split of `parent`'s communicator (an
/// mpi backend's), collective over it, on the progress thread after the
/// collectives already issued. `colour` < 0 joins no group (MPI_UNDEFINED)
/// and gives a null backend; ranks of one colour are ordered by `key`.
c10::intrusive_ptr<c10d::Backend> split_mpi_backend(const c10::intrusive_ptr<c10d::Backend>& parent, int colour,
                                                    int key, std::chrono::milliseconds timeout);

/// Whether this build of ddp can create MPI process groups.
bool mpi_available();

/// ProcessGroup::monitored_barrier over an mpi backend's point-to-point
/// messages, on its progress thread after what was issued before. On rank
/// 0: waits until `deadline` for a message from every other rank, tells
/// those that arrived which did not, and returns those (the first only
/// unless `wait_all_ranks`). Elsewhere: sends its own, then waits until
/// `verdict_deadline` for rank 0's list and returns it, or nullopt if none
/// came. `call` numbers the barrier among the group's (its messages' tag).
std::optional<std::vector<int>> mpi_monitored_barrier(const c10::intrusive_ptr<c10d::Backend>& backend, int64_t call,
                                                      std::chrono::steady_clock::time_point deadline,
                                                      std::chrono::steady_clock::time_point verdict_deadline,
                                                      bool wait_all_ranks);

}  // namespace ddp::detail
