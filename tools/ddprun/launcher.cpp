#include "launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "posix_util.h"
#include "session.h"
#include "std_spec.h"
#include "worker_setup.h"

namespace ddprun {
namespace {

std::string random_uuid() {
  unsigned char bytes[16] = {};
  FileDescriptor source(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  if (source.get() < 0 || ::read(source.get(), bytes, sizeof bytes) != static_cast<ssize_t>(sizeof bytes)) {
    throw_errno("cannot read /dev/urandom for --standalone's run id");
  }
  bytes[6] = static_cast<unsigned char>((bytes[6] & 0x0f) | 0x40);  // version 4
  bytes[8] = static_cast<unsigned char>((bytes[8] & 0x3f) | 0x80);  // RFC 4122 variant
  static const char kHex[] = "0123456789abcdef";
  std::string text;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    text += kHex[bytes[i] >> 4];
    text += kHex[bytes[i] & 0xf];
  }
  return text;
}

// Restores SIGPIPE's disposition when the launcher returns.
class IgnoreSigpipe {
 public:
  IgnoreSigpipe() {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, &previous_);
  }
  ~IgnoreSigpipe() { ::sigaction(SIGPIPE, &previous_, nullptr); }
  IgnoreSigpipe(const IgnoreSigpipe&) = delete;
  IgnoreSigpipe& operator=(const IgnoreSigpipe&) = delete;

 private:
  struct sigaction previous_ {};
};

// --ft-replica-size: groups of S consecutive local ranks, which only --fault-tolerance restarts
// as one unit, and which must not straddle two nodes.
void check_ft_replica_size(const LaunchOptions& options) {
  const int size = options.ft_replica_size;
  if (size < 1) {
    throw std::invalid_argument("invalid value '" + std::to_string(size) +
                                "' for --ft-replica-size: expected a positive integer, the workers in one replica group");
  }
  if (size > 1 && !options.fault_tolerance) {
    throw std::invalid_argument("--ft-replica-size " + std::to_string(size) +
                                " makes replica groups that fail and restart as one unit, which only --fault-tolerance "
                                "does; add --fault-tolerance (or PET_FAULT_TOLERANCE=1), or drop --ft-replica-size");
  }
  if (options.nproc_per_node % size != 0) {
    const int n = options.nproc_per_node;
    std::vector<int> divisors;
    for (int d = 1; static_cast<long long>(d) * d <= n; ++d) {
      if (n % d != 0) continue;
      divisors.push_back(d);
      if (n / d != d) divisors.push_back(n / d);
    }
    std::sort(divisors.begin(), divisors.end());
    std::string choices;
    if (divisors.size() <= 16) {
      for (int d : divisors) choices += (choices.empty() ? " (" : ", ") + std::to_string(d);
      choices += ")";
    }
    throw std::invalid_argument("--ft-replica-size " + std::to_string(size) + " does not divide --nproc-per-node " +
                                std::to_string(options.nproc_per_node) + ": a replica group is " +
                                std::to_string(size) +
                                " consecutive local ranks of one node; give --ft-replica-size a divisor of " +
                                std::to_string(options.nproc_per_node) + choices +
                                ", or change --nproc-per-node");
  }
}

}  // namespace

