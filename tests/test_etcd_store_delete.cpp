// The etcd store's deleteKey() (src/comm/etcd_store.cpp) says true exactly when the call deleted
// the key, even when the answer to its delete was lost and the resend found the key gone, or made
// anew by another client, and when another client deletes the same key meanwhile. Lost answers
// are simulated by the client's test seam (a member that applied the write and died before
// answering), against a real 3-member etcd cluster (support/etcd_cluster.h); skips without etcd.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "comm/etcd_store.h"
#include "common/etcd_v2_client.h"
#include "support/etcd_cluster.h"

namespace {

using namespace std::chrono_literals;
using ddp::testing::EtcdCluster;

std::vector<uint8_t> bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
std::string text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

// deleteKey makes two writes (the claim and the delete): `lost` answers of this store's next
// writes are dropped, and `gap` runs before the resend of the n-th (1-based) of them.
void lose_answers(c10d::Store& store, int lost, std::function<void(int)> gap = {}) {
  auto count = std::make_shared<int>(0);
  ddp::detail::drop_etcd_write_replies_for_testing(store, lost, [count, gap] {
    ++*count;
    if (gap) gap(*count);
  });
}

// A real 3-member etcd cluster of the test's own, and the stores of clients over it.
class EtcdStoreDelete : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ddp::testing::etcd_available()) {
      GTEST_SKIP() << "no /usr/bin/etcd or /usr/bin/setpriv (apt-get install etcd-server util-linux)";
    }
    cluster_.emplace();
    ASSERT_EQ(cluster_->wait_until_ready(), "");
  }

  // A client's etcd store under `prefix`.
  c10::intrusive_ptr<c10d::Store> store_under(const std::string& prefix) {
    return ddp::detail::make_etcd_store(cluster_->endpoints(), prefix, 10s);
  }

  std::optional<EtcdCluster> cluster_;
};

TEST_F(EtcdStoreDelete, ALostAnswerStillReportsTheDeleteAsThisCalls) {
  auto store = store_under("/delete");
  auto other = store_under("/delete");

  // The delete's answer lost (and the claim's before it): the resend finds the key gone.
  store->set("a", bytes("1"));
  lose_answers(*store, 2);
  EXPECT_TRUE(store->deleteKey("a"));
  EXPECT_FALSE(other->check({"a"}));
  EXPECT_FALSE(store->deleteKey("a"));

  // Only the claim's answer lost: the claim is recognised by its nonce, and the delete goes on.
  store->set("b", bytes("2"));
  lose_answers(*store, 1);
  EXPECT_TRUE(store->deleteKey("b"));
  EXPECT_FALSE(other->check({"b"}));

  // Another client makes the key anew between the lost answer and the resend: ours was the
  // delete, and theirs must survive it (a plain resend would delete it too).
  store->set("c", bytes("3"));
  lose_answers(*store, 2, [&](int n) {
    if (n == 2) other->set("c", bytes("new"));
  });
  EXPECT_TRUE(store->deleteKey("c"));
  ASSERT_TRUE(other->check({"c"}));
  EXPECT_EQ(text(other->get("c")), "new");

  // A lost answer to a delete of a key that is already gone costs nothing and says false.
  EXPECT_FALSE(store->deleteKey("never"));
}

TEST_F(EtcdStoreDelete, OfTwoClientsDeletingOneKeyExactlyOneSaysItDid) {
  auto store = store_under("/race");
  auto other = store_under("/race");

  // Our claim's answer is lost and, in the gap, the other client deletes the key: it finds our
  // claim, waits a slice for our delete (which cannot come: we are in the gap), then takes the
  // key over. Theirs was the delete: one true, one false. A plain delete said false twice.
  store->set("k", bytes("v"));
  bool theirs = false;
  lose_answers(*store, 1, [&](int) { theirs = other->deleteKey("k"); });
  const bool ours = store->deleteKey("k");
  EXPECT_TRUE(theirs);
  EXPECT_FALSE(ours);
  EXPECT_FALSE(store->check({"k"}));

  // Our delete's answer is lost and, in the gap, the other client tries the same delete: the
  // key is gone, so theirs says false and ours, after the resend, true.
  store->set("k2", bytes("v"));
  lose_answers(*store, 2, [&](int n) {
    if (n == 2) theirs = other->deleteKey("k2");
  });
  EXPECT_TRUE(store->deleteKey("k2"));
  EXPECT_FALSE(theirs);

  // Racing for real, without lost answers: each key is deleted once.
  constexpr int kKeys = 10;
  for (int i = 0; i < kKeys; ++i) store->set("race/" + std::to_string(i), bytes("x"));
  std::atomic<int> trues{0};
  auto deleter = [&](c10d::Store& s) {
    for (int i = 0; i < kKeys; ++i) trues += s.deleteKey("race/" + std::to_string(i)) ? 1 : 0;
  };
  std::thread a(deleter, std::ref(*store));
  std::thread b(deleter, std::ref(*other));
  a.join();
  b.join();
  EXPECT_EQ(trues.load(), kKeys);
  EXPECT_EQ(store->getNumKeys(), 0);
}

TEST_F(EtcdStoreDelete, AClaimLeftByADeadDeleterIsTakenOverAfterAWaitSlice) {
  // A deleteKey that died between its claim and its delete leaves the key claimed (".~" after
  // the base64). Another deleteKey waits a slice for it to finish, then deletes it itself.
  auto store = store_under("/dead");
  ddp::detail::EtcdV2Client client(cluster_->endpoints(), 10s);
  const std::string node = "/dead/kv/k" + ddp::detail::base64_encode("orphan", /*url_safe=*/true);
  ASSERT_TRUE(client.set(node, ddp::detail::base64_encode("v") + ".~0123456789abcdef7").ok());
  EXPECT_EQ(text(store->get("orphan")), "v");
  const auto started = std::chrono::steady_clock::now();
  EXPECT_TRUE(store->deleteKey("orphan"));
  const auto took = std::chrono::steady_clock::now() - started;
  EXPECT_GE(took, 900ms);
  EXPECT_LT(took, 5s);
  EXPECT_FALSE(store->check({"orphan"}));
}

TEST_F(EtcdStoreDelete, ReadersNeverSeeTheClaimAndWhatItCosts) {
  auto store = store_under("/cost");
  auto other = store_under("/cost");

  // The claim leaves the bytes as they were: a reader between the claim and the delete sees
  // them unchanged (get() strips the claim's nonce).
  store->set("n", bytes("5"));
  lose_answers(*store, 1, [&](int) { EXPECT_EQ(text(other->get("n")), "5"); });
  EXPECT_TRUE(store->deleteKey("n"));
  EXPECT_EQ(other->add("n", 1), 1);

  // What the exact delete costs against a plain one, on this cluster (median of 20 each).
  ddp::detail::EtcdV2Client client(cluster_->endpoints(), 10s);
  std::vector<double> exact, plain;
  for (int i = 0; i < 20; ++i) {
    store->set("t", bytes("x"));
    auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(store->deleteKey("t"));
    exact.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    client.set("/cost/plain", "x");
    start = std::chrono::steady_clock::now();
    EXPECT_TRUE(client.remove("/cost/plain").ok());
    plain.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(exact.begin(), exact.end());
  std::sort(plain.begin(), plain.end());
  std::printf("[measure] etcd store deleteKey: %.2f ms median (get, claim, compareAndDelete); a plain DELETE: %.2f ms\n",
              exact[exact.size() / 2], plain[plain.size() / 2]);
}

}  // namespace
