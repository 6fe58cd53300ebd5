#include "console.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>

namespace ddprun {
namespace {

// Enough for a burst of output while the reader is briefly away; beyond it a stalled reader
// costs lines, never memory or supervision.
constexpr size_t kWorkerBytesBound = 4 * 1024 * 1024;
// ddprun's own messages (failures, the root cause) are rare and short, and worth more.
constexpr size_t kOwnBytesBound = kWorkerBytesBound + 1024 * 1024;
// One write() never carries more than this, so a partial write can split at most one line.
constexpr size_t kMaxChunk = 64 * 1024;

class Stream {
 public:
  Stream(int fd, const char* name) : fd_(fd), name_(name) {}

  void write(const std::string& lines, bool own) {
    set_up();
    if (broken_) return;
    const size_t bound = own ? kOwnBytesBound : kWorkerBytesBound;
    const size_t queued = pending_.size() - head_;
    if (queued + lines.size() <= bound) {
      pending_ += lines;
    } else {
      // The lines that fit go out; the rest is dropped whole, so no line is ever cut.
      size_t room = bound > queued ? bound - queued : 0;
      size_t keep = room == 0 ? 0 : lines.rfind('\n', room - 1);
      keep = keep == std::string::npos ? 0 : keep + 1;
      pending_.append(lines, 0, keep);
      if (dropped_ == 0 && keep < lines.size()) started_dropping_ = true;
      dropped_ += lines.size() - keep;
    }
    flush();
  }

  // Returns true if anything was written.
  bool flush() {
    set_up();
    bool progress = false;
    while (!broken_ && head_ < pending_.size()) {
      if (!write_chunk(progress)) break;
    }
    if (head_ == pending_.size()) {
      pending_.clear();
      head_ = 0;
      if (dropped_ > 0 && !broken_) {
        // The reader is back: it learns where its output has a gap.
        pending_ = dropped_note(dropped_);
        dropped_ = 0;
        while (!broken_ && head_ < pending_.size()) {
          if (!write_chunk(progress)) break;
        }
      }
    } else if (head_ > kMaxChunk && head_ * 2 > pending_.size()) {
      pending_.erase(0, head_);
      head_ = 0;
    }
    return progress;
  }

  bool has_pending() const { return !broken_ && head_ < pending_.size(); }
  int poll_fd() const { return write_fd_; }

  // Output not announced as dropped yet: dropped since the last note, or still queued.
  unsigned long long lost_bytes() const { return dropped_ + (broken_ ? 0 : pending_.size() - head_); }

  // Whether the last write() began a stretch of dropped lines (once per stretch).
  bool take_started_dropping() {
    const bool started = started_dropping_;
    started_dropping_ = false;
    return started;
  }
  const char* name() const { return name_; }

  std::string dropped_note(unsigned long long bytes) const {
    return "ddprun: " + std::to_string(bytes) + " bytes of worker output were dropped because " + name_ +
           " was not being read\n";
  }

  // For sharing a target with the other stream (2>&1): writes stay at PIPE_BUF, which the
  // kernel keeps whole, so lines of the two never mix.
  void set_shared_target(bool shared) { shared_target_ = shared; }

  void set_up() {
    if (set_up_) return;
    set_up_ = true;
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      broken_ = true;
      return;
    }
    write_fd_ = fd_;
    if (S_ISSOCK(info.st_mode)) {
      socket_ = true;
      return;
    }
    if (S_ISFIFO(info.st_mode) || S_ISCHR(info.st_mode)) {
      // A description of our own for the same pipe or terminal: O_NONBLOCK on the inherited one
      // would change it for every other process sharing it (the shell, the other programs of a
      // pipeline).
      const std::string path = "/proc/self/fd/" + std::to_string(fd_);
      int own = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
      struct stat reopened {};
      if (own >= 0 && ::fstat(own, &reopened) == 0 && reopened.st_dev == info.st_dev &&
          reopened.st_ino == info.st_ino) {
        write_fd_ = own;
        return;
      }
      if (own >= 0) ::close(own);
    }
    // A regular file (its writes do not wait for a reader), or a pipe we could not reopen:
    // each write waits for poll() to say it fits.
    gated_ = true;
  }

  struct stat identity() {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) info.st_ino = 0;
    return info;
  }

