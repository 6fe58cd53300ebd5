#pragma once

// Gloo has no abort (torch 2.11: ProcessGroup::abort does nothing and
// Work::abort throws), but shutting down a group's connected sockets fails
// its pending operations within milliseconds. These helpers find a group's
// sockets by diffing this process's open sockets around its creation, shut
// them down, and watch them for a peer's hang-up (a crashed peer's kernel
// closes its end at once). The listening socket is never touched: a
// shutdown of it aborts the process through a Gloo assertion.

#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ddp::detail {

/// A connected socket, identified by its descriptor and both ends'
/// addresses, so that a descriptor number reused by another socket after
/// Gloo closed its own is never mistaken for it.
struct TrackedSocket {
  int fd = -1;
  std::string local;  ///< "127.0.0.1:40312"
  std::string peer;
};

/// This process's open sockets as (descriptor, inode) pairs.
std::set<std::pair<int, unsigned long>> open_sockets();

/// The connected sockets opened since `before` (listening ones excluded).
std::vector<TrackedSocket> connected_sockets_since(const std::set<std::pair<int, unsigned long>>& before);

/// `sockets` less those whose peer is one of `peers` ("ip:port").
std::vector<TrackedSocket> without_peers(std::vector<TrackedSocket> sockets, const std::set<std::string>& peers);

/// Held around making a group whose sockets are to be tracked, so that two
/// such creations never see each other's sockets.
std::mutex& socket_tracking_mutex();

/// shutdown(2) of each socket that is still the one tracked.
void shutdown_sockets(const std::vector<TrackedSocket>& sockets);

/// The peer addresses of those sockets whose peer hung up (or which Gloo
/// already closed after an error), without reading anything.
std::vector<std::string> hung_up_peers(const std::vector<TrackedSocket>& sockets);

// Liveness connections: one plain TCP connection between every two replicas,
// never shut down on an abort, so only a process's exit closes it. Its
// hang-up tells a crash from a member that merely aborted its group (which
// shuts Gloo's sockets) or hangs (which closes nothing).

/// The local address this host uses to reach `host` ("127.0.0.1" for a
/// loopback host or when there is no route).
std::string local_address_towards(const std::string& host);
/// A non-blocking listening socket on `host`, any port; `address` gets
/// "ip:port". -1 when it cannot be made.
int listen_for_liveness(const std::string& host, std::string& address);
/// A connection to "ip:port", or -1.
int connect_for_liveness(const std::string& address);
/// The connections waiting on `listener`, accepted.
std::vector<int> accept_pending(int listener);
/// Whether the peer of connected socket `fd` closed or reset it.
bool peer_hung_up(int fd);

/// What arrives on a liveness connection from a peer: "hello <id>\n" once,
/// then a beat "b\n" every heartbeat interval. Fed the bytes as they come,
/// in any pieces. Anyone who can reach the port can connect, so nothing
/// here trusts the bytes: a line longer than kMaxLine ends the connection,
/// and other lines only count as a sign of life.
struct LivenessInbound {
  static constexpr size_t kMaxLine = 4096;
  std::string who;   ///< from the hello; empty before it
  std::string text;  ///< an incomplete line
  /// Takes `n` bytes; false when the connection is to be dropped.
  bool feed(const char* data, size_t n);
};

}  // namespace ddp::detail
