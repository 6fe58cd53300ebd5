// ddprun's launcher: starts one worker process per local rank with torchrun's environment,
// forwards their output line by line (or into per-worker log files), and tears every worker
// down as soon as one fails or ddprun itself is asked to stop. After a failure it can start the
// whole group again, up to max_restarts times.
#pragma once

#include <signal.h>

#include <string>
#include <vector>

namespace ddprun {

// Bits of LaunchOptions::tee, as torchrun's --tee numbers them.
constexpr int kTeeStdout = 1;
constexpr int kTeeStderr = 2;

// Below this, polling the store costs a core and detects nothing sooner that matters.
constexpr double kMinMonitorIntervalSeconds = 0.01;

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
  // If not empty, each worker's stdout and stderr also go to <log_dir>/attempt_<A>/rank_<R>.log
  // (the console gets what redirects and tee_spec below say), and torchrun's layout is there too.
  std::string log_dir;
  // --tee as one value for every rank; the launcher reads tee_spec.
  int tee = 0;
  // torchrun's --redirects and --tee, as given: "3" for every local rank, or "0:1,1:3" per
  // local rank (std_spec.h). A redirected stream goes to
  // <log_dir>/<run_id>_<random>/attempt_<A>/<local_rank>/{stdout,stderr}.log only; a teed one
  // there and to the console, prefixed "[default<local_rank>]:".
  std::string redirects = "0";
  std::string tee_spec = "0";
  // torchrun's --local-ranks-filter, as given ("0,2"): only these local ranks reach the
  // console; files get every rank. Empty: all ranks.
  std::string local_ranks_filter;
  // Teed lines containing any of these go to attempt_<A>/filtered_{stdout,stderr}.log too.
  std::vector<std::string> duplicate_stdout_filters, duplicate_stderr_filters;
  // torchrun's --numa-binding (node, socket, exclusive, core-complex): each local rank runs
  // on the CPUs near its GPU (cpu_binding.h). Empty: off.
  std::string numa_binding;
  // ddprun's --cpu-bind: "cores" pins each local rank to its own share of ddprun's CPUs.
  // Empty or "none": off.
  std::string cpu_bind;
  // Identifies the job; workers get it as TORCHELASTIC_RUN_ID and DDP_RUN_ID.
  std::string run_id = "none";
  // --rdzv-id was given; without it --standalone makes up a fresh id, as torchrun does.
  bool run_id_given = false;
  // torchrun's --role: the workers' ROLE_NAME.
  std::string role = "default";
  // torchrun's --signals-to-handle as given (the workers' TORCHELASTIC_SIGNALS_TO_HANDLE), and
  // its signals: each is forwarded to every worker's process group and ends the job, with
  // SIGKILL after the grace period. SIGUSR1 is forwarded for stack dumps whether listed or not,
  // and stops nothing.
  std::string signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
  std::vector<int> handled_signals = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  // torchrun's --virtual-local-rank: each worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES
  // narrowed to its own GPU (the local_rank-th entry of ddprun's, else the local rank).
  bool virtual_local_rank = false;
  // torchrun flags that change nothing for a program ddprun starts itself, kept as given:
  // --start-method (a program is always a fresh process), --event-log-handler (ddprun records
  // no events), --logs-specs (only 'default'), --no-python (ddprun never prepends python).
  std::string start_method = "spawn";
  std::string event_log_handler = "null";
  std::string logs_specs = "default";
  bool no_python = false;
  // Rendezvous of the agents (one ddprun per node): "static" (--master-addr and --node-rank
  // given by hand on every node), "c10d" (the agents meet in a store at rdzv_endpoint, which
  // one of them hosts; node ranks, the master and restarts are agreed there) or "etcd-v2" (they
  // meet in an etcd cluster, rdzv_endpoint listing its members HOST:PORT,HOST:PORT...; no ddprun
  // holds state the job needs).
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
  // With c10d: a file holding the job's secret, which every agent must prove it knows before
  // the store hears it (docs/security.md); empty: $DDP_RDZV_SECRET_FILE, else no secret.
  std::string rdzv_secret_file;
  // How often the agent polls the store (its heartbeat), in seconds; at least
  // kMinMonitorIntervalSeconds.
  double monitor_interval_seconds = 0.5;
  // --fault-tolerance (docs/fault_tolerance.md, "Running it under ddprun"): a failed worker is
  // restarted alone (with its replica group, see ft_replica_size), with a new replica id, while
  // the others go on; max_restarts bounds the restarts of this node's workers together. Workers
  // get DDP_FAULT_TOLERANCE=1, DDP_FT_STORE, DDP_FT_REPLICA_ID, DDP_FT_REPLICA_SIZE,
  // DDP_FT_INITIAL_REPLICAS and DDP_FT_DEADLINE_MS.
  bool fault_tolerance = false;
  // --ft-deadline: how long a step may wait for a member before it is fenced out.
  double ft_deadline_seconds = 5.0;
  // --ft-replica-size: the workers of a node form replica groups of this many consecutive local
  // ranks (fault-tolerant HSDP: a group shards its model among itself), which share one
  // DDP_FT_REPLICA_ID and fail and restart as one unit. 1: every worker is a replica. Must
  // divide nproc_per_node.
  int ft_replica_size = 1;
  // --ft-store-port: where the store keeper (ddp_ft_store) serves the fault-tolerance store
  // under static and c10d rendezvous; 0: any free port with --standalone, else the master's
  // (static) or the rendezvous endpoint's (c10d) port + 1.
  int ft_store_port = 0;
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
