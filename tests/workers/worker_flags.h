#pragma once

// Command-line flags of the test workers: "--name value" pairs and bare
// switches, anywhere after the scenario name.

#include <string>

namespace worker {

/// The value after `name`, or `fallback` when it is absent.
inline std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback = "") {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return argv[i + 1];
  }
  return fallback;
}

/// Whether the switch `name` is present.
inline bool has_flag(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i] == name) return true;
  }
  return false;
}

}  // namespace worker
