#include "line_forwarder.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "console.h"
#include "error_record.h"
#include "posix_util.h"

namespace ddprun {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
// A worker printing megabytes without a newline (a progress bar using '\r', binary junk) must
// not grow our memory forever; past this size the partial line is forwarded as a line.
constexpr size_t kMaxLineBytes = 1024 * 1024;
// The remembered last line goes into a one-line report; a huge line is cut to this size.
constexpr size_t kMaxRememberedBytes = 1000;

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

// Once per run, however many workers' logs fail: they share the disk that filled up.
void warn_file_write_failed(const std::string& path, int error_number) {
  static bool warned = false;
  if (warned) return;
  warned = true;
  const size_t slash = path.rfind('/');
  const std::string directory = slash == std::string::npos ? std::string(".") : path.substr(0, slash);
  say("warning: cannot write the log file '" + path + "': " + std::strerror(error_number) +
      "; the workers' output goes on to the console, but this log and others in '" + directory +
      "' may end early (free space there, or give --log-dir a directory with room)");
}

}  // namespace

LineForwarder::LineForwarder(int source_fd, std::vector<LineSink> sinks)
    : source_fd_(source_fd), sinks_(std::move(sinks)), sink_failed_(sinks_.size(), false) {
  set_nonblocking(source_fd_);
}

LineForwarder::~LineForwarder() {
  if (source_fd_ >= 0) ::close(source_fd_);
}

LineForwarder::LineForwarder(LineForwarder&& other) noexcept
    : source_fd_(other.source_fd_),
      sinks_(std::move(other.sinks_)),
      pending_(std::move(other.pending_)),
      last_line_(std::move(other.last_line_)),
      last_error_line_(std::move(other.last_error_line_)),
      recent_lines_(std::move(other.recent_lines_)),
      file_write_error_(std::move(other.file_write_error_)),
      sink_failed_(std::move(other.sink_failed_)),
      marker_(std::move(other.marker_)),
      marker_seen_(other.marker_seen_) {
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

bool LineForwarder::remember_if_not_blank(const std::string& text, size_t start, size_t end) {
  while (end > start && is_blank(text[end - 1])) --end;
  size_t first_visible = start;
  while (first_visible < end && is_blank(text[first_visible])) ++first_visible;
  if (first_visible == end) return false;
  // A stack trace's frames say where, not what: the report quotes the line before them.
  if (is_stack_frame_line(text.substr(start, std::min(end - start, kMaxRememberedBytes)))) return false;
  if (end - start <= kMaxRememberedBytes) {
    last_line_.assign(text, start, end - start);
  } else {
    last_line_.assign(text, start, kMaxRememberedBytes);
    last_line_ += " [...]";
  }
  return true;
}

void LineForwarder::remember_if_error(const std::string& text, size_t start, size_t end) {
  while (end > start && is_blank(text[end - 1])) --end;
  while (start < end && is_blank(text[start])) ++start;
  if (start == end) return;
  std::string line = text.substr(start, std::min(end - start, kMaxRememberedBytes));
  if (!is_error_line(line)) return;
  if (end - start > kMaxRememberedBytes) line += " [...]";
  last_error_line_ = std::move(line);
}

void LineForwarder::remember_recent(const std::vector<std::pair<size_t, size_t>>& lines) {
  // Only the batch's last kRecentLines lines with text can be among the last ones.
  std::vector<std::string> newest;
  for (auto it = lines.rbegin(); it != lines.rend() && newest.size() < kRecentLines; ++it) {
    size_t start = it->first;
    size_t end = it->second;
    while (end > start && is_blank(pending_[end - 1])) --end;
    if (end == start || std::all_of(pending_.begin() + static_cast<std::ptrdiff_t>(start),
                                    pending_.begin() + static_cast<std::ptrdiff_t>(end), is_blank)) {
      continue;
    }
    std::string line = pending_.substr(start, std::min(end - start, kMaxRememberedBytes));
    if (end - start > kMaxRememberedBytes) line += " [...]";
    newest.push_back(std::move(line));
  }
  recent_lines_.insert(recent_lines_.end(), newest.rbegin(), newest.rend());
  if (recent_lines_.size() > kRecentLines) {
    recent_lines_.erase(recent_lines_.begin(),
                        recent_lines_.begin() + static_cast<std::ptrdiff_t>(recent_lines_.size() - kRecentLines));
  }
}

void LineForwarder::forward_lines(bool flush_partial) {
  size_t end = flush_partial ? pending_.size() : pending_.rfind('\n') + 1;  // npos + 1 == 0
  if (end == 0) return;

  // Where each line starts and ends inside pending_.
  std::vector<std::pair<size_t, size_t>> lines;
  size_t start = 0;
  while (start < end) {
    size_t newline = pending_.find('\n', start);
    size_t line_end = (newline == std::string::npos || newline >= end) ? end : newline;
    lines.emplace_back(start, line_end);
    start = line_end + 1;
  }
  // The batch's latest line with text replaces the remembered one; earlier ones cannot.
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (remember_if_not_blank(pending_, it->first, it->second)) break;
  }
  for (const auto& [line_start, line_end] : lines) remember_if_error(pending_, line_start, line_end);
  remember_recent(lines);
  if (!marker_seen_ && !marker_.empty()) {
    marker_seen_ = std::string_view(pending_).substr(0, end).find(marker_) != std::string_view::npos;
  }

  for (size_t sink_index = 0; sink_index < sinks_.size(); ++sink_index) {
    const LineSink& sink = sinks_[sink_index];
    if (sink_failed_[sink_index]) continue;
    std::string out;
    out.reserve(end + sink.prefix.size() * lines.size() + 1);
    for (const auto& [line_start, line_end] : lines) {
      if (!sink.only_lines_containing.empty() &&
          std::none_of(sink.only_lines_containing.begin(), sink.only_lines_containing.end(),
                       [&](const std::string& needle) {
                         return std::string_view(pending_).substr(line_start, line_end - line_start).find(needle) !=
                                std::string_view::npos;
                       })) {
        continue;
      }
      out += sink.prefix;
      out.append(pending_, line_start, line_end - line_start);
      out += '\n';
    }
    // ddprun writes only whole lines, from one thread, so lines of different workers cannot
    // interleave in its output.
    if (out.empty()) continue;
    if (sink.console) {
      console_write(sink.fd, out, /*own=*/false);
    } else if (!write_all(sink.fd, out)) {
      // A full disk (ENOSPC, EDQUOT) or a failing one (EIO): the lines go on to the console and
      // into memory for the failure summary, and the user hears why the log ends early.
      sink_failed_[sink_index] = true;
      const int error_number = errno;
      file_write_error_ = "'" + sink.path + "': " + std::strerror(error_number);
      warn_file_write_failed(sink.path, error_number);
    }
  }
  pending_.erase(0, end);
}

}  // namespace ddprun