void validate(const LaunchOptions& options) {
  auto invalid = [](const std::string& flag, const std::string& value, const std::string& why) {
    return std::invalid_argument("invalid value '" + printable(value) + "' for " + flag + ": " + why);
  };
  // The values ddprun echoes on the console, in prefixes and in logs: a newline in one could
  // forge a line from a worker or from ddprun (the command line refuses them too; this covers
  // options built in code).
  for (const auto& [flag, value] : {std::pair<std::string, std::string>{"--role", options.role},
                                    {"--rdzv-id", options.run_id},
                                    {"--rdzv-endpoint", options.rdzv_endpoint},
                                    {"--master-addr", options.master_addr},
                                    {"--local-addr", options.local_addr},
                                    {"--log-dir", options.log_dir},
                                    {"--rdzv-secret-file", options.rdzv_secret_file}}) {
    if (has_control_character(value)) throw invalid(flag, value, "control characters are not allowed");
  }
  if (options.nproc_per_node < 1) {
    throw invalid("--nproc-per-node", std::to_string(options.nproc_per_node), "must be at least 1");
  }
  if (options.nnodes < 1) {
    throw invalid("--nnodes", std::to_string(options.nnodes), "must be at least 1");
  }
  check_ft_replica_size(options);
  // Every rank must fit RANK and WORLD_SIZE, which workers read as an int.
  const long long world_size = static_cast<long long>(options.nnodes) * options.nproc_per_node;
  if (world_size > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("--nnodes " + std::to_string(options.nnodes) + " times --nproc-per-node " +
                                std::to_string(options.nproc_per_node) + " is " + std::to_string(world_size) +
                                " workers, more than the limit of " +
                                std::to_string(std::numeric_limits<int>::max()) + " ranks in a job");
  }
  const bool etcd = options.rdzv_backend == "etcd-v2";
  // Whether the agents meet in a rendezvous (node ranks assigned there) rather than by hand.
  const bool c10d = options.rdzv_backend == "c10d" || etcd;
  if (options.rdzv_backend != "static" && !c10d) {
    throw invalid("--rdzv-backend", options.rdzv_backend, "expected 'c10d', 'etcd-v2' or 'static'");
  }
  if (c10d && options.rdzv_endpoint.empty()) {
    throw std::invalid_argument(etcd ? "--rdzv-backend etcd-v2 needs --rdzv-endpoint HOST:PORT[,HOST:PORT...], the etcd "
                                       "cluster's client URLs"
                                     : "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]");
  }
  if (options.rdzv_backend != "c10d" && !options.rdzv_secret_file.empty()) {
    throw std::invalid_argument("--rdzv-secret-file protects the c10d rendezvous store; it needs --rdzv-backend c10d");
  }
  if (c10d && options.standalone) {
    throw std::invalid_argument("--standalone runs a single node without a rendezvous; drop it or --rdzv-backend " +
                                options.rdzv_backend);
  }
  if (etcd && options.max_restarts > 0 && !options.fault_tolerance) {
    // The etcd rendezvous forms one round: restarting every node's workers together is the
    // c10d backend's job.
    throw std::invalid_argument("--max-restarts with --rdzv-backend etcd-v2 needs --fault-tolerance (a failed worker is "
                                "then restarted alone); for restarts of the whole job use --rdzv-backend c10d");
  }
  if (!c10d && options.min_nodes != options.nnodes) {
    throw invalid("--nnodes", std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes),
                  "MIN:MAX needs --rdzv-backend c10d or etcd-v2");
  }
  if (options.min_nodes < 1 || options.min_nodes > options.nnodes) {
    throw invalid("--nnodes", std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes),
                  "expected 1 <= MIN <= MAX");
  }
  if (!c10d && (options.node_rank < 0 || options.node_rank >= options.nnodes)) {
    throw invalid("--node-rank", std::to_string(options.node_rank),
                  "must be in [0, " + std::to_string(options.nnodes) + ") since --nnodes is " +
                      std::to_string(options.nnodes));
  }
  if (options.master_addr.empty()) {
    throw invalid("--master-addr", options.master_addr, "expected a host name or IP address");
  }
  if (options.master_port < 1 || options.master_port > 65535) {
    throw invalid("--master-port", std::to_string(options.master_port),
                  "expected a port in 1..65535");
  }
  if (!std::isfinite(options.grace_period_seconds) || options.grace_period_seconds < 0) {
    throw invalid("--grace-period", format_seconds(options.grace_period_seconds),
                  "expected a number of seconds >= 0");
  }
  if (options.max_restarts < 0) {
    throw invalid("--max-restarts", std::to_string(options.max_restarts),
                  "expected an integer >= 0");
  }
  if (options.tee < 0 || options.tee > (kTeeStdout | kTeeStderr)) {
    throw invalid("--tee", std::to_string(options.tee), "expected 0, 1, 2 or 3");
  }
  for (const auto& [flag, spec] : {std::pair<std::string, std::string>{"--redirects", options.redirects},
                                   {"--tee", options.tee_spec}}) {
    try {
      check_std_spec(spec);
    } catch (const std::invalid_argument& error) {
      throw invalid(flag, spec, error.what());
    }
  }
  try {
    parse_local_ranks(options.local_ranks_filter);
  } catch (const std::invalid_argument& error) {
    throw invalid("--local-ranks-filter", options.local_ranks_filter, error.what());
  }
  const std::set<std::string> numa_modes = {"node", "socket", "exclusive", "core-complex"};
  if (!options.numa_binding.empty() && numa_modes.count(options.numa_binding) == 0) {
    throw invalid("--numa-binding", options.numa_binding, "expected node, socket, exclusive or core-complex");
  }
  if (!options.cpu_bind.empty() && options.cpu_bind != "none" && options.cpu_bind != "cores") {
    throw invalid("--cpu-bind", options.cpu_bind, "expected 'none' or 'cores'");
  }
  if (options.cpu_bind == "cores" && !options.numa_binding.empty()) {
    throw std::invalid_argument("--cpu-bind cores and --numa-binding both choose the workers' CPUs; give one of them");
  }
  if (options.run_id.empty()) {
    throw invalid("--rdzv-id", options.run_id, "expected a non-empty id");
  }
  if (options.standalone && options.nnodes != 1) {
    throw std::invalid_argument("--standalone runs a single node, but --nnodes is " +
                                std::to_string(options.nnodes) + "; drop one of them");
  }
  if (!(options.monitor_interval_seconds >= kMinMonitorIntervalSeconds) ||
      !std::isfinite(options.monitor_interval_seconds)) {
    throw invalid("--monitor-interval", format_seconds(options.monitor_interval_seconds),
                  "expected a number of seconds >= " + format_seconds(kMinMonitorIntervalSeconds));
  }
  if (c10d && options.heartbeat_timeout_seconds <= options.monitor_interval_seconds) {
    throw invalid("--rdzv-conf heartbeat_timeout", format_seconds(options.heartbeat_timeout_seconds),
                  "must be longer than --monitor-interval (" + format_seconds(options.monitor_interval_seconds) + " s)");
  }
  if (options.command.empty()) throw std::invalid_argument("missing PROGRAM to run");
}

