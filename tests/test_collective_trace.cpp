// When a job hangs or ranks disagree: the collective trace, the stall
// explanation that names who is behind and where, the desync check, the
// trace analyser and stack dumps on demand. Each multi-rank test runs its
// ranks as real processes over a real store (support/ranks.h), so the
// assertion and every rank's code sit here together.

#include <ddp/ddp.h>

#include <gtest/gtest.h>
#include <support/ranks.h>
#include <support/subprocess.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <thread>

#include <unistd.h>

namespace fs = std::filesystem;
using ddp::testing::describe_ranks;
using ddp::testing::expect_all_succeeded;
using ddp::testing::RanksOptions;
using ddp::testing::run_on_ranks;
using ddp::testing::run_process;

namespace {

// A directory the test process and its ranks agree on.
std::string shared_dir(const std::string& name) {
  const bool child = std::getenv(ddp::testing::kRanksChildVariable) != nullptr;
  auto dir = fs::temp_directory_path() / ("ddp_trace_" + name + "_" + std::to_string(child ? ::getppid() : ::getpid()));
  if (!child) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  return dir.string();
}

void all_reduce_tagged(ddp::ProcessGroup& group, const char* tag) {
  ddp::CollectiveTag scope(tag);
  at::Tensor t = at::ones({4});
  group.all_reduce(t);
}

// The message of the exception `run` throws, or "" if it throws none.
template <typename Fn>
std::string error_of(Fn&& run) {
  try {
    run();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(CollectiveTraceUnit, RecordsInOrderAndCompletesInOrder) {
  ddp::CollectiveTrace trace(3);
  EXPECT_EQ(trace.last_entered(), 0u);
  uint64_t a, b, c, d;
  {
    ddp::CollectiveTag tag("ddp bucket 1/2");
    a = trace.begin("all_reduce", at::zeros({256}));
  }
  b = trace.begin("broadcast", at::zeros({2}, at::kLong));
  c = trace.begin("barrier", at::Tensor());
  EXPECT_EQ(describe(*trace.find(a)), "#1 (all_reduce, ddp bucket 1/2, 1.0 KiB)");
  EXPECT_EQ(trace.find(b)->tag, "");
  trace.end(b, true);
  EXPECT_EQ(trace.last_completed(), 0u);  // #1 is not done yet
  trace.end(a, true);
  EXPECT_EQ(trace.last_completed(), 2u);
  d = trace.begin("all_reduce", at::zeros({1}));  // overwrites #1 in a buffer of 3
  EXPECT_FALSE(trace.find(a).has_value());
  EXPECT_EQ(trace.recent(10).size(), 3u);
  EXPECT_EQ(trace.recent(10).front().seq, b);
  trace.end(c, true);
  trace.end(d, false);
  EXPECT_EQ(trace.last_completed(), 3u);
  EXPECT_EQ(trace.find(d)->state, ddp::CollectiveRecord::State::kFailed);
  const std::string json = trace.json_lines(7);
  EXPECT_EQ(std::count(json.begin(), json.end(), '\n'), 3);
  EXPECT_NE(json.find("{\"rank\":7,\"seq\":2,\"op\":\"broadcast\",\"dtype\":\"Long\",\"shape\":[2]"), std::string::npos)
      << json;
}

// 1. Rank 1 stops before a collective that rank 0 makes: both ranks' errors

// The resident set in bytes, from /proc/self/statm.
long resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * ::sysconf(_SC_PAGESIZE);
}

// DDP_TRACE_SIZE's maximum, 10M records, once allocated ~2 GB per rank
// before the first collective. Records now cost memory only once issued.
TEST(CollectiveTraceUnit, TheLargestCapacityCostsMemoryOnlyForIssuedRecords) {
  const long before = resident_bytes();
  ddp::CollectiveTrace trace(10000000);
  for (int i = 0; i < 1000; ++i) trace.end(trace.begin("all_reduce", at::zeros({1})), true);
  const long grown = resident_bytes() - before;
  EXPECT_LT(grown, 32L << 20) << "a 10M-record trace with 1000 records issued grew the resident set by " << grown;
  EXPECT_EQ(trace.last_completed(), 1000u);
  EXPECT_EQ(trace.recent(5000).size(), 1000u);
  EXPECT_EQ(trace.find(1)->seq, 1u);
}

TEST(CollectiveTraceUnit, ATraceSizeThatIsNotANumberIsRefused) {
  ::setenv("DDP_TRACE_SIZE", "2000abc", 1);
  const std::string message = error_of([] { ddp::CollectiveTrace::default_capacity(); });
  ::unsetenv("DDP_TRACE_SIZE");
  EXPECT_NE(message.find("DDP_TRACE_SIZE='2000abc'"), std::string::npos) << message;
}
// say who is behind, in which collective, and where it last was.
TEST(CollectiveTraceRanks, ARankThatNeverEntersACollectiveIsNamedWithItsLastCompletedOne) {
  const std::string dir = shared_dir("behind");
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.env = {{"DDP_TRACE_DIR", dir}};
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        all_reduce_tagged(*group, "step A");
        if (group->rank() == 0) {
          const auto start = std::chrono::steady_clock::now();
          std::string error = error_of([&] { all_reduce_tagged(*group, "step B"); });
          const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          std::cerr << "RANK0 ERROR: " << error << "\n";
          EXPECT_NE(error.find("rank 1 never entered collective #2 (all_reduce, step B, 16 B); its last completed "
                               "collective is #1 (all_reduce, step A, 16 B)"),
                    std::string::npos)
              << error;
          EXPECT_LT(seconds, 3 + 2 + 3) << "the timeout is 3 s";
          EXPECT_NE(error.find("trace_rank0.jsonl"), std::string::npos) << error;
        } else {
          // Behind, not dead: it still answers rank 0's question.
          std::this_thread::sleep_for(std::chrono::seconds(8));
        }
      },
      options);
  expect_all_succeeded(ranks);
  EXPECT_NE(ranks[0].err.find("RANK0 ERROR"), std::string::npos) << describe_ranks(ranks);
  fs::remove_all(dir);
}

