// Multi-process tests in one file: run_on_ranks(N, body) runs `body` on N
// ranks, each a real process with a real process group over a real TCPStore
// on loopback, so a test's assertions and every rank's code sit together:
//
//   TEST(Fsdp, Something) {
//     auto ranks = ddp::testing::run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
//       ... EXPECT_EQ(...) ...        // runs on every rank, in its own process
//     });
//     ddp::testing::expect_all_succeeded(ranks);   // runs in the test process
//   }
//
// How: the test process re-executes its own binary N times with
// --gtest_filter=<this test> and RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT. In such a
// child, run_on_ranks joins the group, runs `body`, and ends the process:
// exit 0 if `body` returned and no gtest assertion failed, 1 otherwise (an
// exception's message goes to stderr). A failed EXPECT/ASSERT inside `body`
// is printed by the child's gtest and fails the parent's test through the
// exit code. (Re-executing rather than fork(): torch's thread pools do not
// survive a fork.)
//
// Rules: call run_on_ranks once per test (the children re-run the test from
// its start, so code before the call runs in every process too, and nothing
// after it does); needs a binary linked with ddp::ddp and gtest.
#pragma once

#include <support/subprocess.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

namespace ddp::testing {

struct RanksOptions {
  /// The whole run; every rank still running then is killed.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  /// After the first rank fails, how long the others get before being
  /// killed (they may be blocked in a collective with the dead rank).
  std::chrono::milliseconds grace_after_failure{std::chrono::seconds(15)};
  /// DDP_TIMEOUT_SECONDS in the ranks: each collective's timeout.
  int collective_timeout_seconds = 30;
  /// More variables for the ranks.
  std::vector<std::pair<std::string, std::string>> env;
};

namespace detail {

inline std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info ? std::string(info->test_suite_name()) + "." + info->name() : std::string();
}

inline std::string self_executable() {
  char buffer[4096];
  ssize_t n = ::readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) throw std::runtime_error("run_on_ranks: cannot read /proc/self/exe");
  return std::string(buffer, static_cast<size_t>(n));
}

[[noreturn]] inline void run_as_rank(const std::function<void(const std::shared_ptr<ProcessGroup>&)>& body) {
  int code = 0;
  try {
    auto group = init_process_group();
    body(group);
    group->shutdown();
  } catch (const c10::Error& e) {
    std::cerr << "run_on_ranks: rank " << std::getenv("RANK") << " threw: " << e.what_without_backtrace() << "\n";
    code = 1;
  } catch (const std::exception& e) {
    std::cerr << "run_on_ranks: rank " << std::getenv("RANK") << " threw: " << e.what() << "\n";
    code = 1;
  }
  if (::testing::Test::HasFailure()) code = 1;
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // Not exit(): gtest would go on to report this test as passed, and static
  // destructors of torch's thread pools are not needed here.
  std::_Exit(code);
}

}  // namespace detail

/// The environment variable that marks a child process of run_on_ranks; it
/// holds the test's full name.
constexpr const char* kRanksChildVariable = "DDP_TEST_RANKS_CHILD";

/// Runs `body` on `world` ranks (see the top of this file) and returns each
/// rank's result, indexed by rank.
inline std::vector<ProcessResult> run_on_ranks(int world,
                                               const std::function<void(const std::shared_ptr<ProcessGroup>&)>& body,
                                               RanksOptions options = {}) {
  const std::string test = detail::current_test_name();
  if (const char* child = std::getenv(kRanksChildVariable); child && test == child) detail::run_as_rank(body);

  const std::string port = std::to_string(free_port());
  std::vector<BackgroundProcess> processes;
  for (int rank = 0; rank < world; ++rank) {
    RunOptions run;
    run.env = {{kRanksChildVariable, test},
               {"RANK", std::to_string(rank)},
               {"LOCAL_RANK", std::to_string(rank)},
               {"WORLD_SIZE", std::to_string(world)},
               {"LOCAL_WORLD_SIZE", std::to_string(world)},
               {"GROUP_RANK", "0"},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", port},
               {"DDP_TIMEOUT_SECONDS", std::to_string(options.collective_timeout_seconds)}};
    run.env.insert(run.env.end(), options.env.begin(), options.env.end());
    run.unset_env = {"SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "TORCHELASTIC_RUN_ID",
                     "DDP_RUN_ID"};
    processes.push_back(start_background({detail::self_executable(), "--gtest_filter=" + test}, run));
  }

  using Clock = std::chrono::steady_clock;
  Clock::time_point deadline = Clock::now() + options.timeout;
  std::vector<ProcessResult> results(world);
  std::vector<bool> done(world, false);
  int remaining = world;
  bool failed = false;
  while (remaining > 0) {
    const bool out_of_time = Clock::now() >= deadline;
    for (int rank = 0; rank < world; ++rank) {
      if (done[rank] || (process_alive(processes[rank].pid) && !out_of_time)) continue;
      results[rank] = wait_background(processes[rank], std::chrono::milliseconds(out_of_time ? 0 : 5000));
      done[rank] = true;
      --remaining;
      if (results[rank].exit_code != 0 && !failed) {
        failed = true;
        deadline = std::min(deadline, Clock::now() + options.grace_after_failure);
      }
    }
    if (remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return results;
}

/// Every rank's stdout and stderr, for assertion messages.
inline std::string describe_ranks(const std::vector<ProcessResult>& results) {
  std::string text;
  for (size_t rank = 0; rank < results.size(); ++rank) {
    text += "--- rank " + std::to_string(rank) + ": " + results[rank].describe() + "\n";
  }
  return text;
}

/// Fails the test unless every rank exited with 0 (in time, not by a signal).
inline void expect_all_succeeded(const std::vector<ProcessResult>& results) {
  bool ok = !results.empty();
  for (const auto& r : results) ok = ok && r.exit_code == 0 && !r.timed_out && r.term_signal == 0;
  EXPECT_TRUE(ok) << describe_ranks(results);
}

}  // namespace ddp::testing
