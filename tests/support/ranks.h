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
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT and, as ddprun
// exports, DDP_DIAGNOSTIC_HANDLERS=1. In such a
// child, run_on_ranks joins the group, runs `body`, and ends the process:
// exit 0 if `body` returned and no gtest assertion failed, 1 otherwise (an
// exception's message goes to stderr). A failed EXPECT/ASSERT inside `body`
// is printed by the child's gtest and fails the parent's test through the
// exit code. (Re-executing rather than fork(): torch's thread pools do not
// survive a fork.)
//
// Rules: call run_on_ranks (or run_phases_on_ranks) once per test (the
// children re-run the test from its start, so code before the call runs in
// every process too, and nothing after it does); needs a binary linked with
// ddp::ddp and gtest.
//
// Tests of the environment and the rendezvous themselves set
// RanksOptions::join_group(false): the body then gets no group and calls
// init_process_group itself, after changing its own variables (setenv) to
// whatever world it means to describe. Tests whose steps need different world
// sizes (a checkpoint written at 2 ranks, resumed at 3) run phases, one after
// the other, with files in a RanksTempDir, which every process of the test
// sees at the same path.
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
#include <filesystem>
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
  /// Whether the ranks join the group before the body; when false the body
  /// gets nullptr and calls init_process_group itself.
  bool join_group = true;

  RanksOptions& no_group() {
    join_group = false;
    return *this;
  }
};

using RankBody = std::function<void(const std::shared_ptr<ProcessGroup>&)>;

/// One step of run_phases_on_ranks: `world` ranks running `body`.
struct RanksPhase {
  int world;
  RankBody body;
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

[[noreturn]] inline void run_as_rank(const RankBody& body, bool join_group) {
  int code = 0;
  try {
    std::shared_ptr<ProcessGroup> group = join_group ? init_process_group() : nullptr;
    body(group);
    if (group) group->shutdown();
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
/// holds the test's full name (and "#phase" for a phase after the first).
constexpr const char* kRanksChildVariable = "DDP_TEST_RANKS_CHILD";

/// The variable that holds a RanksTempDir's path for the ranks.
constexpr const char* kRanksDirVariable = "DDP_TEST_RANKS_DIR";

/// Whether this process is a rank of the current test (not the test process).
inline bool in_rank_process() {
  const char* child = std::getenv(kRanksChildVariable);
  if (!child) return false;
  const std::string target = child;
  const std::string test = detail::current_test_name();
  return target == test || target.rfind(test + "#", 0) == 0;
}

/// A directory the test process and all its ranks share: made (and at the
/// end removed) by the test process, found again by the ranks through the
/// environment they inherit. One per test.
class RanksTempDir {
 public:
  RanksTempDir() {
    if (in_rank_process()) {
      const char* inherited = std::getenv(kRanksDirVariable);
      if (!inherited) throw std::runtime_error("RanksTempDir: the rank process did not inherit its directory");
      path_ = inherited;
      return;
    }
    path_ = make_temp_dir("ddp_ranks");
    ::setenv(kRanksDirVariable, path_.c_str(), 1);
    owner_ = true;
  }
  ~RanksTempDir() {
    if (!owner_) return;
    ::unsetenv(kRanksDirVariable);
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  RanksTempDir(const RanksTempDir&) = delete;
  RanksTempDir& operator=(const RanksTempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  bool owner_ = false;
};

/// Runs the phases one after the other (see the top of this file), each on
/// its own ranks over its own store, and returns each phase's results. A
/// phase in which a rank failed is the last one run.
inline std::vector<std::vector<ProcessResult>> run_phases_on_ranks(const std::vector<RanksPhase>& phases,
                                                                  RanksOptions options = {}) {
  const std::string test = detail::current_test_name();
  if (in_rank_process()) {
    const std::string target = std::getenv(kRanksChildVariable);
    const size_t hash = target.find('#');
    const size_t phase = hash == std::string::npos ? 0 : std::stoul(target.substr(hash + 1));
    if (phase >= phases.size()) throw std::runtime_error("run_on_ranks: no phase " + std::to_string(phase));
    detail::run_as_rank(phases[phase].body, options.join_group);
  }

  std::vector<std::vector<ProcessResult>> all;
  for (size_t phase = 0; phase < phases.size(); ++phase) {
    const int world = phases[phase].world;
    const std::string child = phases.size() == 1 ? test : test + "#" + std::to_string(phase);
    const std::string port = std::to_string(free_port());
    std::vector<BackgroundProcess> processes;
    for (int rank = 0; rank < world; ++rank) {
      RunOptions run;
      run.env = {{kRanksChildVariable, child},
                 {"RANK", std::to_string(rank)},
                 {"LOCAL_RANK", std::to_string(rank)},
                 {"WORLD_SIZE", std::to_string(world)},
                 {"LOCAL_WORLD_SIZE", std::to_string(world)},
                 {"GROUP_RANK", "0"},
                 {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", port},
                 {"DDP_TIMEOUT_SECONDS", std::to_string(options.collective_timeout_seconds)},
                 // As ddprun's workers: ddp's SIGUSR1 stack dump and terminate handler.
                 {"DDP_DIAGNOSTIC_HANDLERS", "1"}};
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
    all.push_back(std::move(results));
    if (failed) break;
  }
  return all;
}

/// Runs `body` on `world` ranks (see the top of this file) and returns each
/// rank's result, indexed by rank.
inline std::vector<ProcessResult> run_on_ranks(int world, const RankBody& body, RanksOptions options = {}) {
  return run_phases_on_ranks({RanksPhase{world, body}}, std::move(options)).front();
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

/// What a phase's body gets.
using Group = std::shared_ptr<ProcessGroup>;

/// Every one of `count` phases ran, and every rank of each succeeded.
inline void expect_phases_succeeded(const std::vector<std::vector<ProcessResult>>& phases, size_t count) {
  ASSERT_EQ(phases.size(), count) << "a phase failed: " << describe_ranks(phases.back());
  for (const auto& ranks : phases) expect_all_succeeded(ranks);
}

}  // namespace ddp::testing
