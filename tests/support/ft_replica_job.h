// What the tests that start fault-tolerant replicas themselves share (test_fault_tolerance.cpp,
// test_ft_healing.cpp, test_ft_diloco.cpp; no ddprun in between): a c10d TCPStore the test
// process serves, as ddprun --fault-tolerance's keeper would; replicas forked with the
// environment ddprun would give them and their output in files; waiting for them and reaping
// them; and the step lines that tests/workers/ft_worker.cpp and ft_heal_worker.cpp print.
// The tests that run the workers under ddprun share support/ft_jobs.h instead.
#pragma once

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace ddp::testing {

// A c10d TCPStore served by the test process on a free port, as ddprun --fault-tolerance's
// keeper would serve it. A fresh one is a new job: a replica of an old job would wait there
// as a joiner.
inline c10::intrusive_ptr<c10d::TCPStore> serve_ft_store() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(30);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

// The whole file, or "" if it cannot be read (a replica's output before it wrote any).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// "3,1,4" -> {3, 1, 4}; "" -> {}.
inline std::vector<int64_t> split_numbers(const std::string& text) {
  std::vector<int64_t> v;
  std::stringstream in(text);
  for (std::string x; std::getline(in, x, ',');) v.push_back(std::stoll(x));
  return v;
}

// Now on the wall clock of the step lines' "t" field, in microseconds.
inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Waits until `pred` holds, looking every 10 ms, up to `seconds`; then the last look's answer.
template <typename Pred>
bool wait_until(Pred pred, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// One committed step as ft_worker and ft_heal_worker print it (ft_worker_common.h's
// print_step_line):
//   step <s> gen <g> rank <r>/<n> hash <weights' hash> t <us> window <i,...> mine <i,...>
struct StepLine {
  int64_t step = 0, gen = 0, t_us = 0;
  int rank = 0, size = 0;
  std::string hash;
  std::vector<int64_t> window, mine;
};

inline std::vector<StepLine> step_lines(const std::string& text) {
  static const std::regex re(
      R"(step (\d+) gen (\d+) rank (\d+)/(\d+) hash ([0-9a-f]+) t (\d+) window ([0-9,]*) mine ([0-9,]*))");
  std::vector<StepLine> lines;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, re)) continue;
    StepLine s;
    s.step = std::stoll(m[1]);
    s.gen = std::stoll(m[2]);
    s.rank = std::stoi(m[3]);
    s.size = std::stoi(m[4]);
    s.hash = m[5];
    s.t_us = std::stoll(m[6]);
    s.window = split_numbers(m[7]);
    s.mine = split_numbers(m[8]);
    lines.push_back(s);
  }
  return lines;
}

// A replica the test started: its pid (also its process group's id), its replica id, its
// output files, and how it ended once reaped.
struct ReplicaProcess {
  pid_t pid = -1;
  std::string id, out, err;
  int status = -1;
  bool exited = false;

  // Its "final <hash>" line, printed at its end; "" before.
  std::string final_hash() const {
    static const std::regex re(R"(final ([0-9a-f]+))");
    std::smatch m;
    const std::string text = read_file(out);
    return std::regex_search(text, m, re) ? m[1].str() : "";
  }
};

// A replica that prints step lines (ft_worker, ft_heal_worker).
struct StepReplica : ReplicaProcess {
  std::vector<StepLine> steps() const { return step_lines(read_file(out)); }
  // The last committed step it printed; -1 before its first.
  int64_t committed() const {
    const auto s = steps();
    return s.empty() ? -1 : s.back().step;
  }
  // Its "skipped step <s> gen <g>" lines.
  std::vector<std::string> skipped() const {
    std::vector<std::string> lines;
    std::stringstream in(read_file(out));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("skipped", 0) == 0) lines.push_back(line);
    }
    return lines;
  }
};

// The time (its "t", microseconds) of the first step line of `replica` that `match` accepts,
// waiting up to `seconds` for one; -1 if none came.
template <typename Match>
int64_t first_step_time(const StepReplica& replica, Match match, double seconds) {
  int64_t found = -1;
  wait_until(
      [&] {
        for (const auto& s : replica.steps()) {
          if (match(s)) {
            found = s.t_us;
            return true;
          }
        }
        return false;
      },
      seconds);
  return found;
}

// `env` plus what ddprun --fault-tolerance gives replica `id` of the job whose store listens on
// `store_port`. `env` may set its own DDP_FT_INITIAL_REPLICAS (else 3) and DDP_FT_DEADLINE_MS
// (else `deadline_ms`).
inline std::map<std::string, std::string> with_ft_replica_env(std::map<std::string, std::string> env,
                                                              int store_port, const std::string& id,
                                                              int deadline_ms) {
  env["DDP_FAULT_TOLERANCE"] = "1";
  env["DDP_FT_STORE"] = "tcp://127.0.0.1:" + std::to_string(store_port);
  env["DDP_FT_REPLICA_ID"] = id;
  env.emplace("DDP_FT_INITIAL_REPLICAS", "3");
  env.emplace("DDP_FT_DEADLINE_MS", std::to_string(deadline_ms));
  return env;
}

