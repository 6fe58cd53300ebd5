// Rendezvous and its failures, with real processes on loopback.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <signal.h>
#include <unistd.h>

#include <thread>

using namespace ddp::testing;

namespace {

std::string port_text() { return std::to_string(free_port()); }

TEST(ProcessGroup, TwoAndThreeRanksRendezvousAndReduce) {
  for (int n : {2, 3}) {
    auto r = run_process(under_ddprun(n, "ddp_worker", {"ready"}), one_rank({}, std::chrono::seconds(60)));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    for (int rank = 0; rank < n; ++rank) {
      EXPECT_NE(r.out.find("READY rank " + std::to_string(rank) + " of " + std::to_string(n) + " sum " +
                           std::to_string(n)),
                std::string::npos)
          << r.out;
    }
  }
}

TEST(ProcessGroup, SingleProcessNeedsNoLauncher) {
  auto r = run_process({bin_path("ddp_worker"), "ready"}, one_rank({}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("READY rank 0 of 1 sum 1"), std::string::npos) << r.out;
}

TEST(ProcessGroup, BadEnvironmentsNameTheVariable) {
  struct Case {
    std::vector<std::pair<std::string, std::string>> env;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}}, "RANK must be less than WORLD_SIZE"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "abc"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}}, "WORLD_SIZE='abc' is not an integer"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}, "MASTER_ADDR is not set"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "port"}}, "MASTER_PORT='port'"},
  };
  for (const auto& c : cases) {
    auto r = run_process({bin_path("ddp_worker"), "ready"}, one_rank(c.env, std::chrono::seconds(20)));
    EXPECT_NE(r.exit_code, 0) << r.describe();
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << r.describe();
  }
}

TEST(ProcessGroup, UnreachableMasterFailsAfterTheTimeout) {
  std::string port = port_text();  // nothing listens there
  auto r = run_process({bin_path("ddp_worker"), "ready"},
                       one_rank({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", port}, {"DDP_TIMEOUT_SECONDS", "3"}},
                                std::chrono::seconds(40)));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("cannot reach the master at 127.0.0.1:" + port), std::string::npos) << r.describe();
  EXPECT_LT(r.seconds, 30);
}

TEST(ProcessGroup, BusyPortIsNamed) {
  int holder = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(holder, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(holder, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(holder, reinterpret_cast<sockaddr*>(&addr), &len);
  std::string port = std::to_string(ntohs(addr.sin_port));

  auto r = run_process({bin_path("ddp_worker"), "ready"},
                       one_rank({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", port}, {"DDP_TIMEOUT_SECONDS", "30"}},
                                std::chrono::seconds(40)));
  close(holder);
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("cannot listen on 127.0.0.1:" + port), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("already in use"), std::string::npos) << r.describe();
  EXPECT_LT(r.seconds, 10);  // at once, not after the timeout
}

TEST(ProcessGroup, MissingPeerFailsAfterTheTimeout) {
  std::string port = port_text();
  auto r = run_process({bin_path("ddp_worker"), "ready"},
                       one_rank({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", port}, {"DDP_TIMEOUT_SECONDS", "3"}},
                                std::chrono::seconds(40)));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("not all of them joined"), std::string::npos) << r.describe();
  EXPECT_LT(r.seconds, 30);
}

TEST(ProcessGroup, BadTimeoutVariableIsNamed) {
  auto r = run_process({bin_path("ddp_worker"), "ready"}, one_rank({{"DDP_TIMEOUT_SECONDS", "soon"}}));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("DDP_TIMEOUT_SECONDS='soon'"), std::string::npos) << r.describe();
}

}  // namespace

namespace {

TEST(ProcessGroup, AProcessOfAnotherJobIsRejected) {
  std::string port = std::to_string(free_port());
  auto base = [&](const std::string& rank, const std::string& run_id) {
    return one_rank({{"RANK", rank}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                     {"DDP_RUN_ID", run_id}, {"DDP_TIMEOUT_SECONDS", "5"}},
                    std::chrono::seconds(60));
  };
  auto master = start_background({bin_path("ddp_worker"), "ready"}, base("0", "job-a"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto intruder = run_process({bin_path("ddp_worker"), "ready"}, base("1", "job-b"));
  EXPECT_NE(intruder.exit_code, 0) << intruder.describe();
  EXPECT_NE(intruder.err.find("belongs to run 'job-b' but the master at 127.0.0.1:" + port + " runs 'job-a'"),
            std::string::npos)
      << intruder.describe();
  EXPECT_EQ(intruder.out.find("READY"), std::string::npos);
  // The master never formed a group with it, and gives up after its timeout.
  auto r = wait_background(master, std::chrono::seconds(60));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_EQ(r.out.find("READY"), std::string::npos) << r.describe();
}

TEST(ProcessGroup, TheStoreListensOnlyOnMasterAddr) {
  std::string port = std::to_string(free_port());
  auto master = start_background({bin_path("ddp_worker"), "ready"},
                                 one_rank({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", port}, {"DDP_TIMEOUT_SECONDS", "10"}}));
  auto can_connect = [&](const char* address) {
    for (int attempt = 0; attempt < 50; ++attempt) {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(std::stoi(port)));
      inet_pton(AF_INET, address, &addr.sin_addr);
      bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
      close(fd);
      if (ok) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  };
  EXPECT_TRUE(can_connect("127.0.0.1"));
  // 127.0.0.2 is this host too, but not the address the store was given.
  EXPECT_FALSE(can_connect("127.0.0.2"));
  kill(-master.pid, SIGKILL);
  wait_background(master, std::chrono::seconds(20));
}

}  // namespace
