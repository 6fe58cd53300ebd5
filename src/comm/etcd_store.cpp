#include "comm/etcd_store.h"

#include "common/etcd_v2_client.h"

#include <ddp/error.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <random>

namespace ddp::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How long one wait on etcd's change index may last before the key is read again.
constexpr std::chrono::milliseconds kWaitSlice{1000};

// What follows the '.' of a value that deleteKey's claim wrote ("<base64>.~<nonce>"): never in
// a nonce, which is hex and a count. kClaimMark + 1 is the mark alone.
constexpr char kClaimMark[] = ".~";

const char kStandard[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const char kUrlSafe[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

std::string bytes_to_string(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> string_to_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string join_keys(const std::vector<std::string>& keys) {
  std::string text;
  for (const std::string& key : keys) text += (text.empty() ? "" : ", ") + key;
  return text;
}

// A key's etcd value: the bytes as base64, then '.' and the write's nonce (never in base64), so
// that a writer whose answer was lost recognises its own write in the key's history.
std::string decode_value(const std::string& stored) { return base64_decode(stored.substr(0, stored.find('.'))); }

class EtcdStore : public c10d::Store {
 public:
  EtcdStore(std::vector<std::string> endpoints, std::string prefix, std::chrono::milliseconds timeout)
      : endpoints_(std::move(endpoints)), prefix_(normalise(std::move(prefix))), client_(endpoints_, timeout) {
    timeout_ = timeout;
    std::random_device random;
    char text[17];
    std::snprintf(text, sizeof text, "%08x%08x", random(), random());
    writer_ = text;
  }

  void drop_write_replies_for_testing(int count, std::function<void()> in_the_gap) {
    client_.drop_write_replies_for_testing(count, std::move(in_the_gap));
  }

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<EtcdStore>(endpoints_, prefix_, timeout_);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    const EtcdResponse response = call([&] { return client_.set(node(key), encode(bytes_to_string(value))); });
    check(response, "set", key);
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    // c10d's rule (TCPStore's): a missing key takes `desired` only when `expected` is empty;
    // the answer is the value the key holds afterwards, or `expected` for a missing key.
    const std::string desired_bytes = bytes_to_string(desired);
    while (true) {
      const EtcdResponse current = call([&] { return client_.get(node(key)); });
      if (current.error_code == kEtcdKeyNotFound && !expected.empty()) return expected;
      if (current.error_code != kEtcdKeyNotFound) {
        check(current, "compareSet", key);
        const std::string value = decode_value(current.node.value);
        if (value != bytes_to_string(expected)) return string_to_bytes(value);
      }
      if (write_if_unchanged(key, current, desired_bytes, "compareSet")) return desired;
    }
  }

  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, timeout_);
    const EtcdResponse response = call([&] { return client_.get(node(key)); });
    check(response, "get", key);
    return string_to_bytes(decode_value(response.node.value));
  }

  int64_t add(const std::string& key, int64_t delta) override {
    // As TCPStore: the counter is its decimal text, which get() returns.
    while (true) {
      const EtcdResponse current = call([&] { return client_.get(node(key)); });
      int64_t next = delta;
      if (current.error_code != kEtcdKeyNotFound) {
        check(current, "add", key);
        const std::string text = decode_value(current.node.value);
        try {
          next += std::stoll(text);
        } catch (const std::exception&) {
          DDP_CHECK(false, "ddp: etcd store key '", key, "' holds '", text,
                    "', not a number, so add() cannot count on it");
        }
        // add(key, 0) reads a counter (the watchers poll the joiners' count so):
        // a write would cost a raft commit on every member for nothing.
        if (delta == 0) return next;
      }
      if (write_if_unchanged(key, current, std::to_string(next), "add")) return next;
    }
  }

  // True exactly when this call deleted the key, even if the delete's answer was lost and the
  // resend found the key gone (or made anew by someone else). A plain delete cannot tell: etcd's
  // history says a delete happened, not whose. So the key is first claimed: rewritten with the
  // same bytes under this call's nonce (get() strips nonces, so readers see no change), then
  // deleted only at the claim's index. Only this call deletes at that index, so a
  // compareAndDelete as the key's first change after the claim is this call's. Three requests
  // instead of one; past etcd's 1000 remembered changes, see deleted_since(). The first read
  // is the member's own (no raft round): the claim's compare-and-swap checks it, and "not found"
  // is confirmed by a quorum read.
  bool deleteKey(const std::string& key) override {
    // After a claim that failed, a stale member must not keep the loop going: read through raft.
    bool quorum = false;
    while (true) {
      EtcdResponse current = call([&] { return quorum ? client_.get(node(key)) : client_.get_local(node(key)); });
      if (current.error_code == kEtcdKeyNotFound && !quorum) current = call([&] { return client_.get(node(key)); });
      if (current.error_code == kEtcdKeyNotFound) return false;
      check(current, "deleteKey", key);
      quorum = true;
      if (current.node.value.find(kClaimMark) != std::string::npos) {
        // Another deleteKey is between its claim and its delete. Taking the key from it could go
        // on forever between two deleters, so let it finish; one that died mid-way is taken
        // over once a wait slice passes without a change.
        const EtcdResponse change =
            call([&] { return client_.wait(node(key), current.node.modified_index + 1, kWaitSlice); });
        if (change.ok()) continue;
      }
      std::uint64_t claimed = 0;
      if (!claim(key, current, &claimed)) continue;  // another writer changed it first
      const EtcdResponse removed = call([&] { return client_.compare_and_delete(node(key), claimed); });
      if (removed.ok()) return true;
      if (removed.error_code != kEtcdKeyNotFound && removed.error_code != kEtcdTestFailed) {
        check(removed, "deleteKey", key);
      }
      if (removed.ambiguous && deleted_since(key, claimed)) return true;
      // Someone changed or deleted the key after the claim: as it is now, again.
    }
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) {
      const EtcdResponse response = call([&] { return client_.get(node(key)); });
      if (response.error_code == kEtcdKeyNotFound) return false;
      check(response, "check", key);
    }
    return true;
  }

  int64_t getNumKeys() override {
    const EtcdResponse response = call([&] { return client_.get(prefix_ + "/kv"); });
    if (response.error_code == kEtcdKeyNotFound) return 0;
    check(response, "getNumKeys", prefix_ + "/kv");
    return static_cast<int64_t>(
        std::count_if(response.children.begin(), response.children.end(), [](const EtcdNode& n) { return !n.dir; }));
  }

  std::vector<std::string> listKeys() override {
    const EtcdResponse response = call([&] { return client_.get(prefix_ + "/kv"); });
    std::vector<std::string> keys;
    if (response.error_code == kEtcdKeyNotFound) return keys;
    check(response, "listKeys", prefix_ + "/kv");
    for (const EtcdNode& child : response.children) {
      const std::string name = child.key.substr(child.key.rfind('/') + 1);
      if (!child.dir && name.size() > 1) keys.push_back(base64_decode(name.substr(1)));
    }
    return keys;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const Clock::time_point deadline = Clock::now() + timeout;
    for (const std::string& key : keys) {
      while (true) {
        const EtcdResponse current = call([&] { return client_.get(node(key)); });
        if (current.ok()) break;
        if (current.error_code != kEtcdKeyNotFound) check(current, "wait", key);
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0) {
          C10_THROW_ERROR(DistStoreError, "ddp: wait timeout after " + std::to_string(timeout.count()) +
                                              " ms for keys [" + join_keys(keys) + "] in the etcd store at " +
                                              client_.current_endpoint() + prefix_ +
                                              "; the rank that sets them may have died or not started");
        }
        // A change to the key from the index the read saw on; whatever it is, read again.
        call([&] { return client_.wait(node(key), current.etcd_index + 1, std::min(left, kWaitSlice)); });
      }
    }
  }

  bool hasExtendedApi() const override { return false; }

 private:
  static std::string normalise(std::string prefix) {
    if (prefix.empty() || prefix[0] != '/') prefix = "/" + prefix;
    while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
    return prefix == "/" ? "" : prefix;
  }

  // One etcd node per key, named so that no character of the key means anything to etcd (and
  // never with a leading '_', which etcd hides).
  std::string node(const std::string& key) const { return prefix_ + "/kv/k" + base64_encode(key, /*url_safe=*/true); }

  // `bytes` as the key's etcd value, with a nonce no other write of any store carries.
  std::string encode(const std::string& bytes, const char* mark = "") {
    return base64_encode(bytes) + "." + mark + writer_ + std::to_string(writes_.fetch_add(1));
  }

  // Writes `bytes` if the key is still as `read` saw it (absent, or at its modifiedIndex); false
  // when another writer changed it first, and the caller reads again.
  bool write_if_unchanged(const std::string& key, const EtcdResponse& read, const std::string& bytes,
                          const char* what) {
    const std::string text = encode(bytes);
    const bool absent = read.error_code == kEtcdKeyNotFound;
    const std::uint64_t seen = absent ? read.etcd_index : read.node.modified_index;
    const EtcdResponse written = call([&] {
      return absent ? client_.create(node(key), text) : client_.compare_and_swap(node(key), text, seen);
    });
    if (written.error_code == (absent ? kEtcdNodeExist : kEtcdTestFailed)) return landed(written, key, seen, text);
    check(written, what, key);
    return true;
  }

  // Whether a conditional write that etcd refused (kEtcdTestFailed, kEtcdNodeExist) had in fact
  // been applied by an earlier attempt whose answer was lost. A compare-and-swap on index N, or a
  // create on a key absent at index N, succeeds only as the key's first change after N, so that
  // change tells, whatever came after it. *index: the write's modifiedIndex when it landed.
  bool landed(const EtcdResponse& refused, const std::string& key, std::uint64_t after, const std::string& mine,
              std::uint64_t* index = nullptr) {
    if (!refused.ambiguous) return false;
    const EtcdResponse change = call([&] { return client_.wait(node(key), after + 1, kWaitSlice); });
    const EtcdResponse& seen = change.ok() ? change : call([&] {
      // Over etcd's 1000 remembered changes since (or no answer in time): the value now is all
      // there is to go on.
      return client_.get(node(key));
    });
    if (!seen.ok() || seen.node.value != mine) return false;
    if (index != nullptr) *index = seen.node.modified_index;
    return true;
  }

  // deleteKey's claim: the key's bytes, as `read` saw them, rewritten under a fresh nonce if the
  // key is still at that index. *claimed: the claim's modifiedIndex. False when another writer
  // changed or deleted the key first.
  bool claim(const std::string& key, const EtcdResponse& read, std::uint64_t* claimed) {
    const std::string text = encode(decode_value(read.node.value), kClaimMark + 1);
    const std::uint64_t seen = read.node.modified_index;
    const EtcdResponse written = call([&] { return client_.compare_and_swap(node(key), text, seen); });
    if (written.ok()) {
      *claimed = written.node.modified_index;
      return true;
    }
    if (written.error_code == kEtcdTestFailed) return landed(written, key, seen, text, claimed);
    if (written.error_code == kEtcdKeyNotFound) return false;
    check(written, "deleteKey", key);
    return false;
  }

  // After a delete at index `claimed` whose answer was lost and whose resend etcd refused:
  // whether the first change of the key after the claim is a compareAndDelete, which only the
  // claimant makes at that index. Past etcd's 1000 remembered changes, a key that is gone now
  // counts as deleted by this call: the one case where two calls may both say they deleted it.
  bool deleted_since(const std::string& key, std::uint64_t claimed) {
    const EtcdResponse change = call([&] { return client_.wait(node(key), claimed + 1, kWaitSlice); });
    if (change.ok()) return change.action == "compareAndDelete";
    const EtcdResponse current = call([&] { return client_.get(node(key)); });
    return current.error_code == kEtcdKeyNotFound;
  }

  // The client's exceptions as c10d's: a store nobody answers is a DistStoreError.
  template <typename Call>
  EtcdResponse call(Call&& operation) {
    try {
      return operation();
    } catch (const EtcdUnavailable& error) {
      C10_THROW_ERROR(DistStoreError, error.what());
    }
  }

  void check(const EtcdResponse& response, const char* what, const std::string& key) const {
    if (response.error_code == 0) return;
    C10_THROW_ERROR(DistStoreError, std::string("ddp: etcd store ") + what + "('" + key + "') failed: etcd error " +
                                        std::to_string(response.error_code) + ": " + response.error_message);
  }

  std::vector<std::string> endpoints_;
  std::string prefix_;
  EtcdV2Client client_;
  std::string writer_;  // random, per store: the nonces' first half
  std::atomic<std::uint64_t> writes_{0};
};

}  // namespace

