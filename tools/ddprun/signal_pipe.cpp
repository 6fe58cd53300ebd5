#include "signal_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include "posix_util.h"

namespace ddprun {
namespace {

// The handler can only reach the pipe through a global; one SignalPipe exists at a time.
volatile sig_atomic_t g_signal_write_fd = -1;

void on_signal(int signal_number) {
  int saved_errno = errno;
  unsigned char byte = static_cast<unsigned char>(signal_number);
  // If the pipe is full the loop is already awake and will look at every worker anyway.
  ssize_t ignored = ::write(g_signal_write_fd, &byte, 1);
  (void)ignored;
  errno = saved_errno;
}

}  // namespace

SignalPipe::SignalPipe(const std::vector<int>& signals) {
  if (g_signal_write_fd != -1) throw std::logic_error("only one SignalPipe may exist at a time");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2 for signals");
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  g_signal_write_fd = write_fd_;

  for (int signal_number : signals) {
    struct sigaction current {};
    ::sigaction(signal_number, nullptr, &current);
    if (signal_number != SIGCHLD && current.sa_handler == SIG_IGN) continue;

    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    // SA_RESTART keeps blocking writes to our stdout going; poll() still returns EINTR,
    // and the byte in the pipe wakes it up in any case.
    action.sa_flags = SA_RESTART | (signal_number == SIGCHLD ? SA_NOCLDSTOP : 0);
    Installed entry{signal_number, {}};
    if (::sigaction(signal_number, &action, &entry.previous) != 0) throw_errno("sigaction");
    installed_.push_back(entry);
  }
}

SignalPipe::~SignalPipe() {
  for (const Installed& entry : installed_)
    ::sigaction(entry.signal_number, &entry.previous, nullptr);
  g_signal_write_fd = -1;
  ::close(read_fd_);
  ::close(write_fd_);
}

std::vector<int> SignalPipe::drain() {
  std::vector<int> received;
  unsigned char buffer[64];
  while (true) {
    ssize_t n = ::read(read_fd_, buffer, sizeof buffer);
    if (n > 0) {
      received.insert(received.end(), buffer, buffer + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;  // EAGAIN: nothing more for now
  }
  return received;
}

void SignalPipe::reset_in_child() const {
  for (const Installed& entry : installed_) ::signal(entry.signal_number, SIG_DFL);
}

}  // namespace ddprun
