#pragma once

// Internal, not API: the batching the tests' training loops use over a
// sampler's indices. Programs batch through a DataLoader over the sampler.

#include <cstdint>
#include <vector>

namespace ddp {

// Splits `indices` into consecutive batches of `batch_size`, the last one
// possibly shorter unless `drop_last`, as a DataLoader over a sampler does.
std::vector<std::vector<int64_t>> make_batches(const std::vector<int64_t>& indices, int64_t batch_size,
                                               bool drop_last = false);

}  // namespace ddp
