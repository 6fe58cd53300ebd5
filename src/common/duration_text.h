#pragma once

// Internal, not API: how ddp's messages write a timeout ("1.5 s") and the
// progress line an elapsed time or an ETA ("1:02:03").

#include "common/fmt_header_only.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>

namespace ddp::detail {

// Six significant digits, as an ostream writes a double: "300 s", "0.25 s".
inline std::string seconds_text(std::chrono::milliseconds timeout) {
  return fmt::format("{:g} s", static_cast<double>(timeout.count()) / 1000.0);
}

// "1:02:03", "4:05": hours only when needed; "?" for an unknown time.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto total = static_cast<int64_t>(std::llround(seconds));
  int64_t h = total / 3600, m = (total / 60) % 60, s = total % 60;
  if (h > 0) return fmt::format("{}:{:02}:{:02}", h, m, s);
  return fmt::format("{}:{:02}", m, s);
}

}  // namespace ddp::detail
