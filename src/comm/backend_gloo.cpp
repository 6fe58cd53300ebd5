// The only file of ddp that includes Gloo's headers (through c10d's
// ProcessGroupGloo.hpp). Gloo itself is compiled into libtorch_cpu; the wheel
// ships no Gloo headers, so Debian's libgloo-dev provides the declarations.
// Nothing here touches a Gloo class's layout: devices are created and held by
// libtorch through shared_ptr, and every call goes to a function defined in
// libtorch_cpu. tests/test_gloo_headers.cpp checks that at the symbol level.
#define USE_C10D_GLOO 1
#include <ddp/error.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/backends.h"
#include "launch/env_impl.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>

namespace ddp::detail {
namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The local address the kernel would use to reach `host`: each rank must bind
// Gloo to an address its peers can reach, which on a multi-node job is not
// loopback and not necessarily what the hostname resolves to.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(port);
  if (getaddrinfo(host.c_str(), port_text.c_str(), &hints, &result) != 0 || result == nullptr) {
    return "";
  }
  std::string local;
  int fd = socket(result->ai_family, SOCK_DGRAM, 0);
  // A UDP connect() sends nothing; it only picks the route and source address.
  if (fd >= 0 && connect(fd, result->ai_addr, result->ai_addrlen) == 0) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* raw = addr.ss_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr);
      if (inet_ntop(addr.ss_family, raw, text, sizeof(text)) != nullptr) local = text;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(result);
  return local;
}

// Two threads per rank (PyTorch's default) keep one bucket's all-reduce in
// flight while the next is being filled. With a core or less per rank they
// only compete with the training thread: measured on 2 cores and 2 ranks,
// one thread makes a 2M-parameter step 4% faster. DDP_GLOO_THREADS overrides.
int gloo_threads(const World& world) {
  if (const char* text = std::getenv("DDP_GLOO_THREADS")) {
    int threads = parse_int_env("DDP_GLOO_THREADS", text);
    DDP_CHECK(threads >= 1 && threads <= 64, "ddp: DDP_GLOO_THREADS='", text,
                "' must be a number of threads in [1, 64]");
    return threads;
  }
  unsigned cores = std::thread::hardware_concurrency();
  return cores > 0 && cores <= static_cast<unsigned>(world.local_world_size) ? 1 : 2;
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (world.world_size == 1 || is_loopback(world.master_addr) ||
             (world.master_addr.empty() && world.local_world_size == world.world_size)) {
    // Every rank on this host (without a master address, as under file://,
    // the launcher's LOCAL_WORLD_SIZE says so).
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else if (world.master_addr.empty()) {
    // No master to find a route to (file:// across nodes): the address this
    // host's name resolves to, as PyTorch does; GLOO_SOCKET_IFNAME overrides.
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    std::string local = local_address_towards(world.master_addr, world.master_port);
    DDP_CHECK(!local.empty(), "ddp: no network route from this host to MASTER_ADDR=",
                world.master_addr, "; set GLOO_SOCKET_IFNAME to the interface to use");
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local));
  }
  options->threads = gloo_threads(world);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, world.rank, world.world_size, options);
}

}  // namespace ddp::detail
