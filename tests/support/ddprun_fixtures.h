// What the tests of ddprun (tests/test_ddprun_*.cpp) share: running ddprun against the
// launcher_probe worker, reading its --print-env lines, and waiting for pid files.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/rdzv_agents.h"
#include "support/subprocess.h"

namespace ddprun_tests {

using namespace std::chrono_literals;
using ddp::testing::BackgroundProcess;
using ddp::testing::bin_path;
using ddp::testing::ProcessResult;
using ddp::testing::RunOptions;

// Every run here should take a second or two; this only bounds a broken launcher.
inline constexpr std::chrono::milliseconds kRunTimeout = 20s;

using EnvAssignments = std::vector<std::pair<std::string, std::string>>;

inline RunOptions run_options(EnvAssignments env = {}, std::vector<std::string> unset_env = {}) {
  RunOptions options;
  options.env = std::move(env);
  options.unset_env = std::move(unset_env);
  options.timeout = kRunTimeout;
  return options;
}

inline std::string probe() { return bin_path("launcher_probe"); }

inline std::vector<std::string> ddprun_argv(const std::vector<std::string>& args) {
  std::vector<std::string> argv{bin_path("ddprun")};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

inline ProcessResult ddprun(const std::vector<std::string>& args,
                     const RunOptions& options = run_options()) {
  return ddp::testing::run_process(ddprun_argv(args), options);
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

// Lines "[rankR]: KEY=VALUE KEY=VALUE ..." printed by --print-env, by rank.
inline std::map<int, std::map<std::string, std::string>> env_by_rank(const std::string& out) {
  static const std::regex kEnvLine(R"(^\[rank(\d+)\]: (RANK=.*)$)");
  std::map<int, std::map<std::string, std::string>> result;
  for (const std::string& line : lines_of(out)) {
    std::smatch match;
    if (!std::regex_match(line, match, kEnvLine)) continue;
    auto& variables = result[std::stoi(match[1])];
    std::istringstream words(match[2].str());
    for (std::string word; words >> word;) {
      size_t equals = word.find('=');
      variables[word.substr(0, equals)] = word.substr(equals + 1);
    }
  }
  return result;
}

// Every --print-env line in order of appearance (ranks repeat when workers are restarted).
inline std::vector<std::map<std::string, std::string>> env_lines(const std::string& out) {
  static const std::regex kEnvLine(R"(^(?:\[rank\d+\]: )?(RANK=.*)$)");
  std::vector<std::map<std::string, std::string>> result;
  for (const std::string& line : lines_of(out)) {
    std::smatch match;
    if (!std::regex_match(line, match, kEnvLine)) continue;
    auto& variables = result.emplace_back();
    std::istringstream words(match[1].str());
    for (std::string word; words >> word;) {
      size_t equals = word.find('=');
      variables[word.substr(0, equals)] = word.substr(equals + 1);
    }
  }
  return result;
}

// How many workers printed their environment on each attempt: attempt -> count.
inline std::map<int, int> workers_per_attempt(const std::string& out) {
  std::map<int, int> counts;
  for (auto& vars : env_lines(out)) ++counts[std::stoi(vars["TORCHELASTIC_RESTART_COUNT"])];
  return counts;
}

using ddp::testing::read_text_file;

inline std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

inline size_t count_of(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

class TempDir {
 public:
  TempDir() : path_(ddp::testing::make_temp_dir("ddprun_test")) {}
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Waits for a pid file written by the probe; returns its pid, or -1 after the timeout.
inline int wait_for_pid_file(const std::string& path, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::ifstream file(path);
    int pid = -1;
    if (file >> pid) return pid;
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(10ms);
  }
}

inline bool wait_until_dead(int pid, std::chrono::milliseconds timeout = 3s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (ddp::testing::process_alive(pid)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

}  // namespace ddprun_tests
