#pragma once

// Internal, not API: the check ProcessGroup::wait (process_group.cpp) makes
// while a collective waits, implemented beside the stall report
// (collective_debug.cpp).

#include <ddp/collective_trace.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace ddp::detail {

// Asks the other ranks of a group for their newest collectives (through the
// store; their progress responders answer) and returns whether one issued a
// different collective (op, dtype, shape, tag) than this rank at a number
// both have. Waits at most 2 s for answers; false when none came.
bool issued_other_collectives(c10d::Store& store, const CollectiveTrace& trace, int rank, int world_size);

// How long a collective waits before the ranks compare their collectives:
// a quarter of the timeout, at most 30 s; zero (never) under 8 s.
inline std::chrono::milliseconds desync_check_interval(std::chrono::milliseconds timeout) {
  if (timeout < std::chrono::seconds(8)) return std::chrono::milliseconds(0);
  return std::min<std::chrono::milliseconds>(timeout / 4, std::chrono::seconds(30));
}

}  // namespace ddp::detail