int pick_free_port() { return free_loopback_port("--standalone could not find a free port on 127.0.0.1"); }

int count_visible_gpus() {
  int installed = 0;
  if (DIR* directory = ::opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* entry = ::readdir(directory)) {
      if (entry->d_name[0] != '.') ++installed;
    }
    ::closedir(directory);
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (installed == 0 || visible == nullptr) return installed;
  // CUDA stops at the first empty or negative entry ("-1" is the usual way to hide all GPUs).
  int listed = 0;
  std::stringstream entries(visible);
  std::string entry;
  while (std::getline(entries, entry, ',')) {
    if (entry.empty() || entry[0] == '-') break;
    ++listed;
  }
  return std::min(listed, installed);
}

int count_online_cpus() {
  long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 ? static_cast<int>(cpus) : 1;
}

Launcher::Launcher(LaunchOptions options) : options_(std::move(options)) {}

int Launcher::run() {
  validate(options_);
  if (options_.virtual_local_rank) {
    // Refused before any worker starts, as a usage error.
    for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) virtual_local_rank_device(local_rank);
  }
  // As torchrun's --standalone: a fresh id for every run unless one was asked for.
  if (options_.standalone && !options_.run_id_given) options_.run_id = random_uuid();
  ensure_standard_fds_open();
  if (!options_.log_dir.empty()) {
    // A log directory we cannot use is reported before any worker starts.
    create_directories(options_.log_dir);
    if (::access(options_.log_dir.c_str(), W_OK | X_OK) != 0) {
      throw_errno("cannot write to log directory '" + options_.log_dir + "'");
    }
    // ddprun's own files below DIR are safe from plants (worker_setup.cpp), but in a directory
    // others may write into without the sticky bit they could rename attempt_<A> away while
    // the job runs and leave a link in its place, which the workers' own files would follow.
    struct stat info {};
    if (::stat(options_.log_dir.c_str(), &info) == 0 && (info.st_mode & (S_IWGRP | S_IWOTH)) != 0 &&
        (info.st_mode & S_ISVTX) == 0) {
      say("warning: other users may write into the log directory '" + options_.log_dir +
          "' and rename what ddprun makes there; run: chmod go-w '" + options_.log_dir + "' (or chmod +t, as /tmp "
          "has), or give --log-dir a directory only you can write to (docs/security.md, \"Shared directories\")");
    }
  }
  IgnoreSigpipe ignore_sigpipe;  // a closed stdout must cost us output, not the job
  return run_session(options_);
}

}  // namespace ddprun
