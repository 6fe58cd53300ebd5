// Hostile checkpoint files for the loader's tests, and a way to load one
// without letting a failed bound take the machine's memory with it.
#pragma once

#include <support/subprocess.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace ddp::testing {

/// One record of a hand-made torch.save zip, stored under "archive/".
struct ZipRecord {
  std::string name;               ///< e.g. "data.pkl", "version", "data/0"
  std::string bytes;              ///< its contents, unless `zeros` is set
  uint64_t zeros = 0;             ///< if > 0, this many zero bytes instead
  bool deflated = false;          ///< compressed (torch.save never does this)
};

/// Writes `records` as a zip at `path` with the venv's Python (zipfile).
inline void write_zip(const std::string& path, const std::vector<ZipRecord>& records) {
  std::vector<std::string> argv = {
      DDP_PYTHON, "-c",
      "import sys, zipfile\n"
      "with zipfile.ZipFile(sys.argv[1], 'w', allowZip64=True) as z:\n"
      "    args = sys.argv[2:]\n"
      "    for name, source, zeros, deflated in zip(args[0::4], args[1::4], args[2::4], args[3::4]):\n"
      "        method = zipfile.ZIP_DEFLATED if deflated == '1' else zipfile.ZIP_STORED\n"
      "        info = zipfile.ZipInfo('archive/' + name)\n"
      "        info.compress_type = method\n"
      "        with z.open(info, 'w') as f:\n"
      "            if int(zeros):\n"
      "                chunk = bytes(1 << 20)\n"
      "                for _ in range(int(zeros) >> 20): f.write(chunk)\n"
      "                f.write(bytes(int(zeros) & ((1 << 20) - 1)))\n"
      "            else:\n"
      "                f.write(open(source, 'rb').read())\n",
      path};
  std::vector<std::string> sources;
  for (size_t k = 0; k < records.size(); ++k) {
    sources.push_back(path + ".record" + std::to_string(k));
    std::ofstream(sources.back(), std::ios::binary) << records[k].bytes;
    argv.insert(argv.end(), {records[k].name, sources.back(), std::to_string(records[k].zeros),
                             records[k].deflated ? "1" : "0"});
  }
  auto made = run_process(argv);
  for (const auto& source : sources) std::remove(source.c_str());
  ASSERT_EQ(made.exit_code, 0) << made.describe();
}

/// What a load in a child process came to.
struct BoundedLoad {
  std::string error;           ///< the exception's message; "" if it returned
  long peak_growth_kib = -1;   ///< how far its resident memory grew
  bool finished = false;       ///< it reported back in time
};

/// Runs `load` in a forked child whose address space may grow by at most
/// `headroom` bytes, so a load that is not bounded fails with an allocation
/// error (a different message) instead of exhausting the machine. The child
/// reports the exception's message and how far its peak resident memory grew
/// (VmHWM, reset at the start through /proc/self/clear_refs).
inline BoundedLoad load_with_memory_limit(const std::function<void()>& load, size_t headroom,
                                          std::chrono::seconds timeout = std::chrono::seconds(60)) {
  auto kib_of = [](const char* field) {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind(field, 0) == 0) return std::stol(line.substr(std::string(field).size()));
    }
    return -1L;
  };
  int fds[2];
  if (::pipe(fds) != 0) return {};
  pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    ::alarm(static_cast<unsigned>(timeout.count()));
    std::ofstream("/proc/self/clear_refs") << "5";
    const long before = kib_of("VmHWM:");
    struct rlimit limit {};
    ::getrlimit(RLIMIT_AS, &limit);
    limit.rlim_cur = static_cast<rlim_t>(kib_of("VmSize:")) * 1024 + headroom;
    ::setrlimit(RLIMIT_AS, &limit);
    std::string error;
    try {
      load();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = std::string("std::exception: ") + e.what();
    }
    std::string report = std::to_string(kib_of("VmHWM:") - before) + "\n" + error;
    ssize_t ignored = ::write(fds[1], report.data(), report.size());
    (void)ignored;
    ::_exit(0);
  }
  ::close(fds[1]);
  BoundedLoad result;
  std::string report;
  auto deadline = std::chrono::steady_clock::now() + timeout + std::chrono::seconds(5);
  char buffer[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    ssize_t n = ::read(fds[0], buffer, sizeof buffer);
    if (n <= 0) {
      result.finished = !report.empty();
      break;
    }
    report.append(buffer, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  if (!result.finished) ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (result.finished) {
    size_t newline = report.find('\n');
    result.peak_growth_kib = std::stol(report.substr(0, newline));
    result.error = report.substr(newline + 1);
  }
  return result;
}

}  // namespace ddp::testing