 private:
  // Writes one chunk; returns false when the stream takes nothing more now.
  bool write_chunk(bool& progress) {
    const size_t cap = (shared_target_ || gated_) ? PIPE_BUF : kMaxChunk;
    size_t size = pending_.size() - head_;
    if (size > cap) {
      const size_t last_newline = pending_.rfind('\n', head_ + cap - 1);
      size = last_newline != std::string::npos && last_newline >= head_ ? last_newline + 1 - head_ : cap;
    }
    if (gated_) {
      pollfd waiter{write_fd_, POLLOUT, 0};
      if (::poll(&waiter, 1, 0) <= 0 || (waiter.revents & POLLOUT) == 0) {
        if ((waiter.revents & (POLLERR | POLLHUP | POLLNVAL)) == 0) return false;
      }
    }
    const char* data = pending_.data() + head_;
    ssize_t n = socket_ ? ::send(write_fd_, data, size, MSG_DONTWAIT | MSG_NOSIGNAL) : ::write(write_fd_, data, size);
    if (n > 0) {
      head_ += static_cast<size_t>(n);
      progress = true;
      return true;
    }
    if (n < 0 && errno == EINTR) return true;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    // The reader is gone (EPIPE) or the descriptor is unusable: output is lost, not the job.
    broken_ = true;
    pending_.clear();
    head_ = 0;
    return false;
  }

  int fd_;
  const char* name_;
  int write_fd_ = -1;
  bool set_up_ = false;
  bool broken_ = false;
  bool gated_ = false;
  bool socket_ = false;
  bool shared_target_ = false;
  std::string pending_;
  size_t head_ = 0;
  unsigned long long dropped_ = 0;  // since the last note
  bool started_dropping_ = false;
};

struct Console {
  Stream out{STDOUT_FILENO, "stdout"};
  Stream err{STDERR_FILENO, "stderr"};
  bool set_up = false;

  Stream& stream(int fd) {
    if (!set_up) {
      set_up = true;
      const struct stat a = out.identity();
      const struct stat b = err.identity();
      const bool shared = a.st_ino != 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
      out.set_shared_target(shared);
      err.set_shared_target(shared);
    }
    return fd == STDOUT_FILENO ? out : err;
  }
};

Console& console() {
  static Console instance;
  return instance;
}

}  // namespace

void console_write(int fd, const std::string& lines, bool own) {
  Console& c = console();
  Stream& stream = c.stream(fd);
  stream.write(lines, own);
  if (stream.take_started_dropping()) {
    // Said at once on the other stream, which may well be read (a terminal's stderr).
    Stream& other = fd == STDOUT_FILENO ? c.stream(STDERR_FILENO) : c.stream(STDOUT_FILENO);
    other.write(std::string("ddprun: ") + stream.name() +
                    " is not being read; dropping worker output meant for it until it is (--log-dir keeps all of "
                    "it)\n",
                true);
  }
}

void console_flush() {
  Console& c = console();
  c.stream(STDOUT_FILENO).flush();
  c.stream(STDERR_FILENO).flush();
}

void console_add_poll_fds(std::vector<pollfd>& fds) {
  Console& c = console();
  for (Stream* stream : {&c.stream(STDOUT_FILENO), &c.stream(STDERR_FILENO)}) {
    if (stream->has_pending()) fds.push_back({stream->poll_fd(), POLLOUT, 0});
  }
}

void console_finish(double stall_seconds) {
  using Clock = std::chrono::steady_clock;
  // Past the launcher, SIGPIPE is back to its default; a reader that left must not kill us now.
  struct sigaction ignore {};
  struct sigaction previous {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, &previous);

  Console& c = console();
  Stream& out = c.stream(STDOUT_FILENO);
  Stream& err = c.stream(STDERR_FILENO);
  const auto stall = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(stall_seconds));
  Clock::time_point give_up = Clock::now() + stall;
  while (true) {
    const bool progress = out.flush() | err.flush();
    if (!out.has_pending() && !err.has_pending()) break;
    const Clock::time_point now = Clock::now();
    if (progress) give_up = now + stall;
    if (now >= give_up) break;
    std::vector<pollfd> fds;
    console_add_poll_fds(fds);
    const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - now).count();
    ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<long long>(wait_ms + 1, 1, 1000)));
  }
  // Said where it can still be read: on the other stream, unless that one is stuck too.
  for (Stream* stalled : {&out, &err}) {
    const unsigned long long lost = stalled->lost_bytes();
    if (lost == 0 || !stalled->has_pending()) continue;
    Stream& other = stalled == &out ? err : out;
    (other.has_pending() ? *stalled : other).write(stalled->dropped_note(lost), true);
  }
  ::sigaction(SIGPIPE, &previous, nullptr);
}

}  // namespace ddprun
