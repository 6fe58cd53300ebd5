#pragma once

// Internal: an exception's message as ddp quotes it, never with a backtrace.
// c10::Error's what() carries "Exception raised from ..." and "frame #N"
// lines, and c10d sometimes nests one error's what() inside another's
// message, so the lines are dropped from the text as well.

#include <ddp/export.h>

#include <c10/util/Exception.h>

#include <exception>
#include <sstream>
#include <string>

namespace ddp::detail {

inline std::string without_backtrace_lines(const std::string& text) {
  std::istringstream in(text);
  std::string out, line;
  while (std::getline(in, line)) {
    const size_t first = line.find_first_not_of(" \t");
    const std::string trimmed = first == std::string::npos ? "" : line.substr(first);
    if (trimmed.rfind("frame #", 0) == 0 || trimmed.rfind("Exception raised from", 0) == 0) continue;
    if (!out.empty()) out += '\n';
    out += line;
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// The message without backtrace lines (defined in src/common/error_text.cpp).
// Exported: the public templates of sharded_snapshot.h quote errors with it.
DDP_API std::string message_of(const std::exception& e);

}  // namespace ddp::detail
