// ddp's process-wide handlers (the SIGUSR1 stack dump and the std::terminate
// handler, src/comm/stack_dump.cpp) are installed only when asked for: through
// ProcessGroupOptions or DDP_DIAGNOSTIC_HANDLERS, which ddprun exports to its
// workers. A program that asks for neither keeps its own. Each case runs in
// a fresh process (this binary again), since a handler once installed stays.
#include <ddp/error.h>
#include <ddp/process_group.h>
#include <ddp/stack_dump.h>

#include <gtest/gtest.h>
#include <support/ranks.h>
#include <support/subprocess.h>

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <sstream>
#include <string>
#include <thread>

namespace {

// Marks the child process and says how it asks for the handlers.
constexpr const char* kChildVariable = "DDP_TEST_DIAGNOSTIC_HANDLERS_CHILD";

// The child: a one-process group created as `how` says, then a report of what
// changed. With a SIGUSR1 handler it signals itself; with the terminate
// handler an exception escapes a thread, which ends the process.
[[noreturn]] void run_child(const std::string& how) {
  // A plain program, whatever the environment running the tests holds.
  ::unsetenv("DDP_DIAGNOSTIC_HANDLERS");
  ::unsetenv("DDP_STACK_DUMP_SIGNAL");
  if (how == "environment" || how == "environment, options off") ::setenv("DDP_DIAGNOSTIC_HANDLERS", "1", 1);

  struct sigaction usr1_before {};
  ::sigaction(SIGUSR1, nullptr, &usr1_before);
  const std::terminate_handler terminate_before = std::get_terminate();

  auto options = ddp::ProcessGroupOptions().backend(ddp::BackendKind::kGloo);
  if (how == "options") options.install_stack_dump_handler(true).install_terminate_handler(true);
  if (how == "environment, options off") options.install_stack_dump_handler(false).install_terminate_handler(false);
  auto group = ddp::ProcessGroup::create(ddp::World{}, options);

  struct sigaction usr1_after {};
  ::sigaction(SIGUSR1, nullptr, &usr1_after);
  const bool usr1_installed = usr1_after.sa_handler != usr1_before.sa_handler;
  const bool terminate_installed = std::get_terminate() != terminate_before;
  std::printf("SIGUSR1 %s, std::terminate %s\n", usr1_installed ? "installed" : "unchanged",
              terminate_installed ? "installed" : "unchanged");
  std::fflush(stdout);
  if (usr1_installed) {
    ::kill(::getpid(), SIGUSR1);
    // The dump runs on ddp's own thread; give it time to print.
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  if (terminate_installed) std::thread([] { throw std::runtime_error("escaped from a thread"); }).join();
  // A dump still works without the SIGUSR1 handler (as at half a collective's
  // timeout): the other threads answer the capture signal instead of dying of it.
  ddp::dump_stacks("called by the test");
  group->shutdown();
  std::fflush(nullptr);
  std::_Exit(0);
}

ddp::testing::ProcessResult run_as(const std::string& how) {
  ddp::testing::RunOptions run;
  run.env = {{kChildVariable, how}};
  run.timeout = std::chrono::seconds(60);
  return ddp::testing::run_process({ddp::testing::detail::self_executable(),
                                    "--gtest_filter=" + ddp::testing::detail::current_test_name()},
                                   run);
}

void expect_untouched(const ddp::testing::ProcessResult& result) {
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.out.find("SIGUSR1 unchanged, std::terminate unchanged"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("(signal received)"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("(called by the test); the program carries on"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("(pt_gloo_runloop)"), std::string::npos) << "no other thread's stack\n"
                                                                    << result.describe();
}

// Both installed, and both ddp's: SIGUSR1 dumps the stacks and the group's
// collectives and the program goes on; the escaped exception is ddp's error
// line and exit status 1, not abort().
void expect_installed(const ddp::testing::ProcessResult& result) {
  EXPECT_NE(result.out.find("SIGUSR1 installed, std::terminate installed"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("ddp: stack dump of pid"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("rank 0's last collectives"), std::string::npos) << result.describe();
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_NE(result.err.find("error: ddp: rank 0: the process ended on an exception that nothing caught: "
                            "std::runtime_error: escaped from a thread."),
            std::string::npos)
      << result.describe();
}

TEST(DiagnosticHandlers, AGroupNobodyAskedForThemLeavesSigusr1AndTerminateAlone) {
  if (const char* how = std::getenv(kChildVariable)) run_child(how);
  expect_untouched(run_as("neither"));
}

TEST(DiagnosticHandlers, TheOptionsInstallThem) {
  if (const char* how = std::getenv(kChildVariable)) run_child(how);
  expect_installed(run_as("options"));
}

// What ddprun exports to its workers.
TEST(DiagnosticHandlers, TheLaunchersVariableInstallsThemUnlessTheOptionsSayNo) {
  if (const char* how = std::getenv(kChildVariable)) run_child(how);
  expect_installed(run_as("environment"));
  expect_untouched(run_as("environment, options off"));
}

// The pid of a child of `parent` that is stopped, or 0.
int stopped_child_of(int parent) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::ifstream in(entry.path() / "stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;
    // "pid (comm) state ppid ...": comm may hold spaces, so read after its ')'.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    char state = 0;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && state == 'T') return std::atoi(entry.path().filename().c_str());
  }
  return 0;
}

// ddprun asks for the handlers for its workers: SIGUSR1 to ddprun makes a
// ddp program that never asked for them dump its stacks, as before they
// were opt-in. Rank 1 stops itself after the barrier (ddp_worker stall), so
// rank 0 is blocked in its all-reduce when the signal comes.
TEST(DiagnosticHandlers, UnderDdprunSigusr1MakesAWorkerDumpItsStacks) {
  ddp::testing::RunOptions options;
  options.env = {{"DDP_TIMEOUT_SECONDS", "10"}};
  options.unset_env = {"DDP_DIAGNOSTIC_HANDLERS", "DDP_STACK_DUMP_SIGNAL"};
  auto job = ddp::testing::start_background({ddp::testing::bin_path("ddprun"), "--standalone", "--nproc-per-node", "2",
                                             ddp::testing::bin_path("ddp_worker"), "stall"},
                                            options);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (stopped_child_of(job.pid) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(stopped_child_of(job.pid), 0) << "rank 1 never stopped";
  ::kill(job.pid, SIGUSR1);
  const auto result = ddp::testing::wait_background(job, std::chrono::seconds(90));
  const std::string both = result.out + result.err;
  EXPECT_NE(both.find("received SIGUSR1, forwarded it to 2 worker(s)"), std::string::npos) << result.describe();
  EXPECT_NE(both.find("[rank0]: ddp: stack dump of pid"), std::string::npos) << result.describe();
  EXPECT_NE(both.find("(signal received); the program carries on"), std::string::npos) << result.describe();
  // Rank 0 lived on until its collective timed out, not killed by the signal.
  EXPECT_EQ(both.find("(SIGUSR1)"), std::string::npos) << result.describe();
  EXPECT_NE(result.exit_code, 0) << result.describe();
}

TEST(DiagnosticHandlers, AVariableThatIsNeitherOnNorOffIsRefusedNamingIt) {
  const char* inherited = std::getenv("DDP_DIAGNOSTIC_HANDLERS");
  const std::string restore = inherited ? inherited : "";
  ::setenv("DDP_DIAGNOSTIC_HANDLERS", "sometimes", 1);
  try {
    ddp::ProcessGroupOptions options;
    ADD_FAILURE() << "DDP_DIAGNOSTIC_HANDLERS=sometimes was accepted";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("DDP_DIAGNOSTIC_HANDLERS='sometimes' must be 1"), std::string::npos)
        << e.what();
  }
  ::setenv("DDP_DIAGNOSTIC_HANDLERS", "0", 1);
  EXPECT_FALSE(ddp::ProcessGroupOptions().install_stack_dump_handler());
  ::setenv("DDP_DIAGNOSTIC_HANDLERS", "1", 1);
  EXPECT_TRUE(ddp::ProcessGroupOptions().install_terminate_handler());
  ::unsetenv("DDP_DIAGNOSTIC_HANDLERS");
  EXPECT_FALSE(ddp::ProcessGroupOptions().install_terminate_handler());
  if (inherited) ::setenv("DDP_DIAGNOSTIC_HANDLERS", restore.c_str(), 1);
}

}  // namespace
