#pragma once

// Internal, not API: ZeroRedundancyOptimizer's placement rule, a pure
// function so that the tests check it without processes.

#include <cstdint>
#include <vector>

namespace ddp {

// Which rank owns each parameter: the largest parameters are placed first,
// each on the rank with the fewest elements so far, so shards balance by
// size. Pure; the same on every rank.
std::vector<int> partition_parameters(const std::vector<int64_t>& numels, int world_size);

}  // namespace ddp
