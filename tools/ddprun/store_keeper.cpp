#include "store_keeper.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "posix_util.h"
#include "signal_pipe.h"

namespace ddprun {
namespace {

// Starting a TCPStore takes milliseconds; loading torch's libraries, on a busy node, seconds.
constexpr int kStartTimeoutMs = 60 * 1000;

}  // namespace

std::string store_keeper_program() {
  if (const char* path = std::getenv("DDP_FT_STORE_KEEPER"); path != nullptr && *path != '\0') return path;
  char self[PATH_MAX] = {};
  const ssize_t length = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::string directory = length > 0 ? std::string(self, static_cast<size_t>(length)) : "";
  directory = directory.substr(0, directory.rfind('/') == std::string::npos ? 0 : directory.rfind('/'));
  return (directory.empty() ? "." : directory) + "/ddp_ft_store";
}

std::unique_ptr<StoreKeeper> StoreKeeper::start(int port, const SignalPipe& signals) {
  const std::string program = store_keeper_program();
  if (::access(program.c_str(), X_OK) != 0) {
    throw std::runtime_error("--fault-tolerance needs ddp_ft_store, which serves the workers' store, but '" + program +
                             "' is not an executable (" + std::strerror(errno) +
                             "); install it next to ddprun or name it in DDP_FT_STORE_KEEPER");
  }
  const std::string port_text = std::to_string(port);
  const std::string parent_text = std::to_string(::getpid());
  std::vector<std::string> args = {program, "--port", port_text, "--parent-pid", parent_text};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw_errno("pipe2");
  // Its own group (fork_supervised_child's): a Ctrl-C at the terminal reaches ddprun, which
  // decides when the store goes.
  const pid_t pid = fork_supervised_child(out[1], [&] {
    signals.reset_in_child();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(argv[0], argv.data());
  });
  const int fork_errno = errno;
  ::close(out[1]);
  FileDescriptor reader(out[0]);
  if (pid < 0) {
    errno = fork_errno;
    throw_errno("fork for ddp_ft_store");
  }
  std::unique_ptr<StoreKeeper> keeper(new StoreKeeper(pid, 0));
  // Its first line is the port it serves on.
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kStartTimeoutMs);
  while (line.find('\n') == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw std::runtime_error("'" + program + "' did not start serving within 60 s");
    pollfd fd{reader.get(), POLLIN, 0};
    const int ready = ::poll(&fd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buffer[64];
    const ssize_t got = ::read(reader.get(), buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      throw std::runtime_error("'" + program + "' exited before it served the store (its error is above)");
    }
    line.append(buffer, static_cast<size_t>(got));
  }
  keeper->port_ = std::atoi(line.c_str());
  if (keeper->port_ <= 0 || keeper->port_ > 65535) {
    throw std::runtime_error("'" + program + "' said '" + printable(line.substr(0, line.find('\n'))) +
                             "' where its port was expected");
  }
  return keeper;
}

StoreKeeper::~StoreKeeper() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 200; ++i) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid_, SIGKILL);
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace ddprun
