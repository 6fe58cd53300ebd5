// Launching ddp programs from tests: through ddprun, or alone with a world
// described by hand-set variables.
#pragma once

#include <support/subprocess.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <regex>

#include <string>
#include <vector>

namespace ddp::testing {

/// ddprun --standalone --nproc-per-node N <bin/program> args...
inline std::vector<std::string> under_ddprun(int nproc, const std::string& program,
                                             const std::vector<std::string>& args = {}) {
  std::vector<std::string> argv = {bin_path("ddprun"), "--standalone", "--nproc-per-node",
                                   std::to_string(nproc), bin_path(program)};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

/// Options for running one rank by hand: the launcher variables of other
/// launchers are removed so only `env` describes the world.
inline RunOptions one_rank(std::vector<std::pair<std::string, std::string>> env,
                           std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  RunOptions options;
  options.env = std::move(env);
  options.unset_env = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                       "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"};
  for (const auto& [name, value] : options.env) {
    options.unset_env.erase(std::remove(options.unset_env.begin(), options.unset_env.end(), name),
                            options.unset_env.end());
  }
  options.timeout = timeout;
  return options;
}

/// Number of times `needle` occurs in `haystack`.
inline int count_of(const std::string& haystack, const std::string& needle) {
  int count = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos; pos = haystack.find(needle, pos + 1)) ++count;
  return count;
}

/// The "Epoch E, Loss: X" lines a training program printed, in order.
inline std::vector<std::string> loss_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::regex pattern("Epoch [0-9]+, Loss: [0-9.]+");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), pattern); it != std::sregex_iterator(); ++it) {
    lines.push_back(it->str());
  }
  return lines;
}

/// Whether two torch.save'd state dicts hold exactly equal tensors (the
/// files' bytes differ anyway: each carries a random serialization id).
inline std::string compare_state_dicts(const std::string& a, const std::string& b) {
  auto r = run_process({DDP_PYTHON, "-c",
                        "import sys, torch\n"
                        "a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\n"
                        "assert a.keys() == b.keys(), (list(a), list(b))\n"
                        "bad = [k for k in a if not torch.equal(a[k], b[k])]\n"
                        "print('identical' if not bad else 'differ: ' + ', '.join(bad))\n",
                        a, b});
  if (r.exit_code != 0) return "python failed: " + r.err;
  return r.out.substr(0, r.out.find('\n'));
}

/// The largest |a - b| over every tensor of two torch.save'd state dicts with
/// the same keys, or a negative number when Python could not say (`why`, if
/// given, then holds its error).
inline double max_state_dict_difference(const std::string& a, const std::string& b, std::string* why = nullptr) {
  auto r = run_process({DDP_PYTHON, "-c",
                        "import sys, torch\n"
                        "a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\n"
                        "assert a.keys() == b.keys(), (list(a), list(b))\n"
                        "print(repr(max((a[k] - b[k]).abs().max().item() for k in a)))\n",
                        a, b});
  if (r.exit_code != 0) {
    if (why) *why = r.describe();
    return -1;
  }
  return std::stod(r.out);
}

/// The pid of the worker with global rank `rank` among `launcher_pid`'s
/// children (ddprun's or torchrun's), found through /proc, or -1.
inline int worker_pid(int launcher_pid, int rank) {
  namespace fs = std::filesystem;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(line.substr(close + 2));
    std::string state;
    int ppid = 0;
    fields >> state >> ppid;
    if (ppid != launcher_pid) continue;
    std::ifstream environ(entry.path() / "environ", std::ios::binary);
    std::string env((std::istreambuf_iterator<char>(environ)), std::istreambuf_iterator<char>());
    if (env.find(std::string("\0RANK=", 6) + std::to_string(rank) + std::string("\0", 1)) != std::string::npos) {
      return std::stoi(name);
    }
  }
  return -1;
}

}  // namespace ddp::testing
