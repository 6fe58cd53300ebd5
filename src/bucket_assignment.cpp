#include <ddp/bucket_assignment.h>

#include <map>
#include <set>
#include <tuple>

namespace ddp {

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<BucketTensorInfo>& params,
                                                           size_t first_bucket_cap_bytes,
                                                           size_t bucket_cap_bytes) {
  // One open bucket per (device type, device index, dtype).
  using Kind = std::tuple<int, int, int>;
  struct OpenBucket {
    size_t slot = 0;  // index into `buckets`
    size_t bytes = 0;
  };
  std::map<Kind, OpenBucket> open;
  std::set<Kind> closed_a_bucket;
  std::vector<std::vector<size_t>> buckets;

  for (size_t k = params.size(); k-- > 0;) {
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

}  // namespace ddp
