#pragma once

// Internal: the hierarchical all-reduce hook over two groups given directly,
// for DistributedDataParallel's own choice (distributed_data_parallel.cpp),
// which groups the ranks by host rather than by a 2-D mesh, so hosts may hold
// different numbers of ranks.

#include <ddp/comm_hooks.h>
#include <ddp/process_group.h>

#include <memory>

namespace ddp::detail {

/// Reduces each bucket over `node` to its rank 0 (this host's leader),
/// all-reduces between the leaders over `leaders` (null on the other ranks),
/// and broadcasts back over `node`. `world_size` is DDP's group's size.
std::shared_ptr<CommHook> hierarchical_allreduce_hook(std::shared_ptr<ProcessGroup> node,
                                                      std::shared_ptr<ProcessGroup> leaders, int world_size);

}  // namespace ddp::detail
