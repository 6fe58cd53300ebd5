#include "support/subprocess.h"

#include "posix_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace ddp::testing {
namespace {

using Clock = std::chrono::steady_clock;

// After SIGKILL, how long we still read pipes that an escaped descendant may hold open.
constexpr std::chrono::seconds kGiveUpAfterKill{3};
// While the child runs, poll() wakes this often to look for its exit.
constexpr int kExitCheckIntervalMs = 10;
// describe() keeps assertion messages readable by showing only the end of long output.
constexpr size_t kDescribeTailBytes = 16 * 1024;

using ddprun::throw_errno;

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// argv/envp prepared before fork, so the child only makes system calls.
struct ChildSpec {
  std::vector<std::string> argv_strings;
  std::vector<std::string> env_strings;
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::string cwd;
  std::string exec_failure;

  ChildSpec(const std::vector<std::string>& command, const RunOptions& options)
      : argv_strings(command), cwd(options.cwd) {
    if (command.empty()) throw std::invalid_argument("run_process: argv is empty");
    auto is_named = [](const std::string& entry, const std::string& name) {
      return entry.size() > name.size() && entry.compare(0, name.size(), name) == 0 &&
             entry[name.size()] == '=';
    };
    for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
      std::string text(*entry);
      bool dropped = false;
      for (const std::string& name : options.unset_env) dropped = dropped || is_named(text, name);
      for (const auto& [name, value] : options.env) dropped = dropped || is_named(text, name);
      if (!dropped) env_strings.push_back(text);
    }
    for (const auto& [name, value] : options.env) env_strings.push_back(name + "=" + value);
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    exec_failure = "run_process: cannot execute '" + command[0] + "': ";
  }
  ChildSpec(const ChildSpec&) = delete;  // argv/envp point into this object's strings
  ChildSpec& operator=(const ChildSpec&) = delete;
};

void write_fd(int fd, const char* text) {
  size_t size = std::strlen(text);
  while (size > 0) {
    ssize_t n = ::write(fd, text, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text += n;
    size -= static_cast<size_t>(n);
  }
}

// Forks and execs spec in its own process group with the given stdout/stderr; stdin is /dev/null.
pid_t spawn(const ChildSpec& spec, int out_fd, int err_fd) {
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) throw_errno("open /dev/null");

  // Blocked across fork so the child cannot run a test's handlers before resetting them.
  sigset_t all_signals;
  sigset_t previous_mask;
  sigfillset(&all_signals);
  ::sigprocmask(SIG_BLOCK, &all_signals, &previous_mask);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    for (int signal_number = 1; signal_number < NSIG; ++signal_number) {
      if (signal_number != SIGKILL && signal_number != SIGSTOP) ::signal(signal_number, SIG_DFL);
    }
    ::dup2(null_fd, STDIN_FILENO);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    if (!spec.cwd.empty() && ::chdir(spec.cwd.c_str()) != 0) {
      write_fd(STDERR_FILENO, "run_process: cannot chdir to the requested cwd\n");
      ::_exit(127);
    }
    sigset_t no_signals;
    sigemptyset(&no_signals);
    ::sigprocmask(SIG_SETMASK, &no_signals, nullptr);
    ::execvpe(spec.argv[0], spec.argv.data(), spec.envp.data());
    const char* reason = std::strerror(errno);
    write_fd(STDERR_FILENO, spec.exec_failure.c_str());
    write_fd(STDERR_FILENO, reason);
    write_fd(STDERR_FILENO, "\n");
    ::_exit(127);
  }
  int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &previous_mask, nullptr);
  ::close(null_fd);
  if (pid < 0) {
    errno = fork_errno;
    throw_errno("fork");
  }
  ::setpgid(pid, pid);  // so the group exists even if we signal it before the child runs
  return pid;
}

// Whether pid has exited, leaving it a zombie: until it is reaped its pid, which is also its
// process group id, cannot be reused, so killpg(pid) cannot hit an unrelated process.
bool has_exited(pid_t pid) {
  siginfo_t info;
  std::memset(&info, 0, sizeof info);
  return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
         info.si_pid != 0;
}

// Kills whatever is left in the child's group and reaps the child into result.
void kill_group_and_reap(pid_t pid, ProcessResult& result) {
  ::killpg(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return;
  }
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.term_signal = WTERMSIG(status);
  }
}

int milliseconds_until(Clock::time_point deadline) {
  auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left + 1, 0, 60 * 1000));
}

std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

std::string tail_of(const std::string& text) {
  if (text.size() <= kDescribeTailBytes) return text;
  return "[... " + std::to_string(text.size() - kDescribeTailBytes) + " bytes omitted ...]\n" +
         text.substr(text.size() - kDescribeTailBytes);
}

}  // namespace

