// The message a torch-style error carries, for tests that check wording.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <string>

namespace ddp::testing {

/// Runs `f` and returns what it threw (a c10::Error's message without
/// backtrace, any other exception's what()), or "" if it did not throw.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace ddp::testing