// A test that starts replicas of `worker` (a program built next to the test binary; skipped
// where it is not) over a TCPStore it serves. Each replica runs in a process group of its own,
// which TearDown kills. Their output files live in a directory of the test's own, removed
// when the test passes unless FT_KEEP_LOGS=1.
template <typename Replica>
class FtReplicaJob : public ::testing::Test {
 protected:
  explicit FtReplicaJob(std::string worker) : worker_(std::move(worker)) {}

  void SetUp() override {
    if (!std::filesystem::exists(worker_path())) GTEST_SKIP() << worker_ << " was not built next to the test";
    new_store();
    dir_ = std::filesystem::temp_directory_path() /
           ("ddp_" + worker_ + "_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }

  void TearDown() override {
    for (auto& w : workers_) {
      if (!w.exited && w.pid > 0) {
        kill(-w.pid, SIGKILL);
        waitpid(w.pid, nullptr, 0);
      }
    }
    if (!HasFailure() && !std::getenv("FT_KEEP_LOGS")) std::filesystem::remove_all(dir_);
  }

  // A fresh store: the replicas started from now on are a new job.
  void new_store() { store_ = serve_ft_store(); }

  std::string worker_path() const {
    return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / worker_).string();
  }

  // Starts replica `id`: `argv` (the worker if empty) with `env` over this process's
  // environment, on localhost with one thread. Returns its index in workers_.
  size_t launch(const std::string& id, std::map<std::string, std::string> env, std::vector<std::string> argv = {}) {
    Replica w;
    w.id = id;
    std::string safe = id;
    std::replace(safe.begin(), safe.end(), '/', '_');
    w.out = (dir_ / (safe + "_" + std::to_string(workers_.size()) + ".out")).string();
    w.err = (dir_ / (safe + "_" + std::to_string(workers_.size()) + ".err")).string();
    env["MASTER_ADDR"] = "127.0.0.1";
    env["OMP_NUM_THREADS"] = "1";
    if (argv.empty()) argv = {worker_path()};
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    // Everything the child needs is made before fork(): this process runs the store's server
    // thread, so the child may only make async-signal-safe calls (a setenv or malloc there can
    // deadlock on a lock that thread held).
    std::vector<std::string> environment;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (!env.count(entry.substr(0, entry.find('=')))) environment.push_back(entry);
    }
    for (const auto& [k, v] : env) environment.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& e : environment) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int out = open(w.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int err = open(w.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const pid_t pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
      dup2(out, 1);
      dup2(err, 2);
      execve(args[0], args.data(), envp.data());
      _exit(127);
    }
    close(out);
    close(err);
    setpgid(pid, pid);
    w.pid = pid;
    workers_.push_back(w);
    return workers_.size() - 1;
  }

  // Whether `w` has exited (reaped now if it just did).
  bool reap(Replica& w) {
    if (w.exited) return true;
    int status = 0;
    if (waitpid(w.pid, &status, WNOHANG) == w.pid) {
      w.exited = true;
      w.status = status;
    }
    return w.exited;
  }

  // Whether replicas `which` all exit within `seconds` (each reaped as it does).
  bool exit_within(const std::vector<size_t>& which, double seconds) {
    return wait_until(
        [&] {
          bool done = true;
          for (size_t i : which) done = reap(workers_[i]) && done;
          return done;
        },
        seconds);
  }

  // Waits for replicas `which` to exit; asserts they do within `seconds`.
  void wait_exit(const std::vector<size_t>& which, double seconds) {
    ASSERT_TRUE(exit_within(which, seconds)) << "replicas did not finish in " << seconds << " s\n" << logs();
  }

  void kill_and_reap(size_t i) {
    kill(workers_[i].pid, SIGKILL);
    wait_exit({i}, 10);
  }

  // Every replica's stderr and the tail of its stdout, for an assertion's message.
  std::string logs() const {
    std::string text;
    for (const auto& w : workers_) {
      text += "---- " + w.id + " stderr:\n" + read_file(w.err) + "---- " + w.id + " stdout (tail):\n";
      const std::string out = read_file(w.out);
      text += out.size() > 3000 ? out.substr(out.size() - 3000) : out;
    }
    return text;
  }

  // Every replica in `which` printed the same hash at every step they share (a hash of
  // zeros: not hashed at that step).
  void expect_same_weights(const std::vector<size_t>& which) {
    std::map<int64_t, std::pair<std::string, std::string>> first;
    for (size_t i : which) {
      for (const auto& s : workers_[i].steps()) {
        if (s.hash == std::string(16, '0')) continue;
        auto [it, fresh] = first.emplace(s.step, std::make_pair(s.hash, workers_[i].id));
        EXPECT_EQ(it->second.first, s.hash)
            << "step " << s.step << ": " << workers_[i].id << " differs from " << it->second.second;
      }
    }
  }

  std::string worker_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::filesystem::path dir_;
  std::vector<Replica> workers_;
};

}  // namespace ddp::testing
