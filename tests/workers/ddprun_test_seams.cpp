// The rest of ddprun_test_build, the launcher ddprun's tests run where they need its test seams
// (tools/ddprun/launcher_test_seams.h): ddprun's own main.cpp and library, plus this file,
// which sets the seams from the environment before main() runs. The shipped ddprun is built
// without it, so neither its command line nor its environment can reach them.
//   DDPRUN_TEST_STALL_SUPERVISOR_SECONDS=S  hold the supervision loop S seconds, once
#include "launcher_test_seams.h"

#include <cstdio>
#include <cstdlib>

namespace {

double seconds_from(const char* name, const char* text) {
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || seconds < 0) {
    std::fprintf(stderr, "ddprun_test_build: %s='%s' is not a number of seconds >= 0\n", name, text);
    std::exit(2);
  }
  return seconds;
}

// Static initialisation: done before main(), so before the launcher reads anything.
[[maybe_unused]] const bool seams_set = [] {
  constexpr const char* kStall = "DDPRUN_TEST_STALL_SUPERVISOR_SECONDS";
  if (const char* stall = std::getenv(kStall)) {
    ddprun::detail::test_seams().stall_supervisor = std::chrono::duration<double>(seconds_from(kStall, stall));
  }
  return true;
}();

}  // namespace
