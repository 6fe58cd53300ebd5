#include "fault/socket_watch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace ddp::detail
