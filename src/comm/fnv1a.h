#pragma once

// Internal, not API: the one 64-bit FNV-1a that ddp uses, so that two ranks,
// or a snapshot and the program reading it back, compute the same value.
// Snapshots on disk store this hash: changing the constants or the byte order
// invalidates every snapshot already written.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ddp::detail {

// Fed in pieces, for contents that are not one contiguous buffer.
class Fnv1a {
 public:
  void add(const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      hash_ ^= bytes[i];
      hash_ *= kPrime;
    }
  }
  uint64_t value() const { return hash_; }

 private:
  static constexpr uint64_t kOffsetBasis = 1469598103934665603ULL;
  static constexpr uint64_t kPrime = 1099511628211ULL;
  uint64_t hash_ = kOffsetBasis;
};

inline uint64_t fnv1a(std::string_view text) {
  Fnv1a hash;
  hash.add(text.data(), text.size());
  return hash.value();
}

}  // namespace ddp::detail