// 1b and 4. Rank 1 skips a collective that rank 0 makes, so their sequences
// diverge; both fail, both messages name the other rank's collective, and
// the analyser finds where they went apart.
TEST(CollectiveTraceRanks, SkippedCollectiveFailsBothRanksAndTheAnalyserFindsTheDivergence) {
  const std::string dir = shared_dir("skipped");
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.env = {{"DDP_TRACE_DIR", dir}};
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        all_reduce_tagged(*group, "step A");
        std::string error;
        if (group->rank() == 0) {
          all_reduce_tagged(*group, "step B");
          error = error_of([&] { all_reduce_tagged(*group, "step C"); });
        } else {
          all_reduce_tagged(*group, "step C");  // skipped step B: pairs with rank 0's #2 silently
          at::Tensor never = at::zeros({4});
          ddp::CollectiveTag tag("waiting for rank 0");
          error = error_of([&] { group->wait(group->recv_async(never, 0, /*tag=*/99), "recv"); });
        }
        std::cerr << "RANK" << group->rank() << " ERROR: " << error << "\n";
        const int other = 1 - group->rank();
        EXPECT_NE(error.find("rank " + std::to_string(other) + " is in #3 ("), std::string::npos) << error;
        EXPECT_NE(error.find("the ranks issued different collectives"), std::string::npos) << error;
        EXPECT_NE(error.find(group->rank() == 0 ? "step C" : "waiting for rank 0"), std::string::npos) << error;
      },
      options);
  expect_all_succeeded(ranks);

  // Both traces are JSON lines; the analyser names #2, where rank 0 said
  // "step B" and rank 1 "step C".
  for (int r : {0, 1}) {
    auto check = run_process({DDP_PYTHON, "-c",
                              "import json, sys\n"
                              "rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]\n"
                              "assert rows and all(r['rank'] == int(sys.argv[2]) for r in rows), rows\n"
                              "print(len(rows))\n",
                              dir + "/trace_rank" + std::to_string(r) + ".jsonl", std::to_string(r)});
    EXPECT_EQ(check.exit_code, 0) << check.describe();
  }
  auto analysis =
      run_process({DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tools/trace/analyze_traces.py", dir});
  EXPECT_EQ(analysis.exit_code, 0) << analysis.describe();
  EXPECT_NE(analysis.out.find("first divergence at collective #2:"), std::string::npos) << analysis.out;
  EXPECT_NE(analysis.out.find("rank 0: #2 all_reduce Float [4], step B"), std::string::npos) << analysis.out;
  EXPECT_NE(analysis.out.find("rank 1: #2 all_reduce Float [4], step C"), std::string::npos) << analysis.out;
  fs::remove_all(dir);
}

// 2. Under the desync check a mismatch is an error on every rank at once.
TEST(CollectiveTraceRanks, DesyncCheckNamesBothSidesWithoutWaitingForTheTimeout) {
  RanksOptions options;
  options.collective_timeout_seconds = 60;
  options.env = {{"DDP_DEBUG", "detail"}};
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        all_reduce_tagged(*group, "warm-up");
        const auto start = std::chrono::steady_clock::now();
        std::string error = error_of([&] {
          ddp::CollectiveTag tag("loss");
          at::Tensor t = at::ones({group->rank() == 0 ? 4 : 8});
          group->all_reduce(t);
        });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_NE(error.find("the ranks are out of step at collective #2: rank 0 issued all_reduce Float [4] tag "
                             "'loss' but rank 1 issued all_reduce Float [8] tag 'loss'"),
                  std::string::npos)
            << error;
        EXPECT_LT(seconds, 5.0) << "the check must not wait for the 60 s timeout";
      },
      options);
  expect_all_succeeded(ranks);
}

