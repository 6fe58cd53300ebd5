// Rendezvous and its failures, with real processes on loopback.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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
