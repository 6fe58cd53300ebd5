// What a ddp job prints when an exception escapes where nothing can catch it
// (src/comm/stack_dump.cpp's terminate handler, installed with the first process
// group). It blames the transport only for an exception that came from the
// transport; issue 34 item 11 saw an out-of-memory in a save blamed on it.
#include <ddp/collective_trace.h>
#include <ddp/error.h>
#include <ddp/stack_dump.h>

#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace {

struct Ending {
  std::string err;
  int exit_code = -1;
};

// Runs `escape` in a forked child that looks like a ddp rank (a trace
// registered for rank 3, one collective in flight, the handler installed)
// and returns what it wrote on stderr and how it exited.
Ending terminate_with(void (*escape)()) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  pid_t child = ::fork();
  if (child == 0) {
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::alarm(30);
    static ddp::CollectiveTrace trace(16);
    trace.begin("all_reduce", at::ones({2}));
    ddp::detail::register_trace_for_dumps(&trace, &trace, 3);
    ddp::detail::install_transport_failure_handler();
    std::thread(escape).join();
    ::_exit(0);
  }
  ::close(fds[1]);
  Ending ending;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) ending.err.append(buffer, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  ending.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return ending;
}

TEST(TerminateHandler, AnUncaughtExceptionIsDescribedNotBlamedOnTheTransport) {
  Ending ending = terminate_with([] { throw std::runtime_error("the disk went away"); });
  EXPECT_EQ(ending.exit_code, 1) << ending.err;
  EXPECT_NE(ending.err.find("error: ddp: rank 3: the process ended on an exception that nothing caught: "
                            "std::runtime_error: the disk went away."),
            std::string::npos)
      << ending.err;
  EXPECT_NE(ending.err.find("#1 (all_reduce"), std::string::npos) << ending.err;
  EXPECT_EQ(ending.err.find("transport"), std::string::npos) << ending.err;
  EXPECT_EQ(ending.err.find("different collectives"), std::string::npos) << ending.err;

  ending = terminate_with([] { throw std::bad_alloc(); });
  EXPECT_EQ(ending.exit_code, 1) << ending.err;
  EXPECT_NE(ending.err.find("nothing caught: std::bad_alloc: std::bad_alloc"), std::string::npos) << ending.err;
  EXPECT_EQ(ending.err.find("transport"), std::string::npos) << ending.err;
}

TEST(TerminateHandler, GloosTransportFailureIsStillNamedAsOne) {
  // What Gloo's pair.cc throws on a size mismatch (its enforce macro names
  // its source file).
  Ending ending = terminate_with([] {
    throw std::runtime_error(
        "[enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. "
        "256 vs 8");
  });
  EXPECT_EQ(ending.exit_code, 1) << ending.err;
  EXPECT_NE(ending.err.find("error: ddp: rank 3: the process group's transport failed in a background thread"),
            std::string::npos)
      << ending.err;
  EXPECT_NE(ending.err.find("issued different collectives"), std::string::npos) << ending.err;
}

// The launcher learns from the error file's type flag, not from the text, that a PeerFailure
// which escaped was caused by another rank (ddp's phrases are no longer read as consequences).
TEST(TerminateHandler, AnEscapedPeerFailureIsRecordedAsAConsequence) {
  char dir[] = "/tmp/ddp_terminate_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/error.json";
  auto recorded = [&](void (*escape)()) {
    ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
    Ending ending = terminate_with(escape);
    ::unsetenv("TORCHELASTIC_ERROR_FILE");
    EXPECT_EQ(ending.exit_code, 1) << ending.err;
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    std::remove(path.c_str());
    return text.str();
  };
  std::string text = recorded([] { throw ddp::PeerFailure("ddp: rank 2 left the job"); });
  EXPECT_NE(text.find("\"consequence\": true"), std::string::npos) << text;
  EXPECT_NE(text.find("nothing caught: ddp: rank 2 left the job"), std::string::npos) << text;
  text = recorded([] { throw ddp::Error("ddp: rank 3 ran out of patience"); });
  EXPECT_NE(text.find("\"consequence\": false"), std::string::npos) << text;
  ::rmdir(dir);
}

}  // namespace
