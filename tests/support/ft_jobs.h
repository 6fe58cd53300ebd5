// What the tests that drive ddp's fault-tolerant workers (tests/workers/ft_worker.cpp) under
// ddprun share: finding a worker's pid among ddprun's children by its RANK, and reading the
// workers' "step" and "final" lines.
#pragma once

#include <dirent.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace ddp::testing {

// The pid of the child of `parent` running `program` with RANK=rank in its environment, or -1.
inline int child_with_rank(int parent, const std::string& program, int rank) {
  std::ifstream children_file("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) + "/children");
  for (int child; children_file >> child;) {
    std::ifstream cmdline("/proc/" + std::to_string(child) + "/cmdline");
    std::string argv0;
    std::getline(cmdline, argv0, '\0');
    if (argv0.find(program) == std::string::npos) continue;
    std::ifstream environ("/proc/" + std::to_string(child) + "/environ");
    for (std::string entry; std::getline(environ, entry, '\0');) {
      if (entry == "RANK=" + std::to_string(rank)) return child;
    }
  }
  return -1;
}

// The largest step any "step N gen ..." line of `out` names; -1 if none.
inline long long last_step_in(const std::string& out) {
  static const std::regex kStep(R"(step (\d+) gen )");
  long long last = -1;
  for (std::sregex_iterator it(out.begin(), out.end(), kStep), end; it != end; ++it) {
    last = std::max(last, std::stoll((*it)[1]));
  }
  return last;
}

// The wall clock (microseconds, the "t" field) of the first step line of `rank` ("[rankR]: step
// ...") stamped after `after_us`; -1 if none.
inline long long first_step_after(const std::string& out, int rank, long long after_us) {
  const std::regex kStep("\\[rank" + std::to_string(rank) + R"(\]: step \d+ gen \d+ rank \d+/\d+ hash [0-9a-f]+ t (\d+))");
  long long first = -1;
  for (std::sregex_iterator it(out.begin(), out.end(), kStep), end; it != end; ++it) {
    const long long t = std::stoll((*it)[1]);
    if (t > after_us && (first < 0 || t < first)) first = t;
  }
  return first;
}

// "final <hash>" of each rank prefix ("[rank1]: final 00ab..."): rank -> hashes in order.
inline std::map<int, std::vector<std::string>> finals_by_rank(const std::string& out) {
  static const std::regex kFinal(R"(\[rank(\d+)\]: final ([0-9a-f]{16}))");
  std::map<int, std::vector<std::string>> finals;
  for (std::sregex_iterator it(out.begin(), out.end(), kFinal), end; it != end; ++it) {
    finals[std::stoi((*it)[1])].push_back((*it)[2]);
  }
  return finals;
}

}  // namespace ddp::testing
