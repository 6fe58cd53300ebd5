// Running real processes from tests: capture their output, bound their run time, and make sure
// nothing they start is left behind. POSIX/Linux only.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace ddp::testing {

struct ProcessResult {
  int exit_code = -1;            // exit status if exited normally, else -1
  int term_signal = 0;           // signal number if killed by a signal, else 0
  bool timed_out = false;        // true if we killed it because of the timeout
  std::string out;               // captured stdout
  std::string err;               // captured stderr
  double seconds = 0;            // wall time
  std::string describe() const;  // one line summary + both streams, for assertion messages
};

struct RunOptions {
  std::vector<std::pair<std::string, std::string>> env;  // set/override in the child
  std::vector<std::string> unset_env;                    // removed in the child
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  std::string cwd;  // empty: inherit
};

// Runs argv[0] (PATH lookup) to completion, capturing both streams. The child runs in its own
// process group; on timeout the whole group gets SIGKILL. Never hangs past timeout (+ a few
// seconds).
ProcessResult run_process(const std::vector<std::string>& argv, const RunOptions& options = {});

// Path of a built executable: std::string(DDP_BIN_DIR) + "/" + name.
std::string bin_path(const std::string& name);

// A fresh empty temporary directory (mkdtemp under $TMPDIR or /tmp); caller may remove it.
std::string make_temp_dir(const std::string& prefix = "ddp_test");

// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close).
int free_port();

// Starts a process in the background (own process group), stdout/stderr redirected to files in a
// temp dir; used for tests that must signal a running launcher.
struct BackgroundProcess {
  int pid = -1;
  std::string out_path, err_path;
};
BackgroundProcess start_background(const std::vector<std::string>& argv,
                                   const RunOptions& options = {});

// Waits for it with a timeout (kills its group on timeout), returning the same result struct with
// out/err read from the files (which are then removed). `seconds` is the time spent waiting here.
ProcessResult wait_background(const BackgroundProcess& process, std::chrono::milliseconds timeout);

// kill(pid, 0) == 0 and not a zombie (/proc/<pid>/stat state != 'Z').
bool process_alive(int pid);

}  // namespace ddp::testing
