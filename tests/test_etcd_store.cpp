// The etcd v2 client and the c10d store over it (src/common/etcd_v2_client.h,
// src/comm/etcd_store.h), against a real 3-member etcd cluster (support/etcd_cluster.h): every
// c10d operation with binary values, Gloo's rendezvous through it, and every operation still
// succeeding after the member the client talked to is killed. Each test skips without etcd.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <fcntl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/etcd_store.h"
#include "common/etcd_v2_client.h"
#include "fault/ft_store.h"
#include "support/etcd_cluster.h"

namespace {

using namespace std::chrono_literals;
using ddp::testing::EtcdCluster;

#define SKIP_WITHOUT_ETCD()                                                                            \
  if (!ddp::testing::etcd_available()) GTEST_SKIP() << "no /usr/bin/etcd or /usr/bin/setpriv (apt-get install etcd-server util-linux)"

std::vector<uint8_t> bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
std::string text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

// Every operation c10d's users make, on `store`; `tag` keeps runs apart.
void exercise_every_operation(c10d::Store& store, const std::string& tag) {
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes += static_cast<char>(b);
  store.set(tag + "/binary key/with spaces", bytes(all_bytes));
  EXPECT_EQ(text(store.get(tag + "/binary key/with spaces")), all_bytes);
  store.set(tag + "/empty", std::vector<uint8_t>{});
  EXPECT_TRUE(store.get(tag + "/empty").empty());

  EXPECT_EQ(store.add(tag + "/counter", 5), 5);
  EXPECT_EQ(store.add(tag + "/counter", -2), 3);
  EXPECT_EQ(text(store.get(tag + "/counter")), "3");

  // c10d's compareSet: a missing key takes the new value only when the expected one is empty.
  EXPECT_EQ(text(store.compareSet(tag + "/cas", bytes("x"), bytes("y"))), "x");
  EXPECT_FALSE(store.check({tag + "/cas"}));
  EXPECT_EQ(text(store.compareSet(tag + "/cas", {}, bytes("first"))), "first");
  EXPECT_EQ(text(store.compareSet(tag + "/cas", bytes("wrong"), bytes("second"))), "first");
  EXPECT_EQ(text(store.compareSet(tag + "/cas", bytes("first"), bytes("second"))), "second");
  EXPECT_EQ(text(store.get(tag + "/cas")), "second");

  EXPECT_TRUE(store.check({tag + "/cas", tag + "/counter"}));
  EXPECT_FALSE(store.check({tag + "/cas", tag + "/absent"}));
  EXPECT_TRUE(store.deleteKey(tag + "/cas"));
  EXPECT_FALSE(store.deleteKey(tag + "/cas"));
  EXPECT_FALSE(store.check({tag + "/cas"}));
}

TEST(EtcdStoreUnit, Base64RoundTripsEveryByteAndEndpointsAreChecked) {
  for (const std::string& sample : {std::string(""), std::string("a"), std::string("ab"), std::string("abc"),
                                    std::string("\0\xff\x10 /+", 6)}) {
    EXPECT_EQ(ddp::detail::base64_decode(ddp::detail::base64_encode(sample)), sample);
    EXPECT_EQ(ddp::detail::base64_decode(ddp::detail::base64_encode(sample, true)), sample);
  }
  EXPECT_EQ(ddp::detail::base64_encode("hello"), "aGVsbG8=");
  EXPECT_EQ(ddp::detail::EtcdV2Client::parse_endpoints("a:1,b:2").size(), 2u);
  EXPECT_THROW(ddp::detail::EtcdV2Client::parse_endpoints("a:1,,b:2"), std::invalid_argument);
  EXPECT_THROW(ddp::detail::EtcdV2Client::parse_endpoints("a"), std::invalid_argument);
  EXPECT_THROW(ddp::detail::open_ft_store("etcd://nohost/x", 1s), c10::Error);
  EXPECT_THROW(ddp::detail::open_ft_store("redis://a:1", 1s), c10::Error);
}

TEST(EtcdStore, ServesEveryC10dOperationThroughTheCluster) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster;
  ASSERT_EQ(cluster.wait_until_ready(), "");
  auto store = ddp::detail::open_ft_store("etcd://" + cluster.endpoint_list() + "/jobs/one", 10s);
  exercise_every_operation(*store, "a");
  EXPECT_EQ(store->getNumKeys(), 3);  // binary, empty, counter
  auto keys = store->listKeys();
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{"a/binary key/with spaces", "a/counter", "a/empty"}));

  // Another prefix is another store.
  auto other = ddp::detail::open_ft_store("etcd://" + cluster.endpoint_list() + "/jobs/two", 10s);
  EXPECT_EQ(other->getNumKeys(), 0);
  EXPECT_FALSE(other->check({"a/counter"}));

  // Increments from several clients at once are each counted once.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto mine = ddp::detail::make_etcd_store({cluster.endpoint(t % 3)}, "/jobs/one", 10s);
      for (int i = 0; i < 10; ++i) mine->add("shared", 1);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(text(store->get("shared")), "40");

  // wait() returns when another client sets the key, and times out with c10d's error.
  std::thread late([&] {
    std::this_thread::sleep_for(300ms);
    other->set("late", bytes("here"));
  });
  const auto start = std::chrono::steady_clock::now();
  other->wait({"late"}, 10s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  late.join();
  const auto before = std::chrono::steady_clock::now();
  EXPECT_THROW(other->wait({"never"}, 700ms), c10::DistStoreError);
  const auto waited = std::chrono::steady_clock::now() - before;
  EXPECT_GE(waited, 650ms);
  EXPECT_LT(waited, 3s);
}

