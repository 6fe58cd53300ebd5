#include "common/error_text.h"

namespace ddp::detail {

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return without_backtrace_lines(c10_error->what_without_backtrace());
  }
  return without_backtrace_lines(e.what());
}

}  // namespace ddp::detail
