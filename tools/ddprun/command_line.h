// Parsing of ddprun's command line (torchrun's flag names): the grammar is command_line.cpp's,
// on CLI11; what each flag's value may be is flag_values.cpp's; the --help text usage_text.cpp's.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "launcher.h"

namespace ddprun {

// A mistake on the command line; main() prints it with a pointer to --help and exits 2.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct CommandLine {
  bool show_help = false;
  LaunchOptions options;
};

// Parses the arguments after argv[0]. Options end at "--" or at the first word that is not an
// option; that word is PROGRAM and everything after it belongs to PROGRAM. Throws UsageError.
CommandLine parse_command_line(const std::vector<std::string>& args);

// The --help text: every flag with its default.
std::string usage_text();

}  // namespace ddprun
