#pragma once

// A generation's membership as the store holds it: one value written once,
// by compareSet, so every member reads the same list in the same order.

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::detail {

struct Membership {
  /// Joiner registrations (ft/join/<k>) consumed up to and including this k.
  int64_t joined_upto = 0;
  /// The first `carried` ids were members of the previous generation and
  /// hold the job's state; the rest are joiners that receive it.
  int carried = 0;
  /// Replica ids in rank order.
  std::vector<std::string> ids;

  int rank_of(const std::string& id) const;
};

/// "K|carried|id1,id2,...".
std::string encode_membership(const Membership& m);
/// Throws ddp::Error on a malformed value.
Membership decode_membership(const std::string& text);

}  // namespace ddp::detail
