// Rendezvous under faults (issue 12, items 1, 3 and 4; item 2 is in test_cluster.cpp): every
// wait ends within DDP_TIMEOUT_SECONDS plus a small margin, with a message that names what was
// awaited. Real processes over real loopback sockets (support/ranks.h: each body describes its
// own world and calls init_process_group), each under a timeout.

#include <support/launch.h>
#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

using namespace ddp::testing;

namespace {

// The margin the library promises past DDP_TIMEOUT_SECONDS (1 s), plus slack for a loaded
// 2-core machine.
constexpr double kMarginSeconds = 4.0;

// A listener on 127.0.0.1 that accepts every connection and never sends a byte.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd_, 16) != 0) return;
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd p{fd_, POLLIN, 0};
        if (poll(&p, 1, 50) > 0) {
          int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
          if (c >= 0) accepted_.push_back(c);
        }
      }
    });
  }
  ~SilentListener() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int c : accepted_) close(c);
    close(fd_);
  }
  int port() const { return port_; }
  size_t accepted() const { return accepted_.size(); }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<int> accepted_;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int env_rank() { return std::stoi(std::getenv("RANK")); }

// Sets this rank's view of the world before it calls init_process_group.
void describe_world(int rank, int world_size, const std::string& timeout_s) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  ::setenv("DDP_TIMEOUT_SECONDS", timeout_s.c_str(), 1);
}

// Item 1: the store client's handshake read had no time limit; a rank blocked forever.
TEST(RendezvousFaults, AMasterThatAcceptsButNeverAnswersFailsWithinTheTimeout) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        SilentListener silent;
        ASSERT_GT(silent.port(), 0);
        describe_world(1, 2, "5");
        ::setenv("MASTER_PORT", std::to_string(silent.port()).c_str(), 1);
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        const double seconds = seconds_since(start);
        EXPECT_NE(error.find("ddp: rank 1 connected to 127.0.0.1:" + std::to_string(silent.port()) +
                             " but waited 5 s for an answer to the store's handshake without getting it"),
                  std::string::npos)
            << error;
        EXPECT_LT(seconds, 5 + kMarginSeconds) << error;
        EXPECT_GE(silent.accepted(), 1u);
        std::printf("[ measured ] accept-but-silent master, DDP_TIMEOUT_SECONDS=5: rank 1 failed after %.2f s\n",
                    seconds);
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

// The same when torchrun's store is expected on MASTER_PORT: rank 0 is a client too.
TEST(RendezvousFaults, ASilentLauncherStoreFailsRankZeroWithinTheTimeout) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        SilentListener silent;
        ASSERT_GT(silent.port(), 0);
        describe_world(0, 2, "3");
        ::setenv("MASTER_PORT", std::to_string(silent.port()).c_str(), 1);
        ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        EXPECT_NE(error.find("ddp: rank 0 connected to 127.0.0.1:" + std::to_string(silent.port()) +
                             " but waited 3 s"),
                  std::string::npos)
            << error;
        EXPECT_LT(seconds_since(start), 3 + kMarginSeconds) << error;
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

