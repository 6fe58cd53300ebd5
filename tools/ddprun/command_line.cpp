#include "command_line.h"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <sstream>

#include "std_spec.h"

namespace ddprun {
namespace {

// kOptionalValue: a switch that may take a value, either as "--flag=VALUE" or as the next word
// when that word is one the flag accepts (see takes_as_value()).
enum class FlagKind { kValue, kSwitch, kOptionalValue };

// How torchrun's argparse actions fill in a flag the command line leaves out.
enum class EnvDefault {
  kNone,  // no environment default: ddprun's own flags, and torchrun's --logs-specs, --numa-binding
  kPet,   // PET_<NAME>, '-' as '_', upper case (torchrun's `env` and `check_env` actions)
};

struct FlagSpec {
  const char* name;  // canonical spelling, without the leading "--"
  FlagKind kind;
  EnvDefault env_default;
  char short_name;  // torchrun's one-letter spelling ("-r"), or 0
};

// Every torchrun 2.11 flag, then ddprun's own. The order is the order they are applied in.
constexpr FlagSpec kFlags[] = {
    {"nnodes", FlagKind::kValue, EnvDefault::kPet, 0},
    {"nproc-per-node", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-backend", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-endpoint", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-id", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-conf", FlagKind::kValue, EnvDefault::kPet, 0},
    {"standalone", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"max-restarts", FlagKind::kValue, EnvDefault::kPet, 0},
    {"monitor-interval", FlagKind::kValue, EnvDefault::kPet, 0},
    {"start-method", FlagKind::kValue, EnvDefault::kPet, 0},
    {"event-log-handler", FlagKind::kValue, EnvDefault::kPet, 0},
    {"role", FlagKind::kValue, EnvDefault::kPet, 0},
    {"module", FlagKind::kSwitch, EnvDefault::kPet, 'm'},
    {"no-python", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"run-path", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"log-dir", FlagKind::kValue, EnvDefault::kPet, 0},
    {"redirects", FlagKind::kValue, EnvDefault::kPet, 'r'},
    {"tee", FlagKind::kOptionalValue, EnvDefault::kPet, 't'},
    {"local-ranks-filter", FlagKind::kValue, EnvDefault::kPet, 0},
    {"duplicate-stdout-filters", FlagKind::kValue, EnvDefault::kPet, 0},
    {"duplicate-stderr-filters", FlagKind::kValue, EnvDefault::kPet, 0},
    {"node-rank", FlagKind::kValue, EnvDefault::kPet, 0},
    {"master-addr", FlagKind::kValue, EnvDefault::kPet, 0},
    {"master-port", FlagKind::kValue, EnvDefault::kPet, 0},
    {"local-addr", FlagKind::kValue, EnvDefault::kPet, 0},
    {"logs-specs", FlagKind::kValue, EnvDefault::kNone, 0},
    {"numa-binding", FlagKind::kValue, EnvDefault::kNone, 0},
    {"signals-to-handle", FlagKind::kValue, EnvDefault::kPet, 0},
    {"virtual-local-rank", FlagKind::kSwitch, EnvDefault::kPet, 0},
    // ddprun's own.
    {"grace-period", FlagKind::kValue, EnvDefault::kNone, 0},
    {"no-prefix", FlagKind::kSwitch, EnvDefault::kNone, 0},
    {"run-id", FlagKind::kValue, EnvDefault::kNone, 0},  // --rdzv-id by another name
    {"rdzv-secret-file", FlagKind::kValue, EnvDefault::kNone, 0},
    {"cpu-bind", FlagKind::kValue, EnvDefault::kNone, 0},
    {"help", FlagKind::kSwitch, EnvDefault::kNone, 'h'},
};

std::string pet_name(const std::string& canonical_name) {
  std::string name = "PET_";
  for (char c : canonical_name) name += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

// torchrun's --tee takes a stream spec ("3", "0:1,1:3"); a bare --tee means both streams. Only
// words made of a spec's characters are taken from the next word, so "--tee PROGRAM" still
// starts PROGRAM.
constexpr const char* kTeeBare = "3";
bool takes_as_value(const std::string& canonical_name, const std::string& word) {
  return canonical_name == "tee" && !word.empty() && word.find_first_not_of("0123456789:,") == std::string::npos;
}

const FlagSpec* find_flag(const std::string& canonical_name) {
  for (const FlagSpec& flag : kFlags) {
    if (canonical_name == flag.name) return &flag;
  }
  return nullptr;
}

[[noreturn]] void bad_value(const std::string& flag, const std::string& value,
                            const std::string& expectation) {
  throw UsageError("invalid value '" + value + "' for " + flag + ": " + expectation);
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

// A flag's value and where it came from ("--nproc_per_node", "PET_NPROC_PER_NODE").
struct GivenValue {
  std::string label;
  std::string value;  // a switch: "1" on, "0" off
};

// torchrun's check_env reads a switch's PET_* as bool(int(value)).
bool parse_env_switch(const std::string& name, const std::string& value) {
  const size_t digits = value[0] == '+' || value[0] == '-' ? 1 : 0;
  if (value.size() == digits || value.find_first_not_of("0123456789", digits) != std::string::npos) {
    bad_value(name, value, "expected an integer, 0 for off and anything else for on (as torchrun reads it)");
  }
  return value.find_first_not_of("0", digits) != std::string::npos;
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

void apply_switch(LaunchOptions& options, const std::string& canonical, const std::string& label, bool on) {
  if (canonical == "standalone") options.standalone = on;
  if (canonical == "no-prefix") options.prefix_output = !on;
  if (canonical == "no-python") options.no_python = on;  // ddprun always starts PROGRAM itself
  if (canonical == "virtual-local-rank") options.virtual_local_rank = on;
  if (canonical == "module" && on) {
    throw UsageError(label + " runs PROGRAM as a Python module; ddprun starts PROGRAM itself: write "
                             "'ddprun [options] python3 -m MODULE [ARGS...]' instead");
  }
  if (canonical == "run-path" && on) {
    throw UsageError(label + " runs a script inside torchrun's own Python interpreter; ddprun starts PROGRAM "
                             "as a process of its own: write 'ddprun [options] python3 SCRIPT [ARGS...]' instead");
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

// Applies one flag's value; `label` names where the value came from, for error messages.
void apply_value(LaunchOptions& options, const std::string& canonical, const std::string& label,
                 const std::string& value) {
  if (canonical == "nproc-per-node") {
    options.nproc_per_node = parse_nproc(label, value);
  } else if (canonical == "nnodes") {
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
  } else if (canonical == "rdzv-backend") {
    if (value != "c10d" && value != "static") bad_value(label, value, "expected 'c10d' or 'static'");
    options.rdzv_backend = value;
  } else if (canonical == "rdzv-endpoint") {
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
    options.rdzv_endpoint = value;
  } else if (canonical == "rdzv-conf") {
    // KEY=VALUE[,KEY=VALUE...]; the keys torchrun's c10d backend knows, plus heartbeat_timeout.
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

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CommandLine result;
  LaunchOptions& options = result.options;
  // As with argparse, the last word for a flag wins; PET_* only fill in flags left out.
  std::map<std::string, GivenValue> given;
  size_t i = 0;
  while (i < args.size()) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM starts here

    const FlagSpec* flag = nullptr;
    std::string spelled;
    std::string value;
    bool has_value = false;
    if (arg[1] != '-') {
      // torchrun's one-letter spellings: "-r 3" or "-r3".
      for (const FlagSpec& candidate : kFlags) {
        if (candidate.short_name == arg[1]) flag = &candidate;
      }
      if (flag == nullptr) throw UsageError("unknown option '" + arg + "'");
      spelled = arg.substr(0, 2);
      has_value = arg.size() > 2;
      if (has_value) value = arg.substr(2);
    } else {
      // "--flag=value" or "--flag value"; torchrun accepts '_' and '-' interchangeably.
      const size_t equals = arg.find('=');
      spelled = arg.substr(0, equals);
      std::string canonical = spelled.substr(2);
      for (char& c : canonical) {
        if (c == '_') c = '-';
      }
      flag = find_flag(canonical);
      if (flag == nullptr) throw UsageError("unknown option '" + spelled + "'");
      has_value = equals != std::string::npos;
      if (has_value) value = arg.substr(equals + 1);
    }
    const std::string canonical = flag->name;
    ++i;

    if (flag->kind == FlagKind::kSwitch) {
      if (has_value) throw UsageError("option " + spelled + " takes no value, got '" + arg + "'");
      if (canonical == "help") {
        result.show_help = true;
        return result;
      }
      value = "1";
    } else if (!has_value && flag->kind == FlagKind::kOptionalValue) {
      value = i < args.size() && takes_as_value(canonical, args[i]) ? args[i++] : kTeeBare;
    } else if (!has_value) {
      // A following "--something" is the next option, not this one's value.
      if (i >= args.size() || args[i].compare(0, 2, "--") == 0) {
        throw UsageError("option " + spelled + " needs a value");
      }
      value = args[i++];
    }
    given[canonical == "run-id" ? "rdzv-id" : canonical] = GivenValue{spelled, value};
  }

  for (const FlagSpec& flag : kFlags) {
    if (flag.env_default != EnvDefault::kPet || given.count(flag.name) != 0) continue;
    const std::string name = pet_name(flag.name);
    const char* text = std::getenv(name.c_str());
    // Empty counts as unset: a pod template that blanks a variable means "no value".
    if (text == nullptr || *text == '\0') continue;
    std::string value = text;
    if (flag.kind == FlagKind::kSwitch) value = parse_env_switch(name, value) ? "1" : "0";
    given[flag.name] = GivenValue{name, value};
  }

  for (const FlagSpec& flag : kFlags) {
    const auto entry = given.find(flag.name);
    if (entry == given.end()) continue;
    const GivenValue& source = entry->second;
    if (flag.kind == FlagKind::kSwitch) {
      apply_switch(options, flag.name, source.label, source.value == "1");
    } else {
      apply_value(options, flag.name, source.label, source.value);
    }
  }

  if (options.rdzv_backend == "static" && !options.rdzv_endpoint.empty()) {
    // As torchrun: with the static backend the endpoint is the master's address and port.
    const size_t colon = options.rdzv_endpoint.rfind(':');
    options.master_addr = options.rdzv_endpoint.substr(0, colon);
    if (colon != std::string::npos) options.master_port = std::atoi(options.rdzv_endpoint.c_str() + colon + 1);
  }
  options.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  try {
    validate(options);
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  return result;
}

std::string usage_text() {
  const LaunchOptions defaults;
  std::ostringstream text;
  text << "Usage: ddprun [options] PROGRAM [ARGS...]\n"
       << "\n"
       << "Starts PROGRAM once per local rank with the environment torchrun gives its workers\n"
       << "(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, "
          "ROLE_WORLD_SIZE,\n"
       << "MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), forwards their output line by line and\n"
       << "stops every worker as soon as one of them fails; with --max-restarts it then starts\n"
       << "them all again.\n"
       << "\n"
       << "Options (write '_' or '-' inside names; give values as '--flag VALUE' or "
          "'--flag=VALUE'):\n"
       << "  --nproc-per-node N   workers on this node: a number, 'cpu' (one per online CPU), "
          "'gpu'\n"
       << "                       (one per visible GPU) or 'auto' (one per GPU, else one per CPU)\n"
       << "                       (default: " << defaults.nproc_per_node << ")\n"
       << "  --nnodes N           number of nodes in the job (default: " << defaults.nnodes << ")\n"
       << "                       With --rdzv-backend c10d also MIN:MAX: rounds form with MIN to MAX\n"
       << "                       nodes, and a node may join or leave between rounds\n"
       << "  --node-rank I        rank of this node, 0 <= I < nnodes; static mode only, c10d assigns\n"
       << "                       node ranks (default: "
       << defaults.node_rank << ")\n"
       << "  --master-addr ADDR   address of the node running rank 0 (default: "
       << defaults.master_addr << ")\n"
       << "  --master-port PORT   port of the rendezvous store on the master, 1..65535 (default: "
       << defaults.master_port << ")\n"
       << "  --standalone         single-node job on a free port of 127.0.0.1; overrides\n"
       << "                       --master-addr and --master-port (default: off)\n"
       << "  --grace-period SEC   seconds between SIGTERM and SIGKILL when stopping workers\n"
       << "                       (default: " << defaults.grace_period_seconds << ")\n"
       << "  --no-prefix          do not prefix output lines with '[rankR]: ' (default: prefix)\n"
       << "  --max-restarts K     when a worker fails, stop all workers and start them again, at\n"
       << "                       most K times; workers see TORCHELASTIC_RESTART_COUNT (0 on the\n"
       << "                       first attempt) and TORCHELASTIC_MAX_RESTARTS=K (default: "
       << defaults.max_restarts << ")\n"
       << "  --log-dir DIR        write each worker's stdout and stderr, unprefixed, to\n"
       << "                       DIR/attempt_A/rank_R.log (A: restart count, R: global rank)\n"
       << "                       instead of the console (default: none, output goes to the "
          "console)\n"
       << "  --tee [SPEC], -t    streams to log and show on the console too: 0 none, 1 stdout,\n"
       << "                       2 stderr, 3 both, or per local rank 'R:N,R:N'; a bare --tee is 3\n"
       << "                       (default: off)\n"
       << "  --redirects SPEC, -r streams to log instead of the console, SPEC as for --tee\n"
       << "                       (default: " << defaults.redirects << ", none)\n"
       << "  --local-ranks-filter L  only these local ranks ('0,2') reach the console; log files\n"
       << "                       get every rank (default: none, every rank)\n"
       << "  --duplicate-stdout-filters F,...  teed stdout lines containing any F also go to a\n"
       << "                       filtered log; ',,' is a comma inside F (default: none)\n"
       << "  --duplicate-stderr-filters F,...  the same for stderr (default: none)\n"
       << "  --rdzv-id ID         job id, given to workers as TORCHELASTIC_RUN_ID and DDP_RUN_ID;\n"
       << "                       --run-id is the same flag; with --standalone a fresh UUID, as\n"
       << "                       torchrun's (default: " << defaults.run_id << ")\n"
       << "  --rdzv-backend B     'static': --master-addr and --node-rank by hand on every node;\n"
       << "                       'c10d': the agents (one ddprun per node) meet in a store at\n"
       << "                       --rdzv-endpoint, hosted by the ddprun on the endpoint's host (the\n"
       << "                       first there to bind it); it assigns node ranks, each attempt's\n"
       << "                       MASTER_ADDR/MASTER_PORT, and keeps one restart budget for the job\n"
       << "                       (default: " << defaults.rdzv_backend << ")\n"
       << "  --rdzv-endpoint H[:P] the store's address; it binds H only, never every interface;\n"
       << "                       with 'static', the master's address and port, as in torchrun\n"
       << "                       (default: none; port 29400 when omitted)\n"
       << "  --rdzv-conf K=V,...  join_timeout: seconds for MIN nodes to join the first round\n"
       << "                       (default: " << defaults.join_timeout_seconds << "); last_call_timeout: once MIN joined, "
          "seconds\n"
       << "                       to wait for more, up to MAX (default: " << defaults.last_call_timeout_seconds
       << "); heartbeat_timeout:\n"
       << "                       an agent silent this long is declared lost (default: "
       << defaults.heartbeat_timeout_seconds << ")\n"
       << "  --rdzv-secret-file F with c10d: a file (mode 600) holding the job's secret, the same on\n"
       << "                       every node; agents prove they know it before the store hears them\n"
       << "                       (default: $DDP_RDZV_SECRET_FILE, else none: the store is open to\n"
       << "                       anyone who reaches its port, as torchrun's is)\n"
       << "  --local-addr ADDR    the address other nodes reach this node at, and the workers'\n"
       << "                       MASTER_ADDR when it is node 0 (default: none, the address this node\n"
       << "                       reaches the store from)\n"
       << "  --monitor-interval S seconds between an agent's heartbeats to the store, at least "
       << kMinMonitorIntervalSeconds << "\n"
       << "                       (default: " << defaults.monitor_interval_seconds << ")\n"
       << "  --role NAME          the workers' ROLE_NAME (default: " << defaults.role << ")\n"
       << "  --signals-to-handle S,...  signals ddprun forwards to every worker's process group and\n"
       << "                       then ends the job on, SIGKILL following after --grace-period;\n"
       << "                       SIGUSR2, SIGALRM, SIGXCPU may be added; workers see the list as\n"
       << "                       TORCHELASTIC_SIGNALS_TO_HANDLE (default: " << defaults.signals_to_handle << ")\n"
       << "  --virtual-local-rank every worker gets LOCAL_RANK 0 and CUDA_VISIBLE_DEVICES narrowed to\n"
       << "                       its own device: the local-rank-th entry of ddprun's, else the\n"
       << "                       local rank (default: off)\n"
       << "  --numa-binding MODE  node, socket, exclusive or core-complex: bind each local rank to\n"
       << "                       the CPUs near its GPU (default: none)\n"
       << "  --cpu-bind MODE      ddprun's own: 'cores' pins each local rank to its share of\n"
       << "                       ddprun's CPUs, 'none' does not (default: none)\n"
       << "  --no-python          accepted; ddprun always starts PROGRAM itself (default: off)\n"
       << "  --start-method M     spawn, fork or forkserver: accepted; torchrun too ignores it for\n"
       << "                       a program, which always starts afresh (default: " << defaults.start_method << ")\n"
       << "  --event-log-handler H  'null' or 'dynamic_rendezvous': ddprun records no torchelastic\n"
       << "                       events; 'console' is refused (default: " << defaults.event_log_handler << ")\n"
       << "  --logs-specs NAME    only 'default', torchrun's own layout; other names are Python\n"
       << "                       plugins and are refused (default: " << defaults.logs_specs << ")\n"
       << "  --module, -m         refused: it makes torchrun run 'python -m PROGRAM'; write\n"
       << "                       'ddprun python3 -m MODULE' (default: off)\n"
       << "  --run-path           refused: it runs a script in torchrun's own interpreter; write\n"
       << "                       'ddprun python3 SCRIPT' (default: off)\n"
       << "  -h, --help           print this help and exit\n"
       << "  --                   end of options; the next word is PROGRAM\n"
       << "\n"
       << "A torchrun flag left out takes its value from PET_<FLAG> (PET_NPROC_PER_NODE,\n"
       << "PET_STANDALONE=1, ...), as torchrun's does; the command line wins, and an empty PET_*\n"
       << "counts as unset. --logs-specs, --numa-binding and ddprun's own flags have none.\n"
       << "\n"
       << "Everything from PROGRAM on is passed to PROGRAM untouched. If OMP_NUM_THREADS is unset\n"
       << "and there is more than one worker, workers get OMP_NUM_THREADS=1.\n"
       << "\n"
       << "With --rdzv-backend c10d: when a worker on any node fails, every node stops its workers\n"
       << "and all start the next attempt together; --max-restarts counts for the whole job, and\n"
       << "the root cause names the first failure across all nodes (node, rank, host). A node whose\n"
       << "ddprun stops answering is declared lost within heartbeat_timeout + --monitor-interval\n"
       << "(5.5 s by default) and named; the others go on without it if MIN nodes remain, else\n"
       << "every ddprun exits 1. A node joining a job of fewer than MAX nodes enters at the next\n"
       << "attempt. Restarts after a change of membership do not count against --max-restarts.\n"
       << "Workers also get DDPRUN_ATTEMPT (rounds so far, membership changes included).\n"
       << "\n"
       << "SIGUSR1 is forwarded to every running worker (not to their children) and stops\n"
       << "nothing, whether --signals-to-handle lists it or not; use it for stack dumps. A worker\n"
       << "that does not handle SIGUSR1 dies of it.\n"
       << "\n"
       << "Exit status: 0 if all workers of an attempt exit 0, 1 if a worker fails with no\n"
       << "restart left (a root-cause summary goes to stderr), 128+N if ddprun receives signal N\n"
       << "(the --signals-to-handle are forwarded to the workers and never cause a restart),\n"
       << "2 for bad usage.\n";
  return text.str();
}

}  // namespace ddprun
