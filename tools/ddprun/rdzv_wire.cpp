#include "rdzv_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "hmac_sha256.h"
#include "posix_util.h"

namespace ddprun {
namespace rdzv_wire {

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

int ms_until(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 60 * 1000));
}

std::string fmt(double seconds) {
  std::ostringstream text;
  text.precision(3);
  text << seconds;
  return text.str();
}

namespace {

void put_u32(std::string& out, uint32_t value) {
  uint32_t big = htonl(value);
  out.append(reinterpret_cast<const char*>(&big), 4);
}

uint32_t get_u32(const std::string& in, size_t at) {
  uint32_t big = 0;
  std::memcpy(&big, in.data() + at, 4);
  return ntohl(big);
}

}  // namespace

std::string encode(const Message& message) {
  std::string body;
  put_u32(body, static_cast<uint32_t>(message.size()));
  for (const std::string& field : message) {
    put_u32(body, static_cast<uint32_t>(field.size()));
    body += field;
  }
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(body.size()));
  return frame + body;
}

int take_frame(std::string& buffer, Message* message) {
  if (buffer.size() < 4) return 0;
  const uint32_t length = get_u32(buffer, 0);
  if (length > kMaxFrame || length < 4) return -1;
  if (buffer.size() < 4 + static_cast<size_t>(length)) return 0;
  const std::string body = buffer.substr(4, length);
  buffer.erase(0, 4 + static_cast<size_t>(length));
  const uint32_t count = get_u32(body, 0);
  size_t at = 4;
  message->clear();
  for (uint32_t i = 0; i < count; ++i) {
    if (at + 4 > body.size()) return -1;
    const uint32_t size = get_u32(body, at);
    at += 4;
    if (at + size > body.size()) return -1;
    message->push_back(body.substr(at, size));
    at += size;
  }
  return at == body.size() ? 1 : -1;
}

int to_int(const std::string& text, int fallback) {
  try {
    return std::stoi(text);
  } catch (...) {
    return fallback;
  }
}

long long to_ll(const std::string& text) {
  try {
    return std::stoll(text);
  } catch (...) {
    return 0;
  }
}

in_addr resolve_ipv4(const std::string& host) {
  in_addr address{};
  if (::inet_pton(AF_INET, host.c_str(), &address) == 1) return address;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw std::runtime_error("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  address = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
  ::freeaddrinfo(found);
  return address;
}

std::string address_text(const in_addr& address) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address, text, sizeof text);
  return text;
}

bool exchange(int fd, const Message& message, Message* reply, Clock::time_point deadline) {
  const std::string frame = encode(message);
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) return false;
    pollfd p{fd, POLLOUT, 0};
    if (Clock::now() >= deadline || ::poll(&p, 1, ms_until(deadline)) < 0) return false;
  }
  std::string buffer;
  while (true) {
    int got = take_frame(buffer, reply);
    if (got == 1) return true;
    if (got < 0) return false;
    pollfd p{fd, POLLIN, 0};
    int ready = ::poll(&p, 1, ms_until(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    char chunk[16384];
    ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n > 0) {
      buffer.append(chunk, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      return false;
    }
  }
}

std::string server_proof(const std::string& secret, const std::string& client_nonce, const std::string& server_nonce) {
  return to_hex(hmac_sha256(secret, "server\n" + client_nonce + "\n" + server_nonce));
}

std::string client_proof(const std::string& secret, const std::string& server_nonce, const std::string& client_nonce) {
  return to_hex(hmac_sha256(secret, "client\n" + server_nonce + "\n" + client_nonce));
}

}  // namespace rdzv_wire

std::string load_rdzv_secret(const std::string& path) {
  // The type is checked before the file is opened: opening a FIFO for reading blocks until a
  // writer comes, and ddprun's signal handlers restart that open(), so ddprun would hang with
  // Ctrl-C ignored; opening a device may have effects of its own. stat() follows a symbolic
  // link, as a secret mounted by Kubernetes is one; what counts is the file it leads to.
  struct stat named {};
  if (::stat(path.c_str(), &named) != 0) {
    throw std::runtime_error("cannot read the rendezvous secret file '" + path + "': " + std::strerror(errno));
  }
  auto not_regular = [&](unsigned mode) {
    return std::runtime_error("the rendezvous secret file '" + path + "' is " + file_type_name(mode) +
                              ", not a regular file; give --rdzv-secret-file a regular file readable by its owner "
                              "only (chmod 600), e.g. from: head -c 32 /dev/urandom | base64 > FILE");
  };
  if (!S_ISREG(named.st_mode)) throw not_regular(named.st_mode);
  // O_NONBLOCK: should the path have been replaced by a FIFO since stat(), open() still returns.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error("cannot read the rendezvous secret file '" + path + "': " + std::strerror(errno));
  }
  struct stat info {};
  std::string secret;
  char buffer[4096];
  ssize_t n = 0;
  if (::fstat(fd, &info) != 0) {
    const int saved = errno;
    ::close(fd);
    throw std::runtime_error("cannot read the rendezvous secret file '" + path + "': " + std::strerror(saved));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    throw not_regular(info.st_mode);
  }
  while (secret.size() <= 4096 && (n = ::read(fd, buffer, sizeof buffer)) > 0) secret.append(buffer, static_cast<size_t>(n));
  const int read_errno = errno;
  ::close(fd);
  if (n < 0) {
    throw std::runtime_error("cannot read the rendezvous secret file '" + path + "': " + std::strerror(read_errno));
  }
  if (info.st_mode & (S_IRWXG | S_IRWXO)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    throw std::runtime_error("the rendezvous secret file '" + path + "' is open to other users (mode " + mode +
                             "); run: chmod 600 " + path);
  }
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) secret.pop_back();
  if (secret.size() < 16 || secret.size() > 4096) {
    throw std::runtime_error("the rendezvous secret file '" + path + "' holds " + std::to_string(secret.size()) +
                             " bytes; it needs 16 to 4096, e.g. from: head -c 32 /dev/urandom | base64 > " + path);
  }
  return secret;
}

int pick_free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace ddprun