std::string ProcessResult::describe() const {
  std::ostringstream text;
  if (timed_out) text << "TIMED OUT and killed; ";
  if (term_signal != 0) {
    text << "killed by signal " << term_signal << " (" << ::strsignal(term_signal) << ")";
  } else {
    text << "exit code " << exit_code;
  }
  text << " after " << std::fixed << std::setprecision(2) << seconds << " s\n"
       << "--- stdout (" << out.size() << " bytes) ---\n"
       << tail_of(out) << "\n--- stderr (" << err.size() << " bytes) ---\n"
       << tail_of(err) << "\n--- end ---";
  return text.str();
}

ProcessResult run_process(const std::vector<std::string>& argv, const RunOptions& options) {
  ChildSpec spec(argv, options);
  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw_errno("pipe2");
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    throw_errno("pipe2");
  }

  ProcessResult result;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + options.timeout;
  pid_t pid = -1;
  try {
    pid = spawn(spec, out_pipe[1], err_pipe[1]);
  } catch (...) {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
    throw;
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);

  int fds[2] = {out_pipe[0], err_pipe[0]};
  std::string* sinks[2] = {&result.out, &result.err};
  for (int fd : fds) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);

  bool exited = false;
  bool killed = false;
  Clock::time_point give_up = Clock::time_point::max();
  while (true) {
    if (!exited) exited = has_exited(pid);
    const bool pipes_open = fds[0] >= 0 || fds[1] >= 0;
    if (exited && !pipes_open) break;

    const Clock::time_point now = Clock::now();
    if (!killed && now >= deadline) {
      ::killpg(pid, SIGKILL);
      killed = true;
      result.timed_out = true;
      give_up = now + kGiveUpAfterKill;
    }
    // Past this point only a descendant that left the group can still hold the pipes.
    if (killed && exited && now >= give_up) break;

    pollfd poll_fds[2];
    nfds_t count = 0;
    int owners[2];
    for (int i = 0; i < 2; ++i) {
      if (fds[i] < 0) continue;
      poll_fds[count] = {fds[i], POLLIN, 0};
      owners[count++] = i;
    }
    int timeout_ms = milliseconds_until(killed ? give_up : deadline);
    if (!exited) timeout_ms = std::min(timeout_ms, kExitCheckIntervalMs);
    if (::poll(poll_fds, count, timeout_ms) < 0 && errno != EINTR) throw_errno("poll");

    for (nfds_t i = 0; i < count; ++i) {
      if (poll_fds[i].revents == 0) continue;
      const int owner = owners[i];
      char buffer[65536];
      ssize_t n = ::read(fds[owner], buffer, sizeof buffer);
      if (n > 0) {
        sinks[owner]->append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        close_fd(fds[owner]);
      }
    }
  }
  close_fd(fds[0]);
  close_fd(fds[1]);
  kill_group_and_reap(pid, result);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

std::string bin_path(const std::string& name) { return std::string(DDP_BIN_DIR) + "/" + name; }

std::string make_temp_dir(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/" + prefix + ".XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw_errno("mkdtemp " + pattern);
  return pattern;
}

int free_port() { return ddprun::free_loopback_port("free_port"); }

BackgroundProcess start_background(const std::vector<std::string>& argv,
                                   const RunOptions& options) {
  ChildSpec spec(argv, options);
  BackgroundProcess process;
  const std::string dir = make_temp_dir("ddp_background");
  process.out_path = dir + "/stdout";
  process.err_path = dir + "/stderr";
  int out_fd = ::open(process.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err_fd = ::open(process.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0 || err_fd < 0) {
    int saved = errno;
    close_fd(out_fd);
    close_fd(err_fd);
    errno = saved;
    throw_errno("start_background: cannot create output files in " + dir);
  }
  try {
    process.pid = spawn(spec, out_fd, err_fd);
  } catch (...) {
    close_fd(out_fd);
    close_fd(err_fd);
    throw;
  }
  close_fd(out_fd);
  close_fd(err_fd);
  return process;
}

ProcessResult wait_background(const BackgroundProcess& process, std::chrono::milliseconds timeout) {
  ProcessResult result;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + timeout;
  while (!has_exited(process.pid)) {
    if (Clock::now() >= deadline) {
      result.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kExitCheckIntervalMs));
  }
  kill_group_and_reap(process.pid, result);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.out = read_file(process.out_path);
  result.err = read_file(process.err_path);
  // The files live in a directory start_background made for them alone.
  std::error_code ignored;
  std::filesystem::remove_all(std::filesystem::path(process.out_path).parent_path(), ignored);
  return result;
}

bool process_alive(int pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  // A zombie has finished running; only its parent's wait() is missing.
  std::ifstream stat_file("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(stat_file, stat)) return false;
  // The command name in parentheses may contain spaces; the state follows the last ')'.
  size_t name_end = stat.rfind(')');
  if (name_end == std::string::npos || name_end + 2 >= stat.size()) return false;
  const char state = stat[name_end + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace ddp::testing
