// Forwards one worker stream (the read end of a pipe) to one or more destinations (ddprun's own
// stdout/stderr, a log file), whole lines at a time, so that lines of different workers never
// mix. It also remembers the stream's last non-empty line for failure reports.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace ddprun {

// One destination of a stream's lines: a descriptor the forwarder does not own, and the text
// put before every line written there. Lines for ddprun's own stdout or stderr (console) go
// through console_write(), which never blocks and may drop them; a log file gets every line.
struct LineSink {
  int fd = -1;
  std::string prefix;
  bool console = false;
  // If not empty, only lines containing one of these (torchrun's --duplicate-*-filters).
  std::vector<std::string> only_lines_containing;
  // A file's path, for the warning when writing it fails (a full disk).
  std::string path;
};

class LineForwarder {
 public:
  // Takes ownership of source_fd (made non-blocking).
  LineForwarder(int source_fd, std::vector<LineSink> sinks);
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

  // Remember whether any line ever forwarded contains `marker` (no newline in it): evidence
  // that outlives the few recent lines kept for reports.
  void watch_for(std::string marker) { marker_ = std::move(marker); }
  bool marker_seen() const { return marker_seen_; }

  // The last forwarded line with visible text, trailing white space removed and very long
  // lines shortened; empty if there was none.
  const std::string& last_line() const { return last_line_; }

  // The last forwarded line that reads like an error message ("error: ...", "...Error: ...");
  // stack frames ("frame #15: ...") never count. Empty if there was none.
  const std::string& last_error_line() const { return last_error_line_; }

  // The last few lines with visible text (at most kRecentLines, oldest first), shortened as
  // last_line() is: what a log that could not be written would have ended with.
  static constexpr size_t kRecentLines = 5;
  const std::vector<std::string>& recent_lines() const { return recent_lines_; }

  // Why a file sink stopped getting lines ("'PATH': No space left on device"); empty while every
  // file got every line. ddprun warns on the console the first time this happens in the run.
  const std::string& file_write_error() const { return file_write_error_; }

 private:
  // Emits the complete lines in pending_; with flush_partial also what follows the last newline.
  void forward_lines(bool flush_partial);
  // Remembers text[start, end) as the last line unless it is blank; returns whether it did.
  bool remember_if_not_blank(const std::string& text, size_t start, size_t end);
  // The same for last_error_line_ if the line reads like an error.
  void remember_if_error(const std::string& text, size_t start, size_t end);
  // Adds the batch's lines with text, pending_[start, end) each, to recent_lines_.
  void remember_recent(const std::vector<std::pair<size_t, size_t>>& lines);

  int source_fd_ = -1;
  std::vector<LineSink> sinks_;
  std::string pending_;
  std::string last_line_;
  std::string last_error_line_;
  std::vector<std::string> recent_lines_;
  std::string file_write_error_;
  std::vector<bool> sink_failed_;  // by sink: a file that failed gets nothing more
  std::string marker_;
  bool marker_seen_ = false;
};

}  // namespace ddprun
