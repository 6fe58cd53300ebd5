#include "hmac_sha256.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <stdexcept>

namespace ddprun {

Sha256Digest hmac_sha256(const std::string& key, const std::string& message) {
  // HMAC() takes the key's length as an int; a secret file is far smaller, but a silent
  // truncation here would turn two different secrets into one.
  if (key.size() > static_cast<size_t>(INT_MAX)) {
    throw std::runtime_error("the rendezvous secret is " + std::to_string(key.size()) +
                             " bytes, more than HMAC-SHA256 takes; use a shorter --rdzv-secret-file");
  }
  Sha256Digest digest{};
  unsigned int length = 0;
  // The default, secret-less store authenticates with an empty key: data() is never null, so
  // libcrypto reads it as a zero-length key, not as "reuse the previous key".
  const unsigned char* done =
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), digest.data(), &length);
  if (done == nullptr || length != digest.size()) {
    char reason[256] = "no reason given";
    if (const unsigned long code = ERR_get_error()) ERR_error_string_n(code, reason, sizeof reason);
    ERR_clear_error();
    // A working libcrypto refuses only by configuration: a FIPS-only one may reject HMAC keys
    // under 112 bits, the empty key of a store without a secret included.
    throw std::runtime_error(std::string("OpenSSL's libcrypto refused to compute HMAC-SHA256 (") + reason +
                             "); check its configuration (OPENSSL_CONF): a FIPS-only one may refuse short "
                             "keys, so give every node the same --rdzv-secret-file of at least 14 bytes");
  }
  return digest;
}

std::string to_hex(const uint8_t* data, size_t size) {
  static const char kDigits[] = "0123456789abcdef";
  std::string text;
  text.reserve(2 * size);
  for (size_t i = 0; i < size; ++i) {
    text += kDigits[data[i] >> 4];
    text += kDigits[data[i] & 15];
  }
  return text;
}

bool equal_in_constant_time(const std::string& a, const std::string& b) {
  // The length is not secret (every proof is 64 hex digits); only the content must not leak.
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string random_hex(size_t bytes) {
  std::string buffer(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(&buffer[got], bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(std::string("getrandom: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  return to_hex(reinterpret_cast<const uint8_t*>(buffer.data()), buffer.size());
}

}  // namespace ddprun
