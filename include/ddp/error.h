#pragma once

// ddp's exception type. It is a c10::Error, so `catch (const c10::Error&)`
// and what_without_backtrace() keep working, but its what() is the message
// alone: a program that prints e.what() shows the cause and the fix, not a
// C++ stack trace, and ddprun's root-cause summary quotes that message.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>

namespace ddp {

/// Thrown by every check in ddp. what() == what_without_backtrace().
class Error : public c10::Error {
 public:
  explicit Error(std::string message) : c10::Error(std::move(message), /*backtrace=*/nullptr) {}
  const char* what() const noexcept override { return what_without_backtrace(); }
};

namespace detail {
[[noreturn]] inline void throw_error(std::string message) { throw Error(std::move(message)); }
}  // namespace detail

}  // namespace ddp

/// TORCH_CHECK's twin that throws ddp::Error: DDP_CHECK(cond, "what went
/// wrong, ", value, "; what to do").
#define DDP_CHECK(cond, ...)                                        \
  do {                                                              \
    if (C10_UNLIKELY(!(cond))) {                                    \
      ::ddp::detail::throw_error(::c10::str(__VA_ARGS__));          \
    }                                                               \
  } while (false)
