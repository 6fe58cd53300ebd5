#pragma once

// ddp's exception type. It is a c10::Error, so `catch (const c10::Error&)`
// and what_without_backtrace() keep working, but its what() is the message
// alone: a program that prints e.what() shows the cause and the fix, not a
// C++ stack trace, and ddprun's root-cause summary quotes that message.

#include <ddp/export.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>

namespace ddp {

/// Thrown by every check in ddp. what() == what_without_backtrace().
class DDP_API Error : public c10::Error {
 public:
  explicit Error(std::string message) : c10::Error(std::move(message), /*backtrace=*/nullptr) {}
  const char* what() const noexcept override { return what_without_backtrace(); }
};

/// Thrown where this rank fails because another one did: a collective whose
/// peer closed its connection, died or stopped calling collectives, a wait
/// for peers that timed out, a rendezvous that another rank stopped or that
/// a rank never joined. record_error() (error_file.h) marks it a
/// consequence, so launchers name the other rank's error as the root cause.
class DDP_API PeerFailure : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] inline void throw_error(std::string message) { throw Error(std::move(message)); }
[[noreturn]] inline void throw_peer_failure(std::string message) { throw PeerFailure(std::move(message)); }
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

/// DDP_CHECK for a condition that fails because of another rank: throws
/// ddp::PeerFailure.
#define DDP_PEER_CHECK(cond, ...)                                   \
  do {                                                              \
    if (C10_UNLIKELY(!(cond))) {                                    \
      ::ddp::detail::throw_peer_failure(::c10::str(__VA_ARGS__));   \
    }                                                               \
  } while (false)
