// ddp_ft_store: serves the c10d TCPStore that fault-tolerant workers keep their membership in
// (DDP_FT_STORE=tcp://HOST:PORT), outside every worker. ddprun --fault-tolerance starts it on
// the node that hosts the store (tools/ddprun/store_keeper.h); it prints the port it serves on
// as its first line and serves until its parent dies or it gets SIGTERM.
//
//   ddp_ft_store [--port PORT] [--parent-pid PID]
//
// PORT 0 (the default) lets the kernel pick one. With --parent-pid it exits at once if its
// parent is not PID (ddprun died while starting it) and whenever its parent goes.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ddp_ft_store: %s\nusage: ddp_ft_store [--port PORT] [--parent-pid PID]\n", why.c_str());
  std::exit(2);
}

int number(const std::string& flag, const char* text) {
  if (text == nullptr) usage(flag + " needs a value");
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 0 || value > 1 << 30) usage(std::string("bad value for ") + flag);
  return static_cast<int>(value);
}

}  // namespace

int main(int argc, char** argv) {
  int port = 0;
  int parent = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--port") {
      port = number(flag, argv[++i]);
    } else if (flag == "--parent-pid") {
      parent = number(flag, argv[++i]);
    } else {
      usage("unknown argument '" + flag + "'");
    }
  }
  if (port > 65535) usage("--port must be in 0..65535");
  // A client that vanishes mid-reply must cost a connection, not the store.
  ::signal(SIGPIPE, SIG_IGN);
  if (parent > 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) return 1;
  }
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(port);
    options.isServer = true;
    options.waitWorkers = false;
    options.numWorkers = std::nullopt;
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
    std::printf("%d\n", static_cast<int>(store->getPort()));
    std::fflush(stdout);
    // Served by the store's own threads; this one only watches the parent (the death signal
    // covers it too, but not a parent that was reparented before prctl took effect).
    while (parent <= 0 || ::getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "ddp_ft_store: cannot serve the store on port %d: %s\n", port, error.what());
    return 1;
  }
  return 0;
}