TEST(EtcdStore, GlooRendezvousesAndAllReducesThroughIt) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster;
  ASSERT_EQ(cluster.wait_until_ready(), "");
  constexpr int kRanks = 3;
  std::vector<float> sums(kRanks, 0);
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kRanks; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        // Each rank talks to a different member first.
        auto endpoints = cluster.endpoints();
        std::rotate(endpoints.begin(), endpoints.begin() + rank, endpoints.end());
        auto store = c10::make_intrusive<c10d::PrefixStore>(
            "group0", ddp::detail::make_etcd_store(endpoints, "/gloo", 20s));
        auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(20000));
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        c10d::ProcessGroupGloo group(store, rank, kRanks, options);
        std::vector<at::Tensor> tensors = {at::full({4}, static_cast<float>(rank + 1))};
        group.allreduce(tensors)->wait();
        sums[static_cast<size_t>(rank)] = tensors[0][0].item<float>();
      } catch (const std::exception& error) {
        errors[static_cast<size_t>(rank)] = error.what();
      }
    });
  }
  for (auto& thread : ranks) thread.join();
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank;
    EXPECT_EQ(sums[static_cast<size_t>(rank)], 6.0f) << "rank " << rank;
  }
}

TEST(EtcdStore, EveryOperationSucceedsAfterTheMemberItTalkedToIsKilled) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster;
  ASSERT_EQ(cluster.wait_until_ready(), "");
  ddp::detail::EtcdV2Client client(cluster.endpoints(), 10s);
  ASSERT_TRUE(client.set("/probe", "1").ok());
  ASSERT_EQ(client.current_endpoint(), "http://" + cluster.endpoint(0));
  auto store = ddp::detail::make_etcd_store(cluster.endpoints(), "/failover", 10s);
  store->set("before", bytes("kept"));

  // A waiter blocked on member 0 when it dies must complete through another member.
  std::atomic<bool> waited{false};
  std::string wait_error;
  std::thread waiter([&] {
    try {
      store->wait({"after-kill"}, 15s);
      waited = true;
    } catch (const std::exception& error) {
      wait_error = error.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  cluster.kill(0);

  const auto start = std::chrono::steady_clock::now();
  try {
    exercise_every_operation(*store, "b");
    EXPECT_EQ(text(store->get("before")), "kept") << "a write acknowledged before the kill was lost";
    store->set("after-kill", bytes("1"));
  } catch (const std::exception& error) {
    ADD_FAILURE() << "after member 0's death: " << error.what();
  }
  waiter.join();
  EXPECT_TRUE(waited) << wait_error;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 8s);
  ASSERT_TRUE(client.set("/probe", "2").ok());
  EXPECT_NE(client.current_endpoint(), "http://" + cluster.endpoint(0));

  // And a second member's loss leaves no majority: operations fail within their timeout,
  // naming the members.
  cluster.kill(1);
  auto short_store = ddp::detail::make_etcd_store(cluster.endpoints(), "/failover", 1500ms);
  const auto before = std::chrono::steady_clock::now();
  try {
    short_store->set("no-quorum", bytes("x"));
    ADD_FAILURE() << "a write without a majority succeeded";
  } catch (const c10::DistStoreError& error) {
    EXPECT_NE(std::string(error.what()).find(cluster.endpoint(2)), std::string::npos) << error.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - before, 6s);
}

TEST(EtcdStore, AWriteWhoseAnswerWasLostCountsOnce) {
  // A member applies the write and dies before answering; the client sends it again to the next
  // member, where the compare-and-swap (or create) is refused because of its own first attempt.
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster;
  ASSERT_EQ(cluster.wait_until_ready(), "");
  auto store = ddp::detail::make_etcd_store(cluster.endpoints(), "/lost", 10s);
  auto lose_next_answer = [&] { ddp::detail::drop_etcd_write_replies_for_testing(*store, 1); };

  lose_next_answer();
  EXPECT_EQ(store->add("counter", 5), 5);  // the create
  EXPECT_EQ(text(store->get("counter")), "5");
  lose_next_answer();
  EXPECT_EQ(store->add("counter", 1), 6);  // a compare-and-swap
  EXPECT_EQ(text(store->get("counter")), "6");

  lose_next_answer();
  EXPECT_EQ(text(store->compareSet("cas", {}, bytes("first"))), "first");
  EXPECT_EQ(text(store->get("cas")), "first");
  lose_next_answer();
  EXPECT_EQ(text(store->compareSet("cas", bytes("first"), bytes("second"))), "second");
  EXPECT_EQ(text(store->get("cas")), "second");

  // Another client's write between the lost answer and the resend does not hide ours (the
  // key's history says whose write came first): without that, the resend's refusal reads as a
  // mismatch, or the increment is made again on top of the other's.
  auto other = ddp::detail::make_etcd_store(cluster.endpoints(), "/lost", 10s);
  ddp::detail::drop_etcd_write_replies_for_testing(*store, 1, [&] { other->add("counter", 10); });
  EXPECT_EQ(store->add("counter", 1), 7);
  EXPECT_EQ(text(other->get("counter")), "17");
  ddp::detail::drop_etcd_write_replies_for_testing(
      *store, 1, [&] { EXPECT_EQ(text(other->compareSet("cas", bytes("third"), bytes("fourth"))), "fourth"); });
  EXPECT_EQ(text(store->compareSet("cas", bytes("second"), bytes("third"))), "third");
  EXPECT_EQ(text(other->get("cas")), "fourth");
  ddp::detail::drop_etcd_write_replies_for_testing(*store, 1, [&] { other->add("created", 2); });
  EXPECT_EQ(store->add("created", 1), 1);
  EXPECT_EQ(text(other->get("created")), "3");

  // An unconditional write sent twice is the same write.
  lose_next_answer();
  store->set("plain", bytes("v"));
  EXPECT_EQ(text(other->get("plain")), "v");
}

TEST(EtcdStore, AWriteAfterTheLeadersDeathSucceedsWithinThreeSeconds) {
  // The worst single loss: the member the client talks to is the raft leader, so the write
  // waits for an election among the other two. Measured, and printed as a median of 3.
  SKIP_WITHOUT_ETCD();
  std::vector<double> millis;
  for (int trial = 0; trial < 3; ++trial) {
    EtcdCluster cluster;
    ASSERT_EQ(cluster.wait_until_ready(), "");
    const int leader = cluster.leader();
    if (leader < 0) GTEST_SKIP() << "no member says it leads (is curl installed?)";
    auto endpoints = cluster.endpoints();
    std::rotate(endpoints.begin(), endpoints.begin() + leader, endpoints.end());
    auto store = ddp::detail::make_etcd_store(endpoints, "/leader", 10s);
    store->set("warm", bytes("1"));
    cluster.kill(leader);
    const auto start = std::chrono::steady_clock::now();
    store->set("after", bytes("1"));
    millis.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    EXPECT_EQ(text(store->get("warm")), "1");
  }
  std::sort(millis.begin(), millis.end());
  std::printf("[measure] etcd store: first write after the leader's SIGKILL took %.0f ms median (%.0f..%.0f), "
              "3 members, heartbeat 50 ms, election timeout 500 ms\n",
              millis[1], millis[0], millis[2]);
  EXPECT_LT(millis[2], 3000.0);
}

}  // namespace

