// HMAC-SHA256 (RFC 2104) for the rendezvous store's challenge and response, computed by
// OpenSSL's libcrypto: security code is where a hand-written version hurts most. Only this file
// includes OpenSSL, so the rest of ddprun and its tests see plain strings and arrays.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace ddprun {

using Sha256Digest = std::array<uint8_t, 32>;

// Throws std::runtime_error, with libcrypto's reason, if libcrypto cannot compute it.
Sha256Digest hmac_sha256(const std::string& key, const std::string& message);

// Lower-case hex of bytes.
std::string to_hex(const uint8_t* data, size_t size);
inline std::string to_hex(const Sha256Digest& digest) { return to_hex(digest.data(), digest.size()); }

// Compares in time that depends only on the lengths, so that a peer cannot learn a correct
// prefix from how fast a wrong answer is refused.
bool equal_in_constant_time(const std::string& a, const std::string& b);

// `bytes` bytes from getrandom(2), as hex. Throws std::runtime_error if the kernel has none.
std::string random_hex(size_t bytes);

}  // namespace ddprun
