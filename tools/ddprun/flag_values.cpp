#include "flag_values.h"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "posix_util.h"
#include "std_spec.h"

namespace ddprun {
namespace {

[[noreturn]] void bad_value(const std::string& flag, const std::string& value,
                            const std::string& expectation) {
  throw UsageError("invalid value '" + printable(value) + "' for " + flag + ": " + expectation);
}

// Parses a whole string as a decimal integer in [min_value, max_value]: digits only, so that
// strtol's leniency (" 2", "+2") does not pass for a number.
int parse_int(const std::string& flag, const std::string& value, long min_value, long max_value,
              const std::string& expectation) {
  if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos) {
    bad_value(flag, value, expectation);
  }
  errno = 0;
  char* end = nullptr;
  long parsed = std::strtol(value.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || parsed < min_value || parsed > max_value) {
    bad_value(flag, value, expectation);
  }
  return static_cast<int>(parsed);
}

int parse_nproc(const std::string& flag, const std::string& value) {
  const std::string expectation = "expected a positive integer, 'cpu', 'gpu' or 'auto'";
  if (value == "cpu") return count_online_cpus();
  if (value == "gpu") {
    int gpus = count_visible_gpus();
    if (gpus == 0)
      bad_value(flag, value, "no GPU is visible on this machine; use a number or 'cpu'");
    return gpus;
  }
  if (value == "auto") {
    // torchrun's 'auto': one worker per GPU when there are GPUs, else one per CPU.
    int gpus = count_visible_gpus();
    return gpus > 0 ? gpus : count_online_cpus();
  }
  return parse_int(flag, value, 1, std::numeric_limits<int>::max(), expectation);
}

double parse_seconds(const std::string& flag, const std::string& value) {
  const std::string expectation = "expected a number of seconds >= 0";
  // A plain decimal number ("0.5", "1e-3"): strtod would also take " 1", "0x10" and "inf".
  const bool starts_like_a_number = !value.empty() && (std::isdigit(static_cast<unsigned char>(value[0])) || value[0] == '.');
  if (!starts_like_a_number || value.find_first_not_of("0123456789.eE+-") != std::string::npos ||
      value.find_first_of("0123456789") == std::string::npos) {
    bad_value(flag, value, expectation);
  }
  errno = 0;
  char* end = nullptr;
  double parsed = std::strtod(value.c_str(), &end);
  // The upper bound keeps the deadline arithmetic far away from overflow.
  if (errno != 0 || *end != '\0' || !std::isfinite(parsed) || parsed < 0 || parsed > 1e7) {
    bad_value(flag, value, expectation);
  }
  return parsed;
}

// The signals --signals-to-handle may name: those a launcher can catch and pass on.
std::vector<int> parse_signal_list(const std::string& label, const std::string& value) {
  static const std::pair<const char*, int> kForwardable[] = {
      {"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},   {"SIGQUIT", SIGQUIT},
      {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGALRM", SIGALRM}, {"SIGXCPU", SIGXCPU},
  };
  std::vector<int> signals;
  std::stringstream entries(value);
  for (std::string entry; std::getline(entries, entry, ',');) {
    // torchrun strips each name.
    const size_t first = entry.find_first_not_of(" \t");
    entry = first == std::string::npos ? "" : entry.substr(first, entry.find_last_not_of(" \t") - first + 1);
    if (entry.empty()) continue;
    int number = 0;
    for (const auto& [name, signal_number] : kForwardable) {
      if (entry == name) number = signal_number;
    }
    if (entry == "SIGKILL" || entry == "SIGSTOP") bad_value(label, value, entry + " cannot be caught");
    if (entry == "SIGCHLD") bad_value(label, value, "ddprun watches its workers through SIGCHLD; it is not forwarded");
    if (number == 0) {
      bad_value(label, value,
                "unknown signal '" + entry + "' (expected names among SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2,"
                "SIGALRM,SIGXCPU)");
    }
    if (std::find(signals.begin(), signals.end(), number) == signals.end()) signals.push_back(number);
  }
  return signals;
}

// torchrun's comma_separated_list: ",," is a comma inside an item.
std::vector<std::string> comma_separated_list(const std::string& value) {
  std::vector<std::string> items(1);
  for (size_t at = 0; at < value.size(); ++at) {
    if (value[at] != ',') {
      items.back() += value[at];
    } else if (at + 1 < value.size() && value[at + 1] == ',') {
      items.back() += ',';
      ++at;
    } else {
      items.emplace_back();
    }
  }
  return items;
}

// N, or MIN:MAX for an elastic c10d job (nnodes holds MAX).
void apply_nnodes(LaunchOptions& options, const std::string& label, const std::string& value) {
  const std::string expectation = "expected a positive integer N or MIN:MAX";
  const size_t colon = value.find(':');
  if (colon == std::string::npos) {
    options.nnodes = parse_int(label, value, 1, std::numeric_limits<int>::max(), expectation);
    options.min_nodes = options.nnodes;
  } else {
    try {
      options.min_nodes =
          parse_int(label, value.substr(0, colon), 1, std::numeric_limits<int>::max(), expectation);
      options.nnodes =
          parse_int(label, value.substr(colon + 1), 1, std::numeric_limits<int>::max(), expectation);
    } catch (const UsageError&) {
      bad_value(label, value, expectation);
    }
    if (options.min_nodes > options.nnodes) bad_value(label, value, "MIN must not exceed MAX");
  }
}

void check_rdzv_endpoint(const std::string& label, const std::string& value) {
  const size_t colon = value.rfind(':');
  const std::string host = colon == std::string::npos ? value : value.substr(0, colon);
  if (host.empty()) bad_value(label, value, "expected HOST or HOST:PORT");
  if (colon != std::string::npos) {
    try {
      parse_int(label, value.substr(colon + 1), 1, 65535, "");
    } catch (const UsageError&) {
      bad_value(label, value, "expected HOST or HOST:PORT, PORT in 1..65535");
    }
  }
}

// KEY=VALUE[,KEY=VALUE...]; the keys torchrun's c10d backend knows, plus heartbeat_timeout.
void apply_rdzv_conf(LaunchOptions& options, const std::string& label, const std::string& value) {
  std::stringstream entries(value);
  for (std::string entry; std::getline(entries, entry, ',');) {
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) bad_value(label, value, "expected KEY=VALUE[,KEY=VALUE...]");
    const std::string key = entry.substr(0, eq);
    const std::string number = entry.substr(eq + 1);
    const std::string key_label = label + " " + key;
    if (key == "join_timeout") {
      options.join_timeout_seconds = parse_seconds(key_label, number);
    } else if (key == "last_call_timeout") {
      options.last_call_timeout_seconds = parse_seconds(key_label, number);
    } else if (key == "heartbeat_timeout") {
      options.heartbeat_timeout_seconds = parse_seconds(key_label, number);
    } else if (key == "read_timeout" || key == "timeout" || key == "is_host" || key == "close_timeout") {
      // torchrun's other keys: accepted so torchrun command lines keep working; every socket
      // operation here has its own deadline.
    } else {
      bad_value(label, value,
                "unknown key '" + key + "' (known: join_timeout, last_call_timeout, heartbeat_timeout)");
    }
  }
}

// The torchrun flags that ddprun had no counterpart for before torchrun 2.11's whole surface.
void apply_torchrun_value(LaunchOptions& options, const std::string& canonical, const std::string& label,
                          const std::string& value) {
  if (canonical == "role") {
    if (value.empty()) bad_value(label, value, "expected a non-empty role name");
    options.role = value;
  } else if (canonical == "start-method") {
    // torchrun itself ignores it for a program (--no-python): a program is always a fresh process.
    if (value != "spawn" && value != "fork" && value != "forkserver") {
      bad_value(label, value, "expected 'spawn', 'fork' or 'forkserver'");
    }
    options.start_method = value;
  } else if (canonical == "event-log-handler") {
    if (value != "null" && value != "dynamic_rendezvous") {
      bad_value(label, value,
                "ddprun records no torchelastic events (its own messages go to stderr); expected 'null' or "
                "'dynamic_rendezvous', torchrun's handlers that discard them");
    }
    options.event_log_handler = value;
  } else if (canonical == "logs-specs") {
    if (value != "default") {
      bad_value(label, value,
                "a LogsSpecs class is a Python entry point; ddprun has torchrun's 'default' layout only "
                "(see --log-dir)");
    }
    options.logs_specs = value;
  } else if (canonical == "local-ranks-filter") {
    try {
      parse_local_ranks(value);
    } catch (const std::invalid_argument& error) {
      bad_value(label, value, error.what());
    }
    options.local_ranks_filter = value;
  } else if (canonical == "duplicate-stdout-filters") {
    options.duplicate_stdout_filters = comma_separated_list(value);
  } else if (canonical == "duplicate-stderr-filters") {
    options.duplicate_stderr_filters = comma_separated_list(value);
  } else if (canonical == "numa-binding") {
    if (value != "node" && value != "socket" && value != "exclusive" && value != "core-complex") {
      bad_value(label, value, "expected 'node', 'socket', 'exclusive' or 'core-complex'");
    }
    options.numa_binding = value;
  } else if (canonical == "cpu-bind") {
    if (value != "none" && value != "cores") bad_value(label, value, "expected 'none' or 'cores'");
    options.cpu_bind = value == "none" ? "" : value;
  } else if (canonical == "signals-to-handle") {
    options.handled_signals = parse_signal_list(label, value);
    options.signals_to_handle = value;
  }
}

}  // namespace

bool parse_env_switch(const std::string& name, const std::string& value) {
  const size_t digits = value[0] == '+' || value[0] == '-' ? 1 : 0;
  if (value.size() == digits || value.find_first_not_of("0123456789", digits) != std::string::npos) {
    bad_value(name, value, "expected an integer, 0 for off and anything else for on (as torchrun reads it)");
  }
  return value.find_first_not_of("0", digits) != std::string::npos;
}

void apply_switch(LaunchOptions& options, const std::string& canonical, const std::string& label, bool on) {
  if (canonical == "standalone") options.standalone = on;
  if (canonical == "no-prefix") options.prefix_output = !on;
  if (canonical == "no-python") options.no_python = on;  // ddprun always starts PROGRAM itself
  if (canonical == "virtual-local-rank") options.virtual_local_rank = on;
  if (canonical == "fault-tolerance") options.fault_tolerance = on;
  if (canonical == "module" && on) {
    throw UsageError(label + " runs PROGRAM as a Python module; ddprun starts PROGRAM itself: write "
                             "'ddprun [options] python3 -m MODULE [ARGS...]' instead");
  }
  if (canonical == "run-path" && on) {
    throw UsageError(label + " runs a script inside torchrun's own Python interpreter; ddprun starts PROGRAM "
                             "as a process of its own: write 'ddprun [options] python3 SCRIPT [ARGS...]' instead");
  }
}

void apply_value(LaunchOptions& options, const std::string& canonical, const std::string& label,
                 const std::string& value) {
  // ddprun quotes flag values on the console and in logs (a role prefixes every teed line); a
  // newline or an escape sequence there could forge lines that seem to come from a worker or
  // from ddprun, and no flag's meaning needs one.
  if (has_control_character(value)) {
    bad_value(label, value, "control characters (newlines, tabs, escape sequences) are not allowed in flag values");
  }
  if (canonical == "nproc-per-node") {
    options.nproc_per_node = parse_nproc(label, value);
  } else if (canonical == "nnodes") {
    apply_nnodes(options, label, value);
  } else if (canonical == "rdzv-backend") {
    if (value != "c10d" && value != "static" && value != "etcd-v2") {
      bad_value(label, value, "expected 'c10d', 'etcd-v2' or 'static'");
    }
    options.rdzv_backend = value;
  } else if (canonical == "rdzv-endpoint") {
    if (options.rdzv_backend == "etcd-v2") {
      // The cluster's members, any of which may be down.
      std::stringstream members(value);
      for (std::string member; std::getline(members, member, ',');) {
        if (member.rfind(':') == std::string::npos) bad_value(label, value, "expected HOST:PORT[,HOST:PORT...]");
        check_rdzv_endpoint(label, member);
      }
    } else {
      check_rdzv_endpoint(label, value);
    }
    options.rdzv_endpoint = value;
  } else if (canonical == "ft-deadline") {
    options.ft_deadline_seconds = parse_seconds(label, value);
    if (!(options.ft_deadline_seconds > 0)) bad_value(label, value, "expected a number of seconds > 0");
  } else if (canonical == "ft-replica-size") {
    options.ft_replica_size = parse_int(label, value, 1, std::numeric_limits<int>::max(),
                                        "expected a positive integer, the workers in one replica group");
  } else if (canonical == "ft-store-port") {
    options.ft_store_port = parse_int(label, value, 1, 65535, "expected a port in 1..65535");
  } else if (canonical == "rdzv-conf") {
    apply_rdzv_conf(options, label, value);
  } else if (canonical == "rdzv-secret-file") {
    if (value.empty()) bad_value(label, value, "expected a file holding the job's secret");
    options.rdzv_secret_file = value;
  } else if (canonical == "local-addr") {
    if (value.empty()) bad_value(label, value, "expected a host name or IP address");
    options.local_addr = value;
  } else if (canonical == "monitor-interval") {
    options.monitor_interval_seconds = parse_seconds(label, value);
    if (options.monitor_interval_seconds < kMinMonitorIntervalSeconds) {
      bad_value(label, value,
                "expected a number of seconds >= 0.01 (polling the store more often only burns CPU)");
    }
  } else if (canonical == "node-rank") {
    options.node_rank_given = true;
    options.node_rank =
        parse_int(label, value, 0, std::numeric_limits<int>::max(), "expected an integer >= 0");
  } else if (canonical == "master-addr") {
    if (value.empty()) bad_value(label, value, "expected a host name or IP address");
    options.master_addr = value;
  } else if (canonical == "master-port") {
    options.master_port = parse_int(label, value, 1, 65535, "expected a port in 1..65535");
  } else if (canonical == "grace-period") {
    options.grace_period_seconds = parse_seconds(label, value);
  } else if (canonical == "max-restarts") {
    options.max_restarts =
        parse_int(label, value, 0, std::numeric_limits<int>::max(), "expected an integer >= 0");
  } else if (canonical == "log-dir") {
    if (value.empty()) bad_value(label, value, "expected a directory");
    options.log_dir = value;
  } else if (canonical == "tee" || canonical == "redirects") {
    try {
      check_std_spec(value);
    } catch (const std::invalid_argument& error) {
      bad_value(label, value, error.what());
    }
    if (canonical == "redirects") {
      options.redirects = value;
    } else {
      options.tee_spec = value;
      // One value for every rank also drives the whole-job --tee of --log-dir.
      if (value.size() == 1) options.tee = value[0] - '0';
    }
  } else if (canonical == "rdzv-id") {
    if (value.empty()) bad_value(label, value, "expected a non-empty id");
    options.run_id = value;
    options.run_id_given = true;
  } else {
    apply_torchrun_value(options, canonical, label, value);
  }
}

}  // namespace ddprun
