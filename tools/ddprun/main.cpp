// ddprun: torchrun for any program. See usage_text() or `ddprun --help`.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "command_line.h"
#include "console.h"
#include "launcher.h"
#include "posix_util.h"

namespace {

constexpr int kExitJobFailed = 1;  // also what the launcher returns when a worker fails
constexpr int kExitUsage = 2;
constexpr double kGiveUpOnStalledConsoleSeconds = 2.0;

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  ddprun::CommandLine command_line;
  try {
    command_line = ddprun::parse_command_line(args);
  } catch (const std::invalid_argument& error) {
    ddprun::say(std::string(error.what()) + " (see ddprun --help)");
    ddprun::console_finish(kGiveUpOnStalledConsoleSeconds);
    return kExitUsage;
  }
  if (command_line.show_help) {
    std::cout << ddprun::usage_text();
    return 0;
  }

  int exit_code = kExitJobFailed;
  try {
    exit_code = ddprun::Launcher(command_line.options).run();
  } catch (const std::invalid_argument& error) {
    ddprun::say(std::string(error.what()) + " (see ddprun --help)");
    exit_code = kExitUsage;
  } catch (const std::exception& error) {
    ddprun::say("error: " + std::string(error.what()));
  }
  // A reader that takes nothing for this long is not coming back; ddprun does not wait for it.
  ddprun::console_finish(kGiveUpOnStalledConsoleSeconds);
  return exit_code;
}
