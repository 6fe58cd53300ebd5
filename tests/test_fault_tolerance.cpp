// Per-step fault tolerance (include/ddp/fault_tolerance.h) with real
// processes: three tests/workers/ft_worker.cpp replicas over a c10d TCPStore
// that the test process serves (as ddprun --fault-tolerance would), over real
// sockets on localhost. Workers are killed, stopped, restarted; the tests
// read their step lines (bit-exact weight hashes, sample windows, times).

#include <ddp/distributed_sampler.h>
#include <ddp/fault_tolerance.h>

#include "fault/membership.h"
#include "support/ft_replica_job.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
using namespace ddp::testing;

// An ft_worker replica: its step lines, its "skipped step" lines.
using Worker = StepReplica;

class FaultToleranceJob : public FtReplicaJob<Worker> {
 protected:
  FaultToleranceJob() : FtReplicaJob("ft_worker") {}

  // Starts a replica with `id` and extra environment; returns its index.
  // `argv` runs another program (its path first) instead of ft_worker.
  size_t start(const std::string& id, std::map<std::string, std::string> env = {},
               std::vector<std::string> argv = {}) {
    return launch(id, with_ft_replica_env(std::move(env), store_->getPort(), id, /*deadline_ms=*/3000),
                  std::move(argv));
  }

  void kill_worker(size_t i, int sig) { kill(workers_[i].pid, sig); }
};

// A DDP model keeps its hook, and may outlive the FaultTolerance that made it: the hook then
// fails with ddp's error, not a use of freed memory. One process, over a store it serves.
TEST(FaultToleranceHook, RunAfterItsFaultToleranceIsDestroyedThrowsClearly) {
  auto store = serve_ft_store();
  auto ft = std::make_unique<ddp::FaultTolerance>(ddp::FaultToleranceOptions()
                                                      .store("tcp://127.0.0.1:" + std::to_string(store->getPort()))
                                                      .replica_id("alone")
                                                      .log_membership(false));
  std::shared_ptr<ddp::CommHook> hook = ft->comm_hook();
  std::shared_ptr<ddp::ProcessGroup> local = ft->local_group();
  ddp::GradBucket bucket(0, at::ones({4}), /*is_last=*/true);
  // Alive and before its first step, the hook fails the step quietly.
  auto before = hook->run(*local, bucket);
  before->wait();
  EXPECT_TRUE(before->completed());

  ft.reset();
  try {
    hook->run(*local, bucket);
    ADD_FAILURE() << "the hook ran after its FaultTolerance was destroyed";
  } catch (const c10::Error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("ddp: the fault-tolerant hook ran after its FaultTolerance (replica 'alone') was destroyed"),
              std::string::npos)
        << what;
  }
}

// Buckets are never rebuilt under fault tolerance, so never fitted to the link: without a cap of
// the user's they are 2 MiB, not PyTorch's 25 MiB, so that backward overlaps the all-reduce of
// a model of a few tens of MB (bench/CHURN.md measured 40.5 samples/s at 25 MiB, 47.6 at 2 MiB,
// and 46.7 for plain DDP, whose buckets are fitted). A cap of the user's is kept.
TEST(FaultToleranceHook, DdpOptionsCapBucketsAtTwoMiBUnlessTheUserChose) {
  auto store = serve_ft_store();
  ddp::FaultTolerance ft(ddp::FaultToleranceOptions()
                             .store("tcp://127.0.0.1:" + std::to_string(store->getPort()))
                             .replica_id("alone")
                             .log_membership(false));
  const ddp::DDPOptions chosen = ft.ddp_options();
  ASSERT_TRUE(chosen.bucket_cap_mb().has_value());
  EXPECT_EQ(*chosen.bucket_cap_mb(), 2.0);
  EXPECT_FALSE(chosen.rebuild_buckets());
  EXPECT_TRUE(chosen.comm_hook() != nullptr);
  EXPECT_EQ(*ft.ddp_options(ddp::DDPOptions().bucket_cap_mb(25)).bucket_cap_mb(), 25.0);

  // Eight 4 MiB layers: a bucket each, where 25 MiB buckets (the first 1 MiB) make 2.
  torch::nn::Sequential net;
  for (int i = 0; i < 8; ++i) net->push_back(torch::nn::Linear(1024, 1024));
  ddp::DistributedDataParallel<torch::nn::Sequential> model(net, ft.local_group(), ft.ddp_options());
  EXPECT_EQ(model.bucket_assignment().size(), 8u);
  ddp::DistributedDataParallel<torch::nn::Sequential> pytorch_sized(
      net, ft.local_group(), ft.ddp_options(ddp::DDPOptions().first_bucket_cap_mb(1).bucket_cap_mb(25)));
  EXPECT_EQ(pytorch_sized.bucket_assignment().size(), 2u);
}

