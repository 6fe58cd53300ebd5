// Hooks that let ddprun's tests hold the launcher back where a blocking call could. Only the
// launcher the tests build (tests/workers/ddprun_test_seams.cpp, linked into ddprun_test_build)
// sets them; the shipped ddprun has no flag, variable or file that reaches them, so its command
// line and its environment stay those of the help text. All zero by default.
#pragma once

#include <chrono>

namespace ddprun::detail {

struct TestSeams {
  // Job::watch_until_done() sleeps this long once, before its loop, on a node with a c10d
  // rendezvous: a test sees the heartbeat stop speaking for a node whose loop is stuck.
  std::chrono::duration<double> stall_supervisor{0};
};

// This process's seams.
TestSeams& test_seams();

}  // namespace ddprun::detail