// 3. A SIGSTOPped rank cannot answer; the survivor's message names it.
TEST(CollectiveTraceRanks, AStoppedRankIsNamedByTheSurvivor) {
  RanksOptions options;
  // The stall report's own finding, over Gloo: shared memory names a stopped
  // peer itself, sooner (tests/test_shm.cpp).
  options.env = {{"DDP_SHM", "0"}};
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(60);
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
        auto pids = group->all_gather(pid);
        all_reduce_tagged(*group, "step A");
        if (group->rank() == 1) {
          ::kill(::getpid(), SIGSTOP);
          return;
        }
        std::string error = error_of([&] { all_reduce_tagged(*group, "step B"); });
        // Rank 1 is still stopped: end it, so the job does not wait for it.
        ::kill(static_cast<pid_t>(pids[1].item<int64_t>()), SIGKILL);
        EXPECT_NE(error.find("rank 1 did not report its progress within 2 s: it is stopped, hung outside ddp, or "
                             "dead"),
                  std::string::npos)
            << error;
        EXPECT_NE(error.find("This rank is in collective #3 (all_reduce, step B, 16 B)"), std::string::npos) << error;
      },
      options);
  EXPECT_EQ(ranks[0].exit_code, 0) << describe_ranks(ranks);
  EXPECT_EQ(ranks[1].term_signal, SIGKILL) << describe_ranks(ranks);
}

