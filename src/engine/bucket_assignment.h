#pragma once

// Internal to the library, not installed: which gradients travel together in one all-reduce
// (DDP's buckets, the gradient engine's groups). Pure functions: no tensors
// are touched, so the rules are unit-tested directly.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddp::detail {

/// What bucket assignment needs to know about one parameter.
struct BucketTensorInfo {
  int64_t numel = 0;
  c10::ScalarType dtype = c10::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
};

/// Groups parameters (given in registration order) into buckets.
///
/// Parameters are visited in reverse registration order, the order in which
/// backward usually produces their gradients. Each bucket holds one dtype on
/// one device. A bucket closes once it holds at least its cap in bytes: the
/// first bucket of each (dtype, device) uses `first_bucket_cap_bytes`, later
/// ones `bucket_cap_bytes`. Buckets are returned in the order they were
/// opened; each lists parameter indices in the order they were added.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<BucketTensorInfo>& params,
                                                           size_t first_bucket_cap_bytes,
                                                           size_t bucket_cap_bytes);

/// The same rules, visiting parameters in `visit_order` (indices into
/// `params`, each exactly once): the order gradients were observed to become
/// ready, when buckets are rebuilt after the first iteration.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<BucketTensorInfo>& params,
                                                           const std::vector<size_t>& visit_order,
                                                           size_t first_bucket_cap_bytes,
                                                           size_t bucket_cap_bytes);

}  // namespace ddp::detail
