// Rendezvous under faults (issue 12, items 1, 3 and 4; item 2 is in test_cluster.cpp): every
// wait ends within DDP_TIMEOUT_SECONDS plus a small margin, with a message that names what was
// awaited. Real processes over real loopback sockets, each under a timeout.

#include <gtest/gtest.h>
#include <support/launch.h>

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

// The margin the library promises past DDP_TIMEOUT_SECONDS (1 s), plus the worker's own start
// and exit (loading libtorch) on a loaded 2-core machine.
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

RunOptions rank_env(int rank, int world_size, int port, const std::string& timeout_s,
                    std::vector<std::pair<std::string, std::string>> extra = {}) {
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", std::to_string(rank)}, {"WORLD_SIZE", std::to_string(world_size)}, {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)}, {"DDP_TIMEOUT_SECONDS", timeout_s}};
  env.insert(env.end(), extra.begin(), extra.end());
  return one_rank(env, std::chrono::seconds(60));
}

// Item 1: the store client's handshake read had no time limit; a rank blocked forever.
TEST(RendezvousFaults, AMasterThatAcceptsButNeverAnswersFailsWithinTheTimeout) {
  SilentListener silent;
  ASSERT_GT(silent.port(), 0);
  auto r = run_process({bin_path("ddp_worker"), "ready"}, rank_env(1, 2, silent.port(), "5"));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("error: ddp: rank 1 connected to 127.0.0.1:" + std::to_string(silent.port()) +
                       " but waited 5 s for an answer to the store's handshake without getting it"),
            std::string::npos)
      << r.describe();
  EXPECT_LT(r.seconds, 5 + kMarginSeconds) << r.describe();
  EXPECT_GE(silent.accepted(), 1u);
  std::printf("[ measured ] accept-but-silent master, DDP_TIMEOUT_SECONDS=5: rank 1 failed after %.2f s\n",
              r.seconds);
}