// Item 3: a rank told another world size used to produce only a raw key timeout, after the
// whole timeout. Now both ranks stop at once and name both sizes.
TEST(RendezvousFaults, AWrongWorldSizeStopsEveryRankAtOnceNamingBothSizes) {
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        const int rank = env_rank();
        describe_world(rank, rank == 1 ? 3 : 2, "60");
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        EXPECT_NE(error.find("ddp: the ranks disagree on the world size"), std::string::npos) << error;
        EXPECT_NE(error.find("with world size 3"), std::string::npos) << error;
        EXPECT_NE(error.find("with world size 2"), std::string::npos) << error;
        // "At once": far below the 60 s timeout.
        EXPECT_LT(seconds_since(start), 15) << error;
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

// Item 3: a missing rank is reported with the ranks that did arrive, on every rank.
TEST(RendezvousFaults, AMissingRankIsNamedWithTheRanksThatArrived) {
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        describe_world(env_rank(), 3, "4");  // rank 2 never comes
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        if (env_rank() == 0) {
          EXPECT_NE(error.find("not all of them joined: rank(s) 0, 1 arrived, rank(s) 2 did not"), std::string::npos)
              << error;
        } else {
          EXPECT_NE(error.find("rank(s) 0, 1 arrived, rank(s) 2 did not"), std::string::npos) << error;
        }
        EXPECT_LT(seconds_since(start), 4 + kMarginSeconds) << error;
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

// Item 4: with a foreign c10d client on rank 0's port (the same default run id, a store
// client that counts as a worker), rank 0 used to pass c10d's worker count, then fail after
// a second timeout with a raw key timeout. Now: "not all of them joined", within the timeout.
TEST(RendezvousFaults, AForeignStoreClientDoesNotCountAsARankNorDoubleTheWait) {
  auto ranks = run_on_ranks(
      1,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        describe_world(0, 2, "6");
        const std::string port = std::getenv("MASTER_PORT");
        const auto start = std::chrono::steady_clock::now();
        // The client retries until rank 0's store listens.
        auto foreign = start_background(
            {DDP_PYTHON, "-c",
             "import sys, time, datetime, torch.distributed as dist\n"
             "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), 2, False, datetime.timedelta(seconds=20))\n"
             "print('FOREIGN JOINED', flush=True)\n"
             "time.sleep(20)\n",
             port},
            one_rank({}, std::chrono::seconds(60)));
        const std::string error = error_of([] { ddp::init_process_group(); });
        const double seconds = seconds_since(start);
        kill(-foreign.pid, SIGKILL);
        auto f = wait_background(foreign, std::chrono::seconds(20));
        EXPECT_NE(f.out.find("FOREIGN JOINED"), std::string::npos) << "the foreign client never connected: "
                                                                     << f.describe();
        EXPECT_NE(error.find("not all of them joined: rank(s) 0 arrived, rank(s) 1 did not"), std::string::npos)
            << error;
        EXPECT_EQ(error.find("wait timeout after"), std::string::npos) << error;
        EXPECT_LT(seconds, 6 + kMarginSeconds) << error;
        std::printf("[ measured ] rank 0 with a foreign client, DDP_TIMEOUT_SECONDS=6: failed after %.2f s\n",
                    seconds);
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
}

// Two processes claiming one rank (another job's rank 1 on the same port and run id) stop
// the rendezvous instead of forming a corrupt group.
TEST(RendezvousFaults, TwoProcessesWithOneRankAreRefused) {
  auto ranks = run_on_ranks(
      3,
      [](const std::shared_ptr<ddp::ProcessGroup>&) {
        const int launched_as = env_rank();
        // The third process claims rank 1 too, a moment after the real one.
        if (launched_as == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        describe_world(launched_as == 2 ? 1 : launched_as, 3, "20");
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([] { ddp::init_process_group(); });
        EXPECT_NE(error, "") << "process launched as rank " << launched_as << " joined a corrupt group";
        if (launched_as == 0) EXPECT_LT(seconds_since(start), 15) << error;
        std::printf("ERROR launched as rank %d: %s\n", launched_as, error.c_str());
      },
      RanksOptions().no_group());
  expect_all_succeeded(ranks);
  // Either claimant may be the one told.
  EXPECT_NE((ranks[1].out + ranks[2].out).find("two processes joined as rank 1"), std::string::npos)
      << describe_ranks(ranks);
}

// Item 5 with the real library: a worker's exception goes to its TORCHELASTIC_ERROR_FILE, and
// ddprun's summary quotes it as the original error.
TEST(RendezvousFaults, DdprunNamesTheRecordedOriginalError) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"throw", "--rank", "1"}),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "20"}}, std::chrono::seconds(60)));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("ddprun: root cause (the earliest original error of the last attempt):\n"
                       "ddprun:   rank: 1 (local rank 1)"),
            std::string::npos)
      << r.describe();
  EXPECT_NE(r.err.find("ddprun:   error: deliberate failure on rank 1\n"), std::string::npos) << r.describe();
  // Rank 0's all_reduce fails because rank 1 is gone: ddp's usual message (operation, rank,
  // cause), not Gloo's bare "Read error ... Connection reset by peer".
  EXPECT_NE(r.err.find("[rank0]: error: ddp: all_reduce failed on rank 0 of 2"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("[rank0]: error: [/"), std::string::npos) << r.describe();
}

}  // namespace
