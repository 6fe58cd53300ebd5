// The message a torch-style error carries, for tests that check wording.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace ddp::testing {

/// Runs `f` and returns the c10::Error's message without backtrace, or ""
/// if it did not throw.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace ddp::testing
