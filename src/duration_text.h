#pragma once

// Internal, not API: how ddp's messages write a timeout ("1.5 s").

#include <chrono>
#include <sstream>
#include <string>

namespace ddp::detail {

inline std::string seconds_text(std::chrono::milliseconds timeout) {
  std::ostringstream out;
  out << static_cast<double>(timeout.count()) / 1000.0 << " s";
  return out.str();
}

}  // namespace ddp::detail
