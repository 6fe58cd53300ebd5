#pragma once

// How an error's text tells a consequence of another process's failure from
// an original error, written once for both sides: ddp judges the exceptions
// it records that are not its own (error_file.h), and ddprun the error files
// of programs that are not ddp's (Python workers under torchrun's @record).
// Torch-free: ddprun includes it too, as it does launch_env.h.

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

namespace ddp::launch_errors {

/// Lowercase fragments of the messages other libraries give when a peer died
/// or never came: a connection closed or reset, a timeout waiting for peers.
/// None is ddp's own: ddp says by an exception's type (ddp::PeerFailure)
/// whether another rank caused it, so its phrases never need reading.
inline constexpr std::string_view kConsequencePatterns[] = {
    "connection closed by peer",  // Gloo's TCP transport
    "connection reset by peer",   // the OS (ECONNRESET), as Gloo and c10d quote it
    "broken pipe",                // the OS (EPIPE), as Gloo and c10d quote it
    "timed out",                  // Gloo's waits, c10d's TCPStore and monitoredBarrier
    "socket timeout",             // c10d's TCPStore
    "wait timeout",               // c10d's stores
};

/// Whether `message` contains one of kConsequencePatterns, in any case.
inline bool reads_like_consequence(std::string_view message) {
  std::string text(message);
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return std::any_of(std::begin(kConsequencePatterns), std::end(kConsequencePatterns),
                     [&](std::string_view pattern) { return text.find(pattern) != std::string::npos; });
}

}  // namespace ddp::launch_errors