// The same when torchrun's store is expected on MASTER_PORT: rank 0 is a client too.
TEST(RendezvousFaults, ASilentLauncherStoreFailsRankZeroWithinTheTimeout) {
  SilentListener silent;
  ASSERT_GT(silent.port(), 0);
  auto r = run_process({bin_path("ddp_worker"), "ready"},
                       rank_env(0, 2, silent.port(), "3", {{"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("error: ddp: rank 0 connected to 127.0.0.1:" + std::to_string(silent.port()) +
                       " but waited 3 s"),
            std::string::npos)
      << r.describe();
  EXPECT_LT(r.seconds, 3 + kMarginSeconds) << r.describe();
}

// Item 3: a rank told another world size used to produce only a raw key timeout, after the
// whole timeout. Now both ranks stop at once and name both sizes.
TEST(RendezvousFaults, AWrongWorldSizeStopsEveryRankAtOnceNamingBothSizes) {
  int port = free_port();
  auto master = start_background({bin_path("ddp_worker"), "ready"}, rank_env(0, 2, port, "60"));
  auto wrong = run_process({bin_path("ddp_worker"), "ready"}, rank_env(1, 3, port, "60"));
  auto r0 = wait_background(master, std::chrono::seconds(60));
  for (const auto* r : {&r0, &wrong}) {
    EXPECT_FALSE(r->timed_out) << r->describe();
    EXPECT_NE(r->exit_code, 0) << r->describe();
    EXPECT_NE(r->err.find("ddp: the ranks disagree on the world size"), std::string::npos) << r->describe();
    EXPECT_NE(r->err.find("with world size 3"), std::string::npos) << r->describe();
    EXPECT_NE(r->err.find("with world size 2"), std::string::npos) << r->describe();
    EXPECT_EQ(r->out.find("READY"), std::string::npos) << r->describe();
  }
  // "At once": far below the 60 s timeout.
  EXPECT_LT(wrong.seconds, 15) << wrong.describe();
  EXPECT_LT(r0.seconds, 15) << r0.describe();
}

// Item 3: a missing rank is reported with the ranks that did arrive, on every rank.
TEST(RendezvousFaults, AMissingRankIsNamedWithTheRanksThatArrived) {
  int port = free_port();
  auto start = std::chrono::steady_clock::now();
  auto master = start_background({bin_path("ddp_worker"), "ready"}, rank_env(0, 3, port, "4"));
  auto one = run_process({bin_path("ddp_worker"), "ready"}, rank_env(1, 3, port, "4"));
  auto r0 = wait_background(master, std::chrono::seconds(60));
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r0.exit_code, 0) << r0.describe();
  EXPECT_NE(r0.err.find("not all of them joined: rank(s) 0, 1 arrived, rank(s) 2 did not"), std::string::npos)
      << r0.describe();
  EXPECT_NE(one.exit_code, 0) << one.describe();
  EXPECT_NE(one.err.find("rank(s) 0, 1 arrived, rank(s) 2 did not"), std::string::npos) << one.describe();
  EXPECT_LT(total, 4 + kMarginSeconds) << r0.describe();
}

// Item 4: with a foreign c10d client on rank 0's port (the same default run id, a store
// client that counts as a worker), rank 0 used to pass c10d's worker count, then fail after
// a second timeout with a raw key timeout. Now: "not all of them joined", within the timeout.
TEST(RendezvousFaults, AForeignStoreClientDoesNotCountAsARankNorDoubleTheWait) {
  int port = free_port();
  auto start = std::chrono::steady_clock::now();
  auto master = start_background({bin_path("ddp_worker"), "ready"}, rank_env(0, 2, port, "6"));
  auto foreign = start_background(
      {DDP_PYTHON, "-c",
       "import sys, time, datetime, torch.distributed as dist\n"
       "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), 2, False, datetime.timedelta(seconds=20))\n"
       "print('FOREIGN JOINED', flush=True)\n"
       "time.sleep(20)\n",
       std::to_string(port)},
      one_rank({}, std::chrono::seconds(60)));
  auto r0 = wait_background(master, std::chrono::seconds(60));
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  kill(-foreign.pid, SIGKILL);
  auto f = wait_background(foreign, std::chrono::seconds(20));
  EXPECT_NE(f.out.find("FOREIGN JOINED"), std::string::npos) << "the foreign client never connected: " << f.describe();
  EXPECT_FALSE(r0.timed_out) << r0.describe();
  EXPECT_NE(r0.exit_code, 0) << r0.describe();
  EXPECT_NE(r0.err.find("not all of them joined: rank(s) 0 arrived, rank(s) 1 did not"), std::string::npos)
      << r0.describe();
  EXPECT_EQ(r0.err.find("wait timeout after"), std::string::npos) << r0.describe();
  EXPECT_LT(total, 6 + kMarginSeconds) << r0.describe();
  std::printf("[ measured ] rank 0 with a foreign client, DDP_TIMEOUT_SECONDS=6: failed after %.2f s\n", total);
}

// Two processes claiming one rank (another job's rank 1 on the same port and run id) stop
// the rendezvous instead of forming a corrupt group.
TEST(RendezvousFaults, TwoProcessesWithOneRankAreRefused) {
  int port = free_port();
  auto master = start_background({bin_path("ddp_worker"), "ready"}, rank_env(0, 3, port, "20"));
  auto first = start_background({bin_path("ddp_worker"), "ready"}, rank_env(1, 3, port, "20"));
  auto second = run_process({bin_path("ddp_worker"), "ready"}, rank_env(1, 3, port, "20"));
  auto r0 = wait_background(master, std::chrono::seconds(60));
  auto r1 = wait_background(first, std::chrono::seconds(60));
  EXPECT_NE(second.exit_code, 0) << second.describe();
  EXPECT_NE(r0.exit_code, 0) << r0.describe();
  EXPECT_NE(r1.exit_code, 0) << r1.describe();
  EXPECT_NE((second.err + r1.err).find("two processes joined as rank 1"), std::string::npos)
      << second.describe() << r1.describe();
  EXPECT_LT(r0.seconds, 15) << r0.describe();
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
