// Forwards one worker stream (the read end of a pipe) to one of ddprun's own streams, whole
// lines at a time, so that lines of different workers never mix.
#pragma once

#include <string>

namespace ddprun {

class LineForwarder {
 public:
  // Takes ownership of source_fd (made non-blocking). prefix goes before every line.
  LineForwarder(int source_fd, int destination_fd, std::string prefix);
  ~LineForwarder();
  LineForwarder(LineForwarder&& other) noexcept;
  LineForwarder& operator=(LineForwarder&&) = delete;
  LineForwarder(const LineForwarder&) = delete;
  LineForwarder& operator=(const LineForwarder&) = delete;

  bool is_open() const { return source_fd_ >= 0; }
  int fd() const { return source_fd_; }

  // Reads what is available (at most one buffer) and forwards the complete lines. Closes the
  // stream at end of file or on error, flushing a trailing partial line with a newline added.
  // Returns true if it read anything.
  bool read_some();

  // Reads until the pipe is empty or closed, without blocking.
  void read_available();

  // Gives up on the stream (its writer escaped our control), flushing what was read.
  void close();

 private:
  // Emits the complete lines in pending_; with flush_partial also what follows the last newline.
  void forward_lines(bool flush_partial);

  int source_fd_ = -1;
  int destination_fd_ = -1;
  std::string prefix_;
  std::string pending_;
};

}  // namespace ddprun