// 5. SIGUSR1 dumps every thread's stack and the last collectives; the job
// goes on.
TEST(CollectiveTraceRanks, StackDumpOnDemandShowsTheBlockedFrameAndTheJobContinues) {
  // Over Gloo a blocked rank waits in ProcessGroup::wait; shared memory runs
  // a small all-reduce on the caller's thread, so it blocks inside the backend.
  RanksOptions options;
  options.env = {{"DDP_SHM", "0"}};
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
    auto pids = group->all_gather(pid);
    if (group->rank() == 0) {
      // Rank 1 is blocked in the all-reduce below while rank 0 sleeps.
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      ::kill(static_cast<pid_t>(pids[1].item<int64_t>()), SIGUSR1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
    all_reduce_tagged(*group, "blocked step");
    at::Tensor after = at::full({1}, 1.0);
    group->all_reduce(after);
    EXPECT_EQ(after.item<double>(), 2.0);  // it carried on
  }, options);
  expect_all_succeeded(ranks);
  const std::string& err = ranks[1].err;
  EXPECT_NE(err.find("ddp: stack dump of pid"), std::string::npos) << describe_ranks(ranks);
  EXPECT_NE(err.find("ddp::ProcessGroup::wait"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 1's last collectives"), std::string::npos) << err;
  EXPECT_NE(err.find("(all_reduce, blocked step, 16 B) not finished"), std::string::npos) << err;
}

// Rank 0 saves a distributed checkpoint while rank 1 goes on with its loss
// all-reduces: the ranks' collectives differ from #4 on. Returns this rank's
// error and how long it took to come.
std::pair<std::string, double> save_on_rank_0_only(const std::shared_ptr<ddp::ProcessGroup>& shared,
                                                   const std::string& dir) {
  ddp::ProcessGroup& group = *shared;
  torch::manual_seed(1);
  torch::nn::Linear linear(4, 2);
  ddp::DistributedDataParallel<torch::nn::Linear> model(linear, shared);
  all_reduce_tagged(group, "loss 1");
  const auto start = std::chrono::steady_clock::now();
  std::string error = error_of([&] {
    if (group.rank() == 0) {
      ddp::save_distributed_checkpoint(dir + "/checkpoint", model);
    } else {
      all_reduce_tagged(group, "loss 2");
      all_reduce_tagged(group, "loss 3");
    }
  });
  return {error, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

// Issue 34 item 12: rank 0 saves a distributed checkpoint, rank 1 goes on
// with its loss all-reduces instead. The stall report said "Every other rank
// reported entering it too" (both had passed the same numbers, with other
// collectives), and described rank 1's last collective from rank 0's own
// record of that number. Each rank's report must name the desync with both
// sides, each described from its own trace.
TEST(CollectiveTraceRanks, ASaveOnOneRankOnlyIsReportedAsADesyncNamingBothCollectives) {
  const std::string dir = shared_dir("save_desync");
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(90);
  options.env = {{"DDP_TRACE_DIR", dir}};
  auto ranks = run_on_ranks(
      2,
      [dir](const std::shared_ptr<ddp::ProcessGroup>& group) {
        const auto [error, seconds] = save_on_rank_0_only(group, dir);
        std::cerr << "RANK" << group->rank() << " ERROR: " << error << "\n";
        EXPECT_NE(error.find("rank " + std::to_string(1 - group->rank()) + " issued #"), std::string::npos) << error;
        EXPECT_NE(error.find(": the ranks issued different collectives (a desync)."), std::string::npos) << error;
        if (group->rank() == 0) {
          // Rank 1's collective as rank 1 recorded it.
          EXPECT_NE(error.find("rank 1 issued #4 (all_reduce, loss 2, 16 B) where this rank issued #4 ("),
                    std::string::npos)
              << error;
        } else {
          EXPECT_NE(error.find(" where this rank issued #4 (all_reduce, loss 2, 16 B): the ranks issued"),
                    std::string::npos)
              << error;
        }
        EXPECT_EQ(error.find("Every other rank reported entering it too"), std::string::npos) << error;
        EXPECT_EQ(error.find("frame #"), std::string::npos) << error;
        EXPECT_LT(seconds, 3 + 2 + 5) << "the collective timeout is 3 s";
        std::fflush(nullptr);
        std::_Exit(::testing::Test::HasFailure() ? 1 : 0);  // no shutdown with a peer out of step
      },
      options);
  expect_all_succeeded(ranks);
  for (const auto& rank : ranks) EXPECT_EQ(rank.err.find("frame #"), std::string::npos) << describe_ranks(ranks);
  fs::remove_all(dir);
}

// Issue 34 item 12, the hang: with the 30-minute default the ranks above
// waited for the whole timeout. While a collective waits, the ranks compare
// their newest collectives every quarter of the timeout (at most 30 s), and a
// difference ends the wait: here after 10 s of a 40 s timeout.
TEST(CollectiveTraceRanks, ASaveOnOneRankOnlyFailsLongBeforeTheTimeout) {
  const std::string dir = shared_dir("save_desync_early");
  RanksOptions options;
  options.collective_timeout_seconds = 40;
  options.timeout = std::chrono::seconds(120);
  // The periodic desync check of a waiting collective, over Gloo: shared
  // memory compares the ranks' collectives as each starts, and fails at once.
  options.env = {{"DDP_TRACE_DIR", dir}, {"DDP_SHM", "0"}};
  auto ranks = run_on_ranks(
      2,
      [dir](const std::shared_ptr<ddp::ProcessGroup>& group) {
        const auto [error, seconds] = save_on_rank_0_only(group, dir);
        std::cerr << "RANK" << group->rank() << " ERROR after " << seconds << " s: " << error << "\n";
        EXPECT_NE(error.find(": the ranks issued different collectives (a desync)."), std::string::npos) << error;
        EXPECT_NE(error.find("the ranks issued different collectives, found after 10 s of waiting"), std::string::npos)
            << error;
        EXPECT_LT(seconds, 25) << "the timeout is 40 s; the check runs after 10 s";
        std::fflush(nullptr);
        std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      options);
  expect_all_succeeded(ranks);
  fs::remove_all(dir);
}

// Issue 34 item 13: rank 0, which hosts the store, has ended; rank 1's stall
// report cannot reach the store. It printed the c10::Error's what(), frames
// and all, and c10d's TCPStore logged a warning with frames too. No message
// and no line of rank 1's output may carry a backtrace.
TEST(CollectiveTraceRanks, AReportAfterRank0EndedCarriesNoBacktrace) {
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(60);
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        all_reduce_tagged(*group, "step A");
        if (group->rank() == 0) {
          std::fflush(nullptr);
          std::_Exit(0);  // the store goes with it
        }
        std::this_thread::sleep_for(std::chrono::seconds(1));
        const std::string report = group->explain_stall("a test's question");
        std::cerr << "RANK1 REPORT: " << report << "\n";
        EXPECT_NE(report.find("the ranks' progress could not be compared"), std::string::npos) << report;
        EXPECT_EQ(report.find("frame #"), std::string::npos) << report;
        EXPECT_EQ(report.find("Exception raised from"), std::string::npos) << report;
        const std::string error = error_of([&] { all_reduce_tagged(*group, "step B"); });
        std::cerr << "RANK1 ERROR: " << error << "\n";
        EXPECT_FALSE(error.empty());
        EXPECT_EQ(error.find("frame #"), std::string::npos) << error;
        // Then shut down as a program would, the store's host gone.
        const std::string shutdown = error_of([&] { group->shutdown(); });
        EXPECT_EQ(shutdown.find("frame #"), std::string::npos) << shutdown;
      },
      options);
  EXPECT_EQ(ranks[1].exit_code, 0) << describe_ranks(ranks);
  EXPECT_NE(ranks[1].err.find("RANK1 REPORT"), std::string::npos) << describe_ranks(ranks);
  EXPECT_EQ(ranks[1].out.find("frame #"), std::string::npos) << describe_ranks(ranks);
  EXPECT_EQ(ranks[1].err.find("frame #"), std::string::npos) << describe_ranks(ranks);
}

// Under ddprun --log-dir, the traces land beside the attempt's logs.
TEST(CollectiveTraceRanks, UnderDdprunTheTraceGoesToTheLogDirectory) {
  const std::string dir = ddp::testing::make_temp_dir("ddp_trace_logdir");
  auto r = run_process({ddp::testing::bin_path("ddprun"), "--standalone", "--nproc-per-node", "2", "--log-dir", dir,
                        ddp::testing::bin_path("ddp_worker"), "stall"},
                       [] {
                         ddp::testing::RunOptions options;
                         options.env = {{"DDP_TIMEOUT_SECONDS", "3"}};
                         options.unset_env = {"DDP_TRACE_DIR", "DDP_LOG_DIR"};
                         options.timeout = std::chrono::seconds(60);
                         return options;
                       }());
  EXPECT_NE(r.exit_code, 0) << r.describe();
  const std::string trace = dir + "/attempt_0/trace_rank0.jsonl";
  ASSERT_TRUE(fs::exists(trace)) << r.describe();
  std::ifstream in(trace);
  std::string first;
  std::getline(in, first);
  EXPECT_EQ(first.rfind("{\"rank\":0,\"seq\":1,\"op\":\"barrier\"", 0), 0u) << first;
  fs::remove_all(dir);
}

}  // namespace
