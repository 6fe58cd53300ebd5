// The process group's rendezvous and its errors, on real processes over real
// loopback sockets (support/ranks.h). Most bodies describe their own world:
// they join no group first, set the variables a launcher would (or would get
// wrong), call init_process_group and check what it does.

#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

using namespace ddp::testing;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void expect_rendezvous_and_reduce(int world) {
  auto ranks = run_on_ranks(world, [world](const std::shared_ptr<ddp::ProcessGroup>& group) {
    EXPECT_EQ(group->size(), world);
    EXPECT_EQ(group->rank(), std::stoi(std::getenv("RANK")));
    at::Tensor one = at::ones({1});
    group->all_reduce(one);
    EXPECT_EQ(one.item<double>(), world);
    group->barrier();
  });
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, TwoRanksRendezvousAndReduce) { expect_rendezvous_and_reduce(2); }

TEST(ProcessGroup, ThreeRanksRendezvousAndReduce) { expect_rendezvous_and_reduce(3); }

TEST(ProcessGroup, SingleProcessNeedsNoLauncher) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                 "MASTER_PORT"}) {
          ::unsetenv(name);
        }
        auto group = ddp::init_process_group();
        EXPECT_EQ(group->rank(), 0);
        EXPECT_EQ(group->size(), 1);
        at::Tensor one = at::ones({1});
        group->all_reduce(one);
        EXPECT_EQ(one.item<double>(), 1.0);
        group->shutdown();
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, BadEnvironmentsNameTheVariable) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        struct Case {
          std::vector<std::pair<std::string, std::string>> env;
          std::string expected;
        };
        const std::vector<Case> cases = {
            {{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}},
             "RANK must be less than WORLD_SIZE"},
            {{{"RANK", "0"}, {"WORLD_SIZE", "abc"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}},
             "WORLD_SIZE='abc' is not an integer"},
            {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}, {"MASTER_PORT", "29500"}},
             "MASTER_ADDR is not set"},
            {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "port"}},
             "MASTER_PORT='port'"},
        };
        for (const auto& c : cases) {
          for (const auto& [name, value] : c.env) {
            if (value.empty()) {
              ::unsetenv(name.c_str());
            } else {
              ::setenv(name.c_str(), value.c_str(), 1);
            }
          }
          const auto start = std::chrono::steady_clock::now();
          const std::string error = error_of([] { ddp::init_process_group(); });
          EXPECT_NE(error.find(c.expected), std::string::npos) << "expected '" << c.expected << "', got: " << error;
          EXPECT_LT(seconds_since(start), 5) << c.expected << ": refused before any rendezvous";
        }
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, UnreachableMasterFailsAfterTheTimeout) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        // Rank 1 of 2; nothing listens on the free MASTER_PORT it was given.
        ::setenv("RANK", "1", 1);
        ::setenv("WORLD_SIZE", "2", 1);
        ::setenv("DDP_TIMEOUT_SECONDS", "3", 1);
        const std::string port = std::getenv("MASTER_PORT");
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        EXPECT_NE(error.find("cannot reach the master at 127.0.0.1:" + port), std::string::npos) << error;
        EXPECT_GE(seconds_since(start), 2.5) << "gave up before the timeout: " << error;
        EXPECT_LT(seconds_since(start), 30);
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, BusyPortIsNamed) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        int holder = socket(AF_INET, SOCK_STREAM, 0);
        ASSERT_GE(holder, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
        ASSERT_EQ(listen(holder, 1), 0);
        socklen_t len = sizeof(addr);
        getsockname(holder, reinterpret_cast<sockaddr*>(&addr), &len);
        const std::string port = std::to_string(ntohs(addr.sin_port));
        ::setenv("WORLD_SIZE", "2", 1);
        ::setenv("MASTER_PORT", port.c_str(), 1);
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        close(holder);
        EXPECT_NE(error.find("cannot listen on 127.0.0.1:" + port), std::string::npos) << error;
        EXPECT_NE(error.find("already in use"), std::string::npos) << error;
        EXPECT_LT(seconds_since(start), 10);  // at once, not after the 30 s timeout
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, MissingPeerFailsAfterTheTimeout) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        ::setenv("WORLD_SIZE", "2", 1);  // rank 1 never comes
        ::setenv("DDP_TIMEOUT_SECONDS", "3", 1);
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        EXPECT_NE(error.find("not all of them joined"), std::string::npos) << error;
        EXPECT_GE(seconds_since(start), 2.5) << error;
        EXPECT_LT(seconds_since(start), 30);
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, BadTimeoutVariableIsNamed) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        ::setenv("DDP_TIMEOUT_SECONDS", "soon", 1);
        const std::string error = error_of([] { ddp::init_process_group(); });
        EXPECT_NE(error.find("DDP_TIMEOUT_SECONDS='soon'"), std::string::npos) << error;
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, AProcessOfAnotherJobIsRejected) {
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        const int rank = std::stoi(std::getenv("RANK"));
        const std::string port = std::getenv("MASTER_PORT");
        ::setenv("DDP_TIMEOUT_SECONDS", "5", 1);
        ::setenv("DDP_RUN_ID", rank == 0 ? "job-a" : "job-b", 1);
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the master listens first
        const std::string error = error_of([] { ddp::init_process_group(); });
        if (rank == 1) {
          EXPECT_NE(error.find("belongs to run 'job-b' but the master at 127.0.0.1:" + port + " runs 'job-a'"),
                    std::string::npos)
              << error;
        } else {
          // The master never formed a group with it, and gives up after its timeout.
          EXPECT_NE(error, "") << "rank 0 formed a group with another job's process";
        }
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

TEST(ProcessGroup, TheStoreListensOnlyOnMasterAddr) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        ::setenv("WORLD_SIZE", "2", 1);
        ::setenv("DDP_TIMEOUT_SECONDS", "5", 1);
        const int port = std::stoi(std::getenv("MASTER_PORT"));
        // The master waits for a rank 1 that never comes; meanwhile its store listens.
        std::thread master([] { error_of([] { ddp::init_process_group(); }); });
        auto can_connect = [&](const char* address) {
          for (int attempt = 0; attempt < 30; ++attempt) {
            int fd = socket(AF_INET, SOCK_STREAM, 0);
            sockaddr_in addr{};
            addr.sin_family = AF_INET;
            addr.sin_port = htons(static_cast<uint16_t>(port));
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
        master.join();
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

}  // namespace
