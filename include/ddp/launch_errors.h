#pragma once

// How an error's text tells a consequence of another process's failure from
// an original error, written once for both sides: ddp judges the exceptions
// it records (error_file.h) and ddprun the error files of programs that are
// not ddp's (Python workers under torchrun's @record). Torch-free: ddprun
// includes it too, as it does launch_env.h.

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

namespace ddp::launch_errors {

/// Lowercase fragments of the messages LibTorch, Gloo, ddp and ddprun give
/// when a peer died or never came: a connection closed or reset, a timeout
/// waiting for peers, a rendezvous that another rank stopped.
inline constexpr std::string_view kConsequencePatterns[] = {
    "connection closed by peer", "connection reset by peer", "broken pipe", "a peer may have died",
    "timed out", "socket timeout", "wait timeout", "not all of them joined", "stops too",
    "cannot reach the master", "did not publish its run id", "for rank 0 to join",
};

/// Whether `message` contains one of kConsequencePatterns, in any case.
inline bool reads_like_consequence(std::string_view message) {
  std::string text(message);
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return std::any_of(std::begin(kConsequencePatterns), std::end(kConsequencePatterns),
                     [&](std::string_view pattern) { return text.find(pattern) != std::string::npos; });
}

}  // namespace ddp::launch_errors
