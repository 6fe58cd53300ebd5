// ddprun's launcher: starts one worker process per local rank with torchrun's environment,
// forwards their output line by line, and tears every worker down as soon as one fails or
// ddprun itself is asked to stop.
#pragma once

#include <string>
#include <vector>

namespace ddprun {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Single-node job: ignore master_addr/master_port and use a free port on 127.0.0.1.
  bool standalone = false;
  // Time a worker gets to exit after SIGTERM before it is SIGKILLed.
  double grace_period_seconds = 5.0;
  // Prefix each forwarded output line with "[rankR]: ".
  bool prefix_output = true;
  // PROGRAM followed by its arguments, passed to execvp untouched.
  std::vector<std::string> command;
};

// Throws std::invalid_argument naming the offending option if options cannot describe a job.
void validate(const LaunchOptions& options);

// Returns a TCP port on 127.0.0.1 that was free when asked. Throws std::runtime_error.
int pick_free_port();

// Number of GPUs the workers would see (/proc/driver/nvidia/gpus limited by CUDA_VISIBLE_DEVICES);
// 0 when the machine has none.
int count_visible_gpus();

// Number of online CPUs (at least 1).
int count_online_cpus();

class Launcher {
 public:
  explicit Launcher(LaunchOptions options);

  // Runs the job to completion and returns ddprun's exit code: 0 if every worker exited 0,
  // 1 if a worker failed, 128+N if ddprun received signal N. Throws std::runtime_error if
  // the workers cannot be started (after stopping any that were).
  int run();

 private:
  LaunchOptions options_;
};

}  // namespace ddprun
