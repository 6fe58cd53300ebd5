#pragma once

// A c10d::Store kept in an etcd cluster through its v2 API (common/etcd_v2_client.h), so that
// the workers' rendezvous and fault-tolerance state survive the loss of any one node: etcd
// replicates every write to a majority of its members, and the client fails over between them.
//
// Keys live under PREFIX/kv/, one etcd node each, named by the base64url of the c10d key (so a
// '/' in a key makes no directory); values are base64, so any bytes round-trip, followed by a
// per-write nonce that get() strips. add() and compareSet() are compare-and-swap loops on the
// node's modifiedIndex; a write whose answer was lost and that etcd then refuses on the retry is
// looked up in the key's history by its nonce, so it counts once. deleteKey() first rewrites the
// key's bytes under its own nonce (marked as a claim, which other deleters wait on rather than
// take), then deletes at that index, so that after a lost answer the key's history tells whether
// the delete was its own. wait() reads, then waits
// on etcd's change index, re-reading at least every second so that a member cut off mid-wait
// costs at most that.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace ddp::detail {

/// endpoints: the members' client URLs (HOST:PORT); prefix: where the keys live ("/ddp-ft/job7").
/// Every operation times out after `timeout` (c10::DistStoreError), failovers included.
c10::intrusive_ptr<c10d::Store> make_etcd_store(const std::vector<std::string>& endpoints, const std::string& prefix,
                                                std::chrono::milliseconds timeout);

/// Test seam: the store's next `count` successful writes are answered as lost, so its client
/// sends each again to the next member (the ambiguity of a member dying after applying it), after
/// running `in_the_gap`.
void drop_etcd_write_replies_for_testing(c10d::Store& store, int count, std::function<void()> in_the_gap = {});

/// base64 (RFC 4648, with padding) and back; base64_decode throws on bad input.
std::string base64_encode(const std::string& bytes, bool url_safe = false);
std::string base64_decode(const std::string& text);

}  // namespace ddp::detail
