// The self-pipe trick: signal handlers write the signal number into a pipe that the launcher's
// poll() loop watches, so signals and worker output are handled in one place, synchronously.
#pragma once

#include <signal.h>

#include <vector>

namespace ddprun {

class SignalPipe {
 public:
  // Installs handlers for `signals`, except for those that were ignored when ddprun started
  // (nohup, background jobs): ignoring them was the caller's wish, and workers inherit it.
  explicit SignalPipe(const std::vector<int>& signals);
  ~SignalPipe();  // restores the previous handlers
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return read_fd_; }

  // Signals delivered since the last call, in arrival order. Never blocks.
  std::vector<int> drain();

  // Dispositions a freshly forked worker must have before exec: everything ddprun changed,
  // back to default. Called in the child between fork and exec (only async-signal-safe calls).
  void reset_in_child() const;

 private:
  struct Installed {
    int signal_number;
    struct sigaction previous;
  };
  int read_fd_ = -1;
  int write_fd_ = -1;
  std::vector<Installed> installed_;
};

}  // namespace ddprun
