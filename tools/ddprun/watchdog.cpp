#include "watchdog.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "posix_util.h"

namespace ddprun {
namespace {

// Messages on the pipe are one pid_t each: a group to watch (> 0), a group to forget (its id
// negated), or this value meaning "dismissed".
constexpr pid_t kDismissed = 0;

[[noreturn]] void run_watchdog(int read_fd) {
  // Signals aimed at the launcher's process group or terminal session (Ctrl-C, a harness
  // killing the group), or at every process of a job (Slurm's `scancel --signal USR1`, a
  // time limit's SIGXCPU), must not take the watchdog down before it could act: it ignores
  // every signal whose default would end it, except SIGKILL, which nothing can ignore.
  ::setsid();
  for (int signal_number : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM,
                            SIGPROF, SIGXCPU, SIGXFSZ, SIGPOLL})
    ::signal(signal_number, SIG_IGN);
  // Holding the launcher's stdout/stderr open would delay EOF for whoever reads them.
  int null_fd = ::open("/dev/null", O_RDWR);
  if (null_fd >= 0) {
    for (int fd = 0; fd <= 2; ++fd) ::dup2(null_fd, fd);
    if (null_fd > 2) ::close(null_fd);
  }
  // So would any other copy of them (ddprun's non-blocking console descriptors).
  if (read_fd > 3) ::close_range(3, static_cast<unsigned>(read_fd) - 1, 0);
  ::close_range(static_cast<unsigned>(read_fd) + 1, ~0U, 0);

  std::vector<pid_t> groups;
  while (true) {
    pid_t message = 0;
    ssize_t n = ::read(read_fd, &message, sizeof message);
    if (n < 0 && errno == EINTR) continue;
    if (n == static_cast<ssize_t>(sizeof message)) {
      if (message == kDismissed) ::_exit(0);
      if (message > 0) {
        groups.push_back(message);
      } else {
        groups.erase(std::remove(groups.begin(), groups.end(), -message), groups.end());
      }
      continue;
    }
    break;  // end of file: the launcher is gone without dismissing us
  }
  for (pid_t group : groups) ::killpg(group, SIGKILL);
  ::_exit(0);
}

}  // namespace

Watchdog::Watchdog() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno("pipe2 for the watchdog");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[1]);  // otherwise the launcher's death would never look like end of file
    run_watchdog(fds[0]);
  }
  const int fork_errno = errno;
  ::close(fds[0]);
  if (pid < 0) {
    ::close(fds[1]);
    errno = fork_errno;
    throw_errno("fork for the watchdog");
  }
  pid_ = pid;
  write_fd_ = fds[1];
}

Watchdog::~Watchdog() {
  if (write_fd_ >= 0) ::close(write_fd_);
  if (pid_ > 0) {
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

void Watchdog::watch(pid_t process_group) {
  if (write_fd_ < 0) return;
  // Writes of at most PIPE_BUF bytes are atomic; an error means the watchdog is gone already,
  // and the launcher's own cleanup still applies.
  write_all(write_fd_, reinterpret_cast<const char*>(&process_group), sizeof process_group);
}

void Watchdog::forget(pid_t process_group) {
  if (write_fd_ < 0 || process_group <= 0) return;
  const pid_t message = -process_group;
  write_all(write_fd_, reinterpret_cast<const char*>(&message), sizeof message);
}

void Watchdog::dismiss() {
  if (write_fd_ < 0) return;
  const pid_t dismissed = kDismissed;
  write_all(write_fd_, reinterpret_cast<const char*>(&dismissed), sizeof dismissed);
  ::close(write_fd_);
  write_fd_ = -1;
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

}  // namespace ddprun
