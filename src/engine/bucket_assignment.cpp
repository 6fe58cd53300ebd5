#include "engine/bucket_assignment.h"

#include <ddp/error.h>

#include <c10/util/Exception.h>

#include <map>
#include <set>
#include <tuple>

namespace ddp::detail {

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<BucketTensorInfo>& params,
                                                           size_t first_bucket_cap_bytes,
                                                           size_t bucket_cap_bytes) {
  // Backward usually produces gradients in reverse registration order.
  std::vector<size_t> reverse(params.size());
  for (size_t k = 0; k < params.size(); ++k) reverse[k] = params.size() - 1 - k;
  return compute_bucket_assignment(params, reverse, first_bucket_cap_bytes, bucket_cap_bytes);
}

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<BucketTensorInfo>& params,
                                                           const std::vector<size_t>& visit_order,
                                                           size_t first_bucket_cap_bytes,
                                                           size_t bucket_cap_bytes) {
  std::vector<char> seen(params.size(), 0);
  for (size_t k : visit_order) {
    DDP_CHECK(k < params.size() && !seen[k], "ddp: bucket visit order must list each parameter once");
    seen[k] = 1;
  }
  DDP_CHECK(visit_order.size() == params.size(), "ddp: bucket visit order must list every parameter");
  // One open bucket per (device type, device index, dtype).
  using Kind = std::tuple<int, int, int>;
  struct OpenBucket {
    size_t slot = 0;  // index into `buckets`
    size_t bytes = 0;
  };
  std::map<Kind, OpenBucket> open;
  std::set<Kind> closed_a_bucket;
  std::vector<std::vector<size_t>> buckets;

  for (size_t k : visit_order) {
    const BucketTensorInfo& info = params[k];
    Kind kind{static_cast<int>(info.device.type()), info.device.index(), static_cast<int>(info.dtype)};
    auto it = open.find(kind);
    if (it == open.end()) {
      it = open.emplace(kind, OpenBucket{buckets.size(), 0}).first;
      buckets.emplace_back();
    }
    buckets[it->second.slot].push_back(k);
    it->second.bytes += static_cast<size_t>(info.numel) * c10::elementSize(info.dtype);
    // A small first bucket lets the first all-reduce start early in backward.
    size_t cap = closed_a_bucket.count(kind) ? bucket_cap_bytes : first_bucket_cap_bytes;
    if (it->second.bytes >= cap) {
      open.erase(it);
      closed_a_bucket.insert(kind);
    }
  }
  return buckets;
}

}  // namespace ddp::detail
