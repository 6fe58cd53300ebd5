// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the rendezvous store's challenge and
// response: ddprun links no crypto library, and this is all it needs of one.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace ddprun {

using Sha256Digest = std::array<uint8_t, 32>;

Sha256Digest sha256(const std::string& data);
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
