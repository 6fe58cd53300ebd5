// Agents of one ddprun c10d job, each a ddprun in the background on this host: the tests of
// the rendezvous (test_ddprun_rendezvous.cpp) and of its store's defences
// (test_rdzv_security.cpp) start them, wait for what they print, and describe them all when an
// assertion fails.
#pragma once

#include <support/subprocess.h>

#include <chrono>
#include <deque>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace ddp::testing {

// The whole file, or "" if it cannot be read.
inline std::string read_text_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

// One agent (ddprun) of a c10d job, running in the background.
struct RdzvAgent {
  BackgroundProcess process;
  ProcessResult result;
  bool finished = false;
  std::string err_so_far() const { return read_text_file(process.err_path); }
  ProcessResult& finish(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    if (!finished) result = wait_background(process, timeout);
    finished = true;
    return result;
  }
};

// Whether the agent's stderr came to contain `text` within `timeout`.
inline bool wait_for_err(const RdzvAgent& agent, const std::string& text,
                         std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (agent.err_so_far().find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// Every agent's outcome (or its stderr so far), for assertion messages.
inline std::string describe_agents(const std::deque<RdzvAgent>& agents) {
  std::string text;
  for (size_t i = 0; i < agents.size(); ++i) {
    text += "--- agent " + std::to_string(i) + ": " +
            (agents[i].finished ? agents[i].result.describe() : agents[i].err_so_far()) + "\n";
  }
  return text;
}

// Ends the agents a test left running (they are killed after 1 ms).
inline void finish_agents(std::deque<RdzvAgent>& agents) {
  for (RdzvAgent& agent : agents) {
    if (!agent.finished) agent.finish(std::chrono::milliseconds(1));
  }
}

}  // namespace ddp::testing