std::string base64_encode(const std::string& bytes, bool url_safe) {
  const char* alphabet = url_safe ? kUrlSafe : kStandard;
  std::string text;
  text.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t word = (static_cast<uint8_t>(bytes[i]) << 16) | (static_cast<uint8_t>(bytes[i + 1]) << 8) |
                          static_cast<uint8_t>(bytes[i + 2]);
    text += alphabet[(word >> 18) & 63];
    text += alphabet[(word >> 12) & 63];
    text += alphabet[(word >> 6) & 63];
    text += alphabet[word & 63];
  }
  if (i < bytes.size()) {
    uint32_t word = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) word |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    text += alphabet[(word >> 18) & 63];
    text += alphabet[(word >> 12) & 63];
    text += i + 1 < bytes.size() ? alphabet[(word >> 6) & 63] : '=';
    text += '=';
  }
  return text;
}

std::string base64_decode(const std::string& text) {
  auto value_of = [&](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    DDP_CHECK(false, "ddp: '", text.substr(0, 64), "' is not base64; was the etcd key written by something other than ddp?");
    return 0;
  };
  std::string bytes;
  uint32_t word = 0;
  int bits = 0;
  for (char c : text) {
    if (c == '=') break;
    word = (word << 6) | static_cast<uint32_t>(value_of(c));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes += static_cast<char>((word >> bits) & 0xff);
    }
  }
  return bytes;
}

void drop_etcd_write_replies_for_testing(c10d::Store& store, int count, std::function<void()> in_the_gap) {
  auto* etcd = dynamic_cast<EtcdStore*>(&store);
  DDP_CHECK(etcd != nullptr, "ddp: drop_etcd_write_replies_for_testing needs a store from make_etcd_store");
  etcd->drop_write_replies_for_testing(count, std::move(in_the_gap));
}

c10::intrusive_ptr<c10d::Store> make_etcd_store(const std::vector<std::string>& endpoints, const std::string& prefix,
                                                std::chrono::milliseconds timeout) {
  return c10::make_intrusive<EtcdStore>(endpoints, prefix, timeout);
}

}  // namespace ddp::detail
