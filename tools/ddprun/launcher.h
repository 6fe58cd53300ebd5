// ddprun's launcher: starts one worker process per local rank with torchrun's environment,
// forwards their output line by line (or into per-worker log files), and tears every worker
// down as soon as one fails or ddprun itself is asked to stop. After a failure it can start the
// whole group again, up to max_restarts times.
#pragma once

#include <string>
#include <vector>

namespace ddprun {

// Bits of LaunchOptions::tee, as torchrun's --tee numbers them.
constexpr int kTeeStdout = 1;
constexpr int kTeeStderr = 2;

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
  // How many times the workers are all started again after one of them fails.
  int max_restarts = 0;
  // If not empty, each worker's stdout and stderr go to <log_dir>/attempt_<A>/rank_<R>.log
  // instead of the console.
  std::string log_dir;
  // With log_dir: the streams that are shown on the console as well (kTeeStdout, kTeeStderr).
  int tee = 0;
  // Identifies the job; workers get it as TORCHELASTIC_RUN_ID and DDP_RUN_ID.
  std::string run_id = "none";
  // Rendezvous of the agents (one ddprun per node): "static" (--master-addr and --node-rank
  // given by hand on every node) or "c10d" (the agents meet in a store at rdzv_endpoint, which
  // one of them hosts; node ranks, the master and restarts are agreed there).
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;  // HOST[:PORT], port 29400 when omitted
  // --nnodes MIN:MAX: with c10d, rounds form with MIN..MAX nodes; nnodes holds MAX.
  int min_nodes = 1;
  bool node_rank_given = false;
  double join_timeout_seconds = 600;
  double last_call_timeout_seconds = 30;
  double heartbeat_timeout_seconds = 5;
  // The address this node advertises to the others (its workers' MASTER_ADDR when it is node
  // 0); empty: the address it reaches the store from.
  std::string local_addr;
  // How often the agent polls the store (its heartbeat), in seconds.
  double monitor_interval_seconds = 0.5;
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

  // Runs the job to completion, restarting it after failures as options allow, and returns
  // ddprun's exit code: 0 if every worker of an attempt exited 0, 1 if a worker failed and no
  // restart was left, 128+N if ddprun received signal N. Throws std::runtime_error if the log
  // directory or the workers cannot be set up (after stopping any workers that were started).
  int run();

 private:
  LaunchOptions options_;
};

}  // namespace ddprun
