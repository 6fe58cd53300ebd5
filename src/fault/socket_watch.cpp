#include "fault/socket_watch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace ddp::detail {
namespace {

std::string address_text(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(addr);
    inet_ntop(AF_INET, &in.sin_addr, text, sizeof(text));
    port = ntohs(in.sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(addr);
    inet_ntop(AF_INET6, &in6.sin6_addr, text, sizeof(text));
    port = ntohs(in6.sin6_port);
  } else {
    return "";
  }
  return std::string(text) + ":" + std::to_string(port);
}

// Both ends of `fd`, or false when it is not a connected inet socket.
bool ends_of(int fd, std::string& local, std::string& peer) {
  sockaddr_storage a{}, b{};
  socklen_t la = sizeof(a), lb = sizeof(b);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0) return false;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0) return false;
  local = address_text(a);
  peer = address_text(b);
  return !local.empty() && !peer.empty();
}

bool still_tracked(const TrackedSocket& s) {
  std::string local, peer;
  return ends_of(s.fd, local, peer) && local == s.local && peer == s.peer;
}

}  // namespace

std::set<std::pair<int, unsigned long>> open_sockets() {
  std::set<std::pair<int, unsigned long>> sockets;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return sockets;
  const int own = dirfd(dir);
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == own) continue;
    struct stat st {};
    if (fstat(static_cast<int>(fd), &st) == 0 && S_ISSOCK(st.st_mode)) {
      sockets.emplace(static_cast<int>(fd), static_cast<unsigned long>(st.st_ino));
    }
  }
  closedir(dir);
  return sockets;
}

std::vector<TrackedSocket> connected_sockets_since(const std::set<std::pair<int, unsigned long>>& before) {
  std::vector<TrackedSocket> found;
  for (const auto& entry : open_sockets()) {
    if (before.count(entry)) continue;
    TrackedSocket s;
    s.fd = entry.first;
    // A listening socket has no peer: it is left out here, so never shut down.
    if (ends_of(s.fd, s.local, s.peer)) found.push_back(s);
  }
  return found;
}

std::vector<TrackedSocket> without_peers(std::vector<TrackedSocket> sockets, const std::set<std::string>& peers) {
  sockets.erase(std::remove_if(sockets.begin(), sockets.end(), [&](const TrackedSocket& s) { return peers.count(s.peer) > 0; }),
                sockets.end());
  return sockets;
}

std::mutex& socket_tracking_mutex() {
  static std::mutex mutex;
  return mutex;
}

void shutdown_sockets(const std::vector<TrackedSocket>& sockets) {
  for (const auto& s : sockets) {
    if (still_tracked(s)) ::shutdown(s.fd, SHUT_RDWR);
  }
}

std::vector<std::string> hung_up_peers(const std::vector<TrackedSocket>& sockets) {
  std::vector<std::string> peers;
  for (const auto& s : sockets) {
    if (!still_tracked(s)) {
      // Gloo closes a pair's socket once it failed: its peer went away.
      peers.push_back(s.peer);
      continue;
    }
    pollfd p{};
    p.fd = s.fd;
    p.events = POLLRDHUP;
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) peers.push_back(s.peer);
  }
  return peers;
}

std::string local_address_towards(const std::string& host) {
  if (host.empty() || host == "localhost" || host.rfind("127.", 0) == 0) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &result) != 0 || result == nullptr) return "127.0.0.1";
  std::string local = "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  // A UDP connect() sends nothing; it only picks the route and source address.
  if (fd >= 0 && connect(fd, result->ai_addr, result->ai_addrlen) == 0) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      std::string text = address_text(addr);
      local = text.substr(0, text.rfind(':'));
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(result);
  return local;
}

int listen_for_liveness(const std::string& host, std::string& address) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = 0;
  if (inet_pton(AF_INET, host.c_str(), &in.sin_addr) != 1 ||
      bind(fd, reinterpret_cast<sockaddr*>(&in), sizeof(in)) != 0 || listen(fd, 64) != 0) {
    close(fd);
    return -1;
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  address = address_text(addr);
  return fd;
}

int connect_for_liveness(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = htons(static_cast<uint16_t>(std::atoi(address.substr(colon + 1).c_str())));
  if (inet_pton(AF_INET, address.substr(0, colon).c_str(), &in.sin_addr) != 1) return -1;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&in), sizeof(in)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::vector<int> accept_pending(int listener) {
  std::vector<int> accepted;
  while (listener >= 0) {
    int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) break;
    accepted.push_back(fd);
  }
  return accepted;
}

bool peer_hung_up(int fd) {
  pollfd p{};
  p.fd = fd;
  p.events = POLLRDHUP;
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

bool LivenessInbound::feed(const char* data, size_t n) {
  text.append(data, n);
  size_t start = 0;
  for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
    if (end - start > kMaxLine) return false;
    if (text.compare(start, 6, "hello ") == 0 && end - start > 6) who = text.substr(start + 6, end - start - 6);
  }
  text.erase(0, start);
  return text.size() <= kMaxLine;
}

}  // namespace ddp::detail
