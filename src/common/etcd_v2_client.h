#pragma once

// A client of etcd's v2 key-value API (etcd 3.4 serves it with --enable-v2), over libcurl,
// torch-free: ddprun's etcd-v2 rendezvous and ddp's etcd store (comm/etcd_store.h) share it.
//
// It holds every member's client URL and fails over between them: a request that cannot
// connect, times out or gets a server error (no leader during an election) goes to the next
// member, round the list, until the request's deadline. Reads ask for quorum=true, so that a
// member cut off from the others cannot answer with stale values.
//
// A write that was applied by a member that then died before answering is retried on the next
// one; a compare-and-swap retried that way then fails (its own write changed the index), and a
// create finds the key it made. The answer says `ambiguous` then, and a caller that must know
// whether its write landed recognises it in the key's history (comm/etcd_store.cpp does, by a
// nonce in the value).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <mutex>
#include <string>
#include <vector>

namespace ddp::detail {

// etcd's v2 errorCode values that callers act on.
constexpr int kEtcdKeyNotFound = 100;
constexpr int kEtcdTestFailed = 101;  // compare-and-swap: the value or index differed
constexpr int kEtcdNodeExist = 105;   // create: the key already exists
constexpr int kEtcdEventIndexCleared = 401;

// No member answered before the deadline.
class EtcdUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct EtcdNode {
  std::string key;  // the full path, "/prefix/name"
  std::string value;
  bool dir = false;
  std::uint64_t modified_index = 0;
};

// One answer: the node (or the directory's children), or etcd's error.
struct EtcdResponse {
  int error_code = 0;  // 0: success; else etcd's errorCode
  std::string error_message;
  std::string action;  // "get", "set", "create", "compareAndSwap", "delete", ...
  EtcdNode node;
  std::vector<EtcdNode> children;  // a directory's entries (recursive listings flattened)
  std::uint64_t etcd_index = 0;    // X-Etcd-Index: the store's index when it answered
  bool timed_out = false;          // a wait that saw no change before its deadline
  // A write whose earlier attempt may have been applied without the answer arriving (a
  // timeout, a dropped connection, a server error): an error now may be that attempt's doing.
  bool ambiguous = false;
  bool ok() const { return error_code == 0 && !timed_out; }
};

class EtcdV2Client {
 public:
  // endpoints: "HOST:PORT" or "http(s)://HOST:PORT" each. request_timeout bounds one call,
  // failovers included.
  EtcdV2Client(std::vector<std::string> endpoints, std::chrono::milliseconds request_timeout);
  ~EtcdV2Client();
  EtcdV2Client(const EtcdV2Client&) = delete;
  EtcdV2Client& operator=(const EtcdV2Client&) = delete;

  // "h1:p1,h2:p2" as a list; throws std::invalid_argument on an empty entry or a missing port.
  static std::vector<std::string> parse_endpoints(const std::string& comma_list);

  EtcdResponse get(const std::string& key, bool recursive = false);
  // The answering member's own view, without a round through raft: possibly stale, so only for
  // a read whose result a conditional write then checks.
  EtcdResponse get_local(const std::string& key);
  // Unconditional; ttl_seconds > 0 makes the key expire.
  EtcdResponse set(const std::string& key, const std::string& value, int ttl_seconds = 0);
  // Only if the key does not exist (kEtcdNodeExist otherwise).
  EtcdResponse create(const std::string& key, const std::string& value, int ttl_seconds = 0);
  // Only if the key's modifiedIndex is prev_index (kEtcdTestFailed otherwise).
  EtcdResponse compare_and_swap(const std::string& key, const std::string& value, std::uint64_t prev_index,
                                int ttl_seconds = 0);
  // Refreshes a key's TTL, keeping its value, only if it exists.
  EtcdResponse refresh(const std::string& key, int ttl_seconds);
  EtcdResponse remove(const std::string& key, bool recursive = false);
  // Only if the key's modifiedIndex is prev_index (kEtcdTestFailed otherwise); etcd records it
  // as a "compareAndDelete".
  EtcdResponse compare_and_delete(const std::string& key, std::uint64_t prev_index);
  // Waits for the first change at or after wait_index of the key (or below it, recursive),
  // at most `timeout`; timed_out when none came.
  EtcdResponse wait(const std::string& key, std::uint64_t wait_index, std::chrono::milliseconds timeout,
                    bool recursive = false);

  // The member that answered last, "http://HOST:PORT".
  std::string current_endpoint() const;
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  std::chrono::milliseconds request_timeout() const { return request_timeout_; }

  // Test seam: the next `count` write answers that succeed are treated as lost (as if the member
  // died after applying the write), so the write is sent again to the next member; `in_the_gap`
  // runs before each resend (another client's write, say). Set it while no request runs.
  void drop_write_replies_for_testing(int count, std::function<void()> in_the_gap = {}) {
    in_the_gap_ = std::move(in_the_gap);
    drop_write_replies_.store(count);
  }

 private:
  EtcdResponse request(const std::string& method, const std::string& key, const std::string& query,
                       const std::string& body, std::chrono::milliseconds timeout, bool is_wait);

  std::vector<std::string> endpoints_;  // "http://HOST:PORT"
  std::chrono::milliseconds request_timeout_;
  std::atomic<size_t> preferred_{0};
  std::atomic<int> drop_write_replies_{0};
  std::function<void()> in_the_gap_;
  // Idle curl handles, each keeping its connections to the members alive between requests: a
  // fault-tolerant job polls the store several times a second per worker, and a new TCP
  // connection per request cost the members and the workers more CPU than the requests did.
  std::mutex idle_mutex_;
  std::vector<void*> idle_handles_;
};

}  // namespace ddp::detail