namespace {

// This process's TCP connections to `port` (any state, TIME_WAIT included), by socket inode
// (0 for those no longer held by an fd), from /proc/self/net/tcp{,6}.
std::vector<unsigned long> connections_to(int port) {
  std::vector<unsigned long> inodes;
  char wanted[8];
  std::snprintf(wanted, sizeof wanted, ":%04X", port);
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout;
      unsigned long inode = 0;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (remote.size() >= 5 && remote.compare(remote.size() - 5, 5, wanted) == 0) inodes.push_back(inode);
    }
  }
  return inodes;
}

// 1 when this process holds socket `inode` in a close-on-exec fd, 0 when in another fd, -1 when
// no fd of this process holds it (the namespace's table lists etcd's own connections too).
int socket_closes_on_exec(unsigned long inode) {
  const std::string link = "socket:[" + std::to_string(inode) + "]";
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    if (std::filesystem::read_symlink(entry.path(), error).string() != link) continue;
    std::ifstream info("/proc/self/fdinfo/" + entry.path().filename().string());
    for (std::string key, value; info >> key >> value;) {
      if (key == "flags:") return (std::stoul(value, nullptr, 8) & O_CLOEXEC) != 0 ? 1 : 0;
    }
  }
  return -1;
}

}  // namespace

// A fault-tolerant job polls its store several times a second per worker: the client keeps its
// connections alive instead of opening one per request (each left a TIME_WAIT socket behind and
// cost both ends a handshake), and they close on exec, so a launcher's workers never inherit
// them. add(key, 0), how the workers read the joiners' count, reads without writing.
TEST(EtcdStore, RequestsReuseTheirConnectionsWhichCloseOnExecAndAddingZeroWritesNothing) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster;
  ASSERT_EQ(cluster.wait_until_ready(), "");
  // One member, so that every connection this client makes is to that port.
  auto store = ddp::detail::make_etcd_store({cluster.endpoint(0)}, "/reuse", 10s);
  const int port = std::stoi(cluster.endpoint(0).substr(cluster.endpoint(0).rfind(':') + 1));
  const size_t before = connections_to(port).size();  // etcd's own gateway connects there too
  store->set("counter", bytes("3"));
  for (int i = 0; i < 100; ++i) {
    EXPECT_TRUE(store->check({"counter"}));
    if (i % 10 == 0) store->set("other", bytes(std::to_string(i)));
  }
  const std::vector<unsigned long> after = connections_to(port);
  EXPECT_LE(after.size(), before + 2) << "111 requests left " << after.size() - before << " connections";
  size_t held = 0;
  for (unsigned long inode : after) {
    const int closes_on_exec = socket_closes_on_exec(inode);
    if (closes_on_exec < 0) continue;
    ++held;
    EXPECT_EQ(closes_on_exec, 1) << "socket " << inode << " would leak into a child";
  }
  EXPECT_GE(held, 1u) << "no connection kept alive";

  ddp::detail::EtcdV2Client client({cluster.endpoint(1)}, 10s);
  const auto index_before = client.get("/any").etcd_index;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(store->add("counter", 0), 3);
  EXPECT_EQ(client.get("/any").etcd_index, index_before) << "add(key, 0) wrote to the cluster";
  EXPECT_EQ(store->add("counter", 2), 5);
  EXPECT_GT(client.get("/any").etcd_index, index_before);
}
