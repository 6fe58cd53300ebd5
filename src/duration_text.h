#pragma once

// Internal, not API: how ddp's messages write a timeout ("1.5 s").

#include "fmt_header_only.h"

#include <chrono>
#include <string>

namespace ddp::detail {

// Six significant digits, as an ostream writes a double: "300 s", "0.25 s".
inline std::string seconds_text(std::chrono::milliseconds timeout) {
  return fmt::format("{:g} s", static_cast<double>(timeout.count()) / 1000.0);
}

}  // namespace ddp::detail
