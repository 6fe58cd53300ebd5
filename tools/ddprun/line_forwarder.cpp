#include "line_forwarder.h"

#include <unistd.h>

#include <cerrno>

#include "posix_util.h"

namespace ddprun {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
// A worker printing megabytes without a newline (a progress bar using '\r', binary junk) must
// not grow our memory forever; past this size the partial line is forwarded as a line.
constexpr size_t kMaxLineBytes = 1024 * 1024;

}  // namespace

LineForwarder::LineForwarder(int source_fd, int destination_fd, std::string prefix)
    : source_fd_(source_fd), destination_fd_(destination_fd), prefix_(std::move(prefix)) {
  set_nonblocking(source_fd_);
}

LineForwarder::~LineForwarder() {
  if (source_fd_ >= 0) ::close(source_fd_);
}

LineForwarder::LineForwarder(LineForwarder&& other) noexcept
    : source_fd_(other.source_fd_),
      destination_fd_(other.destination_fd_),
      prefix_(std::move(other.prefix_)),
      pending_(std::move(other.pending_)) {
  other.source_fd_ = -1;
}

bool LineForwarder::read_some() {
  if (source_fd_ < 0) return false;
  char buffer[kReadChunk];
  ssize_t n = ::read(source_fd_, buffer, sizeof buffer);
  if (n > 0) {
    pending_.append(buffer, static_cast<size_t>(n));
    forward_lines(/*flush_partial=*/pending_.size() > kMaxLineBytes);
    return true;
  }
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return false;
  close();  // end of file, or an error that will not go away
  return false;
}

void LineForwarder::read_available() {
  // Bounded so that a writer that never stops cannot keep us here forever.
  for (int round = 0; round < 1024; ++round) {
    if (!read_some()) break;
  }
}

void LineForwarder::close() {
  if (source_fd_ < 0) return;
  ::close(source_fd_);
  source_fd_ = -1;
  forward_lines(/*flush_partial=*/true);
}

void LineForwarder::forward_lines(bool flush_partial) {
  size_t end = flush_partial ? pending_.size() : pending_.rfind('\n') + 1;  // npos + 1 == 0
  if (end == 0) return;

  std::string out;
  out.reserve(end + prefix_.size() * 8 + 1);
  size_t start = 0;
  while (start < end) {
    size_t newline = pending_.find('\n', start);
    size_t line_end = (newline == std::string::npos || newline >= end) ? end : newline;
    out += prefix_;
    out.append(pending_, start, line_end - start);
    out += '\n';
    start = line_end + 1;
  }
  pending_.erase(0, end);
  // ddprun is single-threaded and writes only whole lines, so lines of different workers
  // cannot interleave in its output.
  write_all(destination_fd_, out);
}

}  // namespace ddprun
