#pragma once

// Internal, not API: how the ranks of a job meet in a file (init_method
// file:///path), for ProcessGroup::create. Like rendezvous.h, it knows
// nothing of ProcessGroup: it returns the store the group keeps.
//
//   auto store = file_rendezvous(world, "/shared/job.store", run_id, timeout);

#include <ddp/env.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace ddp::detail {

// Opens a store in a c10d FileStore's file (its format, read with every
// length checked) at `path` for world.world_size ranks and meets the
// other ranks there (FileMeeting in file_rendezvous.cpp): one process per
// rank, one world size and run id, every rank arrived; all within `timeout`.
// Returns the store for this job's keys.
//
// Throws a ddp::Error that names the file when its directory is missing or
// not writable, when it is not a store file, or when it is stale: left by an
// earlier run that crashed or did not shut its group down, or in use by
// another job. Every rank of the job then fails with that message.
//
// The file is removed, as c10d does, when the last store of the job is
// destroyed (every rank shut its process group down). A rank that dies
// leaves it, and so does a failed start (its FileStore is never destroyed:
// see file_rendezvous.cpp); the next run that names it fails as above.
c10::intrusive_ptr<c10d::Store> file_rendezvous(const World& world, const std::string& path,
                                                const std::string& run_id, std::chrono::milliseconds timeout);

}  // namespace ddp::detail