// The pure rules: the membership record and the sampler's windows.
TEST(FaultTolerancePure, MembershipRoundTrips) {
  ddp::detail::Membership m;
  m.joined_upto = 5;
  m.carried = 2;
  m.ids = {"node0/0/inc0", "node1/0/inc0", "node2/0/inc3"};
  auto back = ddp::detail::decode_membership(ddp::detail::encode_membership(m));
  EXPECT_EQ(back.joined_upto, 5);
  EXPECT_EQ(back.carried, 2);
  EXPECT_EQ(back.ids, m.ids);
  EXPECT_EQ(back.rank_of("node2/0/inc3"), 2);
  EXPECT_EQ(back.rank_of("nobody"), -1);
}

TEST(FaultTolerancePure, SamplerCoversEveryIndexOnceWhateverTheMembership) {
  ddp::FaultTolerantSampler sampler(100, 7, /*seed=*/5);
  const std::vector<int64_t> order = sampler.order();
  // DistributedSampler's permutation for the same seed and epoch.
  EXPECT_EQ(order, ddp::distributed_sampler_indices(100, ddp::SamplerOptions(1, 0).seed(5), 0));
  std::vector<int> sizes = {3, 3, 2, 2, 2, 4, 1, 3, 3, 3, 3, 3};
  std::vector<int64_t> seen;
  for (size_t i = 0; sampler.epoch() == 0; ++i) {
    const int n = sizes[i % sizes.size()];
    std::vector<int64_t> joined;
    for (int r = 0; r < n; ++r) {
      auto part = sampler.batch(r, n);
      EXPECT_FALSE(part.empty());
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(joined, sampler.window(n));
    if (i % 4 == 3) continue;  // a skipped step: its window comes back
    seen.insert(seen.end(), joined.begin(), joined.end());
    sampler.advance(n);
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(100);
  for (int i = 0; i < 100; ++i) all[i] = i;
  EXPECT_EQ(seen, all);
}

// A SIGKILLed replica: the two survivors go on with a new group within half
// a second, skip the step in flight identically, keep identical weights and
// finish; the epoch's samples are each trained once among the survivors.
TEST_F(FaultToleranceJob, CrashedReplicaSurvivorsContinueWithinHalfASecond) {
  std::map<std::string, std::string> env{{"FT_STEPS", "70"}, {"FT_STEP_MS", "15"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  ASSERT_TRUE(wait_until([&] { return workers_[2].committed() >= 15; }, 40)) << logs();
  const int64_t gen_before = workers_[0].steps().back().gen;
  const int64_t killed_at = now_us();
  kill_worker(2, SIGKILL);
  wait_exit({0, 1}, 40);
  ASSERT_EQ(workers_[0].status, 0) << logs();
  ASSERT_EQ(workers_[1].status, 0) << logs();

  // Recovery: the first committed step after the kill.
  for (size_t i : {0, 1}) {
    int64_t first = -1;
    for (const auto& s : workers_[i].steps()) {
      if (s.t_us > killed_at && s.gen > gen_before) {
        first = s.t_us;
        break;
      }
    }
    ASSERT_GT(first, 0) << logs();
    const double ms = (first - killed_at) / 1000.0;
    std::printf("[ measured ] %s: kill -> first committed step of 2 replicas: %.1f ms\n", workers_[i].id.c_str(), ms);
    EXPECT_LT(ms, 500.0) << logs();
  }
  expect_same_weights({0, 1});
  EXPECT_EQ(workers_[0].final_hash(), workers_[1].final_hash());
  EXPECT_FALSE(workers_[0].final_hash().empty());
  const std::string out0 = read_file(workers_[0].out);
  const auto stats = out0.find("stats ");
  ASSERT_NE(stats, std::string::npos) << out0;
  std::printf("[ measured ] %s\n", out0.substr(stats, out0.find('\n', stats) - stats).c_str());
  EXPECT_NE(out0.find("\"ft_skipped_steps\": 1,"), std::string::npos) << out0;
  // Skipped identically.
  EXPECT_EQ(workers_[0].skipped(), workers_[1].skipped());
  // One line per change on every survivor, naming the lost replica and why.
  for (size_t i : {0, 1}) {
    const std::string err = read_file(workers_[i].err);
    EXPECT_NE(err.find("ddp: membership: replica w2/inc0 left (crash"), std::string::npos) << err;
    EXPECT_NE(err.find("3 -> 2 replicas"), std::string::npos) << err;
  }

  // Every sample of each full epoch, once, among the committed steps: the
  // killed replica's in-flight samples were redone by the survivors.
  std::map<int64_t, std::vector<int64_t>> by_step;
  for (const auto& s : workers_[0].steps()) by_step[s.step] = s.window;
  ASSERT_EQ(static_cast<int64_t>(by_step.size()), 70) << logs();
  std::vector<int64_t> epoch;
  int epochs = 0;
  for (const auto& [step, window] : by_step) {
    epoch.insert(epoch.end(), window.begin(), window.end());
    if (static_cast<int64_t>(epoch.size()) >= 240) {
      ASSERT_EQ(epoch.size(), 240u) << "an epoch's windows overlap its end";
      std::vector<int64_t> sorted = epoch;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t i = 0; i < 240; ++i) ASSERT_EQ(sorted[i], i) << "epoch " << epochs << " step " << step;
      epoch.clear();
      ++epochs;
    }
  }
  EXPECT_GE(epochs, 2);
  // Each committed step's window was split among its members.
  std::map<int64_t, std::vector<int64_t>> mine;
  for (size_t i : {0, 1}) {
    for (const auto& s : workers_[i].steps()) {
      if (s.size == 2) mine[s.step].insert(mine[s.step].end(), s.mine.begin(), s.mine.end());
    }
  }
  for (auto& [step, got] : mine) {
    std::sort(got.begin(), got.end());
    std::vector<int64_t> want = by_step[step];
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << "step " << step;
  }
}

// A SIGSTOPped replica: fenced out after the deadline; the survivors commit
// again within deadline + 1 s. Woken, it finds it was removed and exits
// non-zero saying so; the survivors' group is untouched.
TEST_F(FaultToleranceJob, HungReplicaIsFencedOutAndExitsWhenWoken) {
  std::map<std::string, std::string> env{{"FT_STEPS", "90"}, {"FT_STEP_MS", "15"}, {"DDP_FT_DEADLINE_MS", "2000"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  ASSERT_TRUE(wait_until([&] { return workers_[1].committed() >= 10; }, 40)) << logs();
  const int64_t gen_before = workers_[0].steps().back().gen;
  const int64_t stopped_at = now_us();
  kill_worker(1, SIGSTOP);
  const int64_t first = first_step_time(
      workers_[0], [&](const StepLine& s) { return s.t_us > stopped_at && s.gen > gen_before && s.size == 2; }, 20);
  ASSERT_GE(first, 0) << logs();
  const double ms = (first - stopped_at) / 1000.0;
  std::printf("[ measured ] SIGSTOP -> first committed step of 2 replicas: %.1f ms (deadline 2000 ms)\n", ms);
  EXPECT_LT(ms, 3000.0) << logs();
  // Woken: it must find its generation stale and exit, not disturb the others.
  kill_worker(1, SIGCONT);
  wait_exit({1}, 20);
  EXPECT_TRUE(WIFEXITED(workers_[1].status) && WEXITSTATUS(workers_[1].status) == 3) << logs();
  const std::string err1 = read_file(workers_[1].err);
  EXPECT_NE(err1.find("fenced out"), std::string::npos) << err1;
  wait_exit({0, 2}, 40);
  ASSERT_EQ(workers_[0].status, 0) << logs();
  ASSERT_EQ(workers_[2].status, 0) << logs();
  expect_same_weights({0, 2});
  EXPECT_EQ(workers_[0].final_hash(), workers_[2].final_hash());
  EXPECT_EQ(workers_[0].skipped(), workers_[2].skipped());
  const std::string err0 = read_file(workers_[0].err);
  EXPECT_NE(err0.find("replica w1/inc0 left (deadline"), std::string::npos) << err0;
}

// A replica killed and restarted under a new id: it joins at a step
// boundary, receives the state from a live member (its own initial weights
// differ: another seed), and from then on its weights equal the others' bit
// for bit at every step. The whole run then equals, step by step and at the
// end, a replay with the same membership sequence scripted without any
// failure: the same replica leaves cleanly at the step where the crash
// happened and the joiner is let in at the step where it was.
TEST_F(FaultToleranceJob, RestartedReplicaHealsFromALivePeerBitForBit) {
  std::map<std::string, std::string> env{{"FT_STEPS", "60"}, {"FT_STEP_MS", "15"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  ASSERT_TRUE(wait_until([&] { return workers_[2].committed() >= 10; }, 40)) << logs();
  kill_worker(2, SIGKILL);
  const int64_t killed_step = workers_[0].committed();
  ASSERT_TRUE(wait_until([&] { return workers_[0].committed() >= killed_step + 5; }, 20)) << logs();
  auto joiner_env = env;
  joiner_env["FT_SEED"] = "99";
  const size_t joiner = start("w2/inc1", joiner_env);
  wait_exit({0, 1, joiner}, 60);
  for (size_t i : {size_t(0), size_t(1), joiner}) ASSERT_EQ(workers_[i].status, 0) << logs();
  ASSERT_FALSE(workers_[joiner].steps().empty()) << logs();
  expect_same_weights({0, 1, joiner});
  EXPECT_EQ(workers_[joiner].final_hash(), workers_[0].final_hash());
  const std::string joiner_err = read_file(workers_[joiner].err);
  EXPECT_NE(joiner_err.find("healed from"), std::string::npos) << joiner_err;

  // The membership sequence: 3 replicas up to `left`, 2 up to `back`, 3 after.
  std::map<int64_t, StepLine> crash;
  for (const auto& s : workers_[0].steps()) crash[s.step] = s;
  int64_t left = -1, back = -1;
  for (const auto& [step, s] : crash) {
    if (left < 0 && s.size == 2) left = step;
    if (left >= 0 && back < 0 && s.size == 3) back = step;
  }
  ASSERT_GT(left, 0);
  ASSERT_GT(back, left);
  std::printf("[ measured ] crash run: 3 replicas up to step %lld, 2 up to %lld, then 3\n",
              static_cast<long long>(left), static_cast<long long>(back));

  // The replay, on a fresh store.
  new_store();
  const size_t crashed_run = workers_.size();
  auto replay_env = env;
  replay_env["FT_ADMIT_AT"] = std::to_string(back - 1);  // the step whose vote lets the joiner in
  const size_t r0 = start("r0/inc0", replay_env), r1 = start("r1/inc0", replay_env);
  auto leaver_env = replay_env;
  leaver_env["FT_LEAVE_AT"] = std::to_string(left);
  const size_t r2 = start("r2/inc0", leaver_env);
  wait_exit({r2}, 40);
  auto replay_joiner_env = replay_env;
  replay_joiner_env["FT_SEED"] = "99";
  const size_t r3 = start("r2/inc1", replay_joiner_env);
  wait_exit({r0, r1, r3}, 60);
  for (size_t i : {r0, r1, r2, r3}) ASSERT_EQ(workers_[i].status, 0) << logs();
  ASSERT_GT(crashed_run, 0u);
  std::map<int64_t, StepLine> replay;
  for (const auto& s : workers_[r0].steps()) replay[s.step] = s;
  ASSERT_EQ(replay.size(), crash.size());
  for (const auto& [step, s] : crash) {
    EXPECT_EQ(replay[step].size, s.size) << "step " << step;
    EXPECT_EQ(replay[step].hash, s.hash) << "step " << step;
  }
  EXPECT_EQ(workers_[r3].final_hash(), workers_[0].final_hash());
  EXPECT_EQ(workers_[r0].final_hash(), workers_[0].final_hash());
}

// A replica that leaves cleanly mid-training: the attempt in flight is
// skipped by every survivor that had begun it (one that had not yet begun it
// only forms the new group first), and their weights stay equal.
TEST_F(FaultToleranceJob, SkippedStepIsSkippedByEverySurvivor) {
  std::map<std::string, std::string> env{{"FT_STEPS", "30"}, {"FT_STEP_MS", "10"}};
  start("w0/inc0", env);
  start("w1/inc0", env);
  auto leaver = env;
  leaver["FT_LEAVE_AT"] = "12";
  start("w2/inc0", leaver);
  wait_exit({0, 1, 2}, 60);
  for (size_t i : {0, 1, 2}) ASSERT_EQ(workers_[i].status, 0) << logs();
  // The only attempt either survivor may drop is step 12's, the one the leaver left in.
  for (size_t i : {0, 1}) {
    for (const auto& line : workers_[i].skipped()) EXPECT_EQ(line, "skipped step 12 gen 1") << logs();
    EXPECT_LE(workers_[i].skipped().size(), 1u) << logs();
  }
  expect_same_weights({0, 1});
  EXPECT_EQ(workers_[0].final_hash(), workers_[1].final_hash());
  // The skipped attempt left no trace: step 12 is trained once, by two.
  for (const auto& s : workers_[0].steps()) {
    if (s.step == 12) EXPECT_EQ(s.size, 2);
    if (s.step == 11) EXPECT_EQ(s.size, 3);
  }
  const std::string err = read_file(workers_[0].err);
  EXPECT_NE(err.find("replica w2/inc0 left (left cleanly)"), std::string::npos) << err;
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

int64_t rss_kb(pid_t pid) {
  std::stringstream in(read_file("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// 20 kills and rejoins: a survivor's descriptors, threads and memory, and the
// store's keys, stay flat (abandoned groups are destroyed, old keys deleted).
// Anyone who can reach a member's liveness port can connect: hostile bytes there (an endless
// line, binary junk, a flood of beats claiming another member's name) must not crash the
// member, hold up its beats or change the membership. The job trains on and ends equal.
TEST_F(FaultToleranceJob, HostileBytesOnALivenessPortChangeNothing) {
  std::map<std::string, std::string> env{{"FT_STEPS", "60"}, {"FT_STEP_MS", "15"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  ASSERT_TRUE(wait_until([&] { return workers_[0].committed() >= 10; }, 40)) << logs();
  const std::string address(reinterpret_cast<const char*>(store_->get("ft/live/w0/inc0").data()),
                            store_->get("ft/live/w0/inc0").size());
  const size_t colon = address.rfind(':');
  std::vector<int> hostile;
  for (int k = 0; k < 3; ++k) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    ASSERT_EQ(inet_pton(AF_INET, address.substr(0, colon).c_str(), &in.sin_addr), 1) << address;
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&in), sizeof in), 0) << address;
    hostile.push_back(fd);
  }
  std::string junk(200000, '\0');
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<char>((i * 7919) % 251);
  const std::string endless(100000, 'x');
  std::string impostor = "hello w1/inc0\n";
  for (int i = 0; i < 20000; ++i) impostor += "b\n";
  (void)::send(hostile[0], endless.data(), endless.size(), MSG_NOSIGNAL);
  (void)::send(hostile[1], junk.data(), junk.size(), MSG_NOSIGNAL);
  (void)::send(hostile[2], impostor.data(), impostor.size(), MSG_NOSIGNAL);
  wait_exit({0, 1, 2}, 60);
  for (int fd : hostile) ::close(fd);
  for (size_t i : {0, 1, 2}) ASSERT_EQ(workers_[i].status, 0) << logs();
  EXPECT_TRUE(workers_[0].skipped().empty()) << logs();
  EXPECT_EQ(read_file(workers_[0].err).find("membership:"), std::string::npos) << logs();
  expect_same_weights({0, 1, 2});
  EXPECT_EQ(workers_[0].final_hash(), workers_[2].final_hash());
}

TEST_F(FaultToleranceJob, TwentyKillRejoinCyclesLeakNothing) {
  std::map<std::string, std::string> env{{"FT_STEPS", "1000000"}, {"FT_STEP_MS", "5"}, {"FT_QUIET_STEPS", "1"}};
  for (int i = 0; i < 3; ++i) start("w" + std::to_string(i) + "/inc0", env);
  ASSERT_TRUE(wait_until([&] { return workers_[2].committed() >= 3; }, 40)) << logs();
  const pid_t survivor = workers_[0].pid;
  const std::string proc = "/proc/" + std::to_string(survivor);
  struct Sample {
    int fds, threads;
    int64_t rss_kb, keys;
  };
  std::vector<Sample> samples;
  size_t victim = 2;
  const auto started = Clock::now();
  for (int cycle = 1; cycle <= 20; ++cycle) {
    kill_worker(victim, SIGKILL);
    wait_exit({victim}, 10);
    const int64_t before = workers_[0].committed();
    victim = start("w2/inc" + std::to_string(cycle), env);
    ASSERT_TRUE(wait_until([&] { return workers_[victim].committed() >= before + 2; }, 30))
        << "cycle " << cycle << "\n" << logs();
    // Let the retired group's destruction finish on its thread.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    samples.push_back({count_entries(proc + "/fd"), count_entries(proc + "/task"), rss_kb(survivor),
                       store_->getNumKeys()});
  }
  std::printf("[ measured ] 20 kill/rejoin cycles in %.1f s\n",
              std::chrono::duration<double>(Clock::now() - started).count());
  for (size_t i = 0; i < samples.size(); ++i) {
    std::printf("  cycle %2zu: fds %d threads %d rss %lld kB store keys %lld\n", i + 1, samples[i].fds,
                samples[i].threads, static_cast<long long>(samples[i].rss_kb), static_cast<long long>(samples[i].keys));
  }
  // After a few cycles to warm up (allocator arenas, lazily made threads).
  const Sample& base = samples[4];
  for (size_t i = 5; i < samples.size(); ++i) {
    EXPECT_LE(samples[i].fds, base.fds + 2) << "cycle " << i + 1;
    EXPECT_LE(samples[i].threads, base.threads + 2) << "cycle " << i + 1;
    EXPECT_LE(samples[i].rss_kb, base.rss_kb + 30 * 1024) << "cycle " << i + 1;
    EXPECT_LE(samples[i].keys, base.keys + 20) << "cycle " << i + 1;
  }
  for (size_t i : {size_t(0), size_t(1)}) EXPECT_FALSE(reap(workers_[i])) << logs();
  if (HasFailure()) {
    try {
      for (const auto& key : store_->listKeys()) std::printf("  key %s\n", key.c_str());
    } catch (const std::exception&) {
    }
  }
}

// wine_ddp under DDP_FAULT_TOLERANCE=1 (what ddprun --fault-tolerance
// sets): three replicas, one SIGKILLed mid-training; the two others finish
// the 100 epochs and print the test accuracy, and the fault-tolerance
// counters count the skipped step.
TEST_F(FaultToleranceJob, WineTrainsThroughALostReplica) {
  const std::string wine = (fs::path(worker_path()).parent_path() / "wine_ddp").string();
  if (!fs::exists(wine)) GTEST_SKIP() << "wine_ddp is not built";
  const std::string metrics = (dir_ / "metrics.jsonl").string();
  std::vector<std::string> argv{wine, "100", "50", "--checkpoint-dir", dir_.string(), "--metrics", metrics};
  for (int i = 0; i < 3; ++i) start("wine" + std::to_string(i) + "/inc0", {}, argv);
  ASSERT_TRUE(wait_until(
      [&] {
        for (size_t i : {0, 1, 2}) {
          if (read_file(workers_[i].out).find("Epoch 20,") != std::string::npos) return true;
        }
        return false;
      },
      60))
      << logs();
  // Kill a replica that is not printing (so the log stays in one place).
  size_t victim = 2;
  for (size_t i : {0, 1, 2}) {
    if (read_file(workers_[i].out).find("Epoch") == std::string::npos) victim = i;
  }
  kill_worker(victim, SIGKILL);
  std::vector<size_t> survivors;
  for (size_t i : {0, 1, 2}) {
    if (i != victim) survivors.push_back(i);
  }
  wait_exit(survivors, 90);
  std::string printed;
  for (size_t i : survivors) {
    ASSERT_EQ(workers_[i].status, 0) << logs();
    printed += read_file(workers_[i].out);
  }
  EXPECT_NE(printed.find("Epoch 99, Loss"), std::string::npos) << logs();
  const auto accuracy = printed.find("Test accuracy: ");
  ASSERT_NE(accuracy, std::string::npos) << logs();
  std::printf("[ measured ] wine_ddp, 3 replicas, one killed after epoch 20: %s\n",
              printed.substr(accuracy, printed.find('\n', accuracy) - accuracy).c_str());
  EXPECT_NE(printed.find("\"ft_skipped_steps\": "), std::string::npos) << logs();
  EXPECT_TRUE(fs::exists(dir_ / "model_final.pt"));
  const std::string m = read_file(metrics);
  EXPECT_NE(m.find("\"epoch\": 99"), std::string::npos) << m;
  EXPECT_NE(m.find("ft_committed_steps"), std::string::npos) << m;
  for (size_t i : survivors) {
    EXPECT_NE(read_file(workers_[i].err).find("left (crash"), std::string::npos) << logs();
  }
}

}  // namespace
