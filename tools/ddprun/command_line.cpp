#include "command_line.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

namespace ddprun {
namespace {

// kOptionalValue: a switch that may take a value, either as "--flag=VALUE" or as the next word
// when that word is one the flag accepts (see takes_as_value()).
enum class FlagKind { kValue, kSwitch, kOptionalValue };

struct FlagSpec {
  const char* name;  // canonical spelling, without the leading "--"
  FlagKind kind;
};

constexpr FlagSpec kFlags[] = {
    {"nproc-per-node", FlagKind::kValue}, {"nnodes", FlagKind::kValue},
    {"node-rank", FlagKind::kValue},      {"master-addr", FlagKind::kValue},
    {"master-port", FlagKind::kValue},    {"grace-period", FlagKind::kValue},
    {"standalone", FlagKind::kSwitch},    {"no-prefix", FlagKind::kSwitch},
    {"max-restarts", FlagKind::kValue},   {"log-dir", FlagKind::kValue},
    {"tee", FlagKind::kOptionalValue},    {"rdzv-id", FlagKind::kValue},
    {"run-id", FlagKind::kValue},         {"help", FlagKind::kSwitch},
    {"rdzv-backend", FlagKind::kValue},   {"rdzv-endpoint", FlagKind::kValue},
    {"rdzv-conf", FlagKind::kValue},      {"local-addr", FlagKind::kValue},
    {"monitor-interval", FlagKind::kValue},
};

// torchrun's --tee takes 0..3; a bare --tee means both streams. Only those digits are taken
// from the next word, so "--tee PROGRAM" still starts PROGRAM.
constexpr const char* kTeeBare = "3";
bool takes_as_value(const std::string& canonical_name, const std::string& word) {
  return canonical_name == "tee" && word.size() == 1 && word[0] >= '0' && word[0] <= '3';
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

// Parses a whole string as a decimal integer in [min_value, max_value].
int parse_int(const std::string& flag, const std::string& value, long min_value, long max_value,
              const std::string& expectation) {
  if (value.empty()) bad_value(flag, value, expectation);
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
  if (value.empty()) bad_value(flag, value, expectation);
  errno = 0;
  char* end = nullptr;
  double parsed = std::strtod(value.c_str(), &end);
  // The upper bound keeps the deadline arithmetic far away from overflow.
  if (errno != 0 || *end != '\0' || !std::isfinite(parsed) || parsed < 0 || parsed > 1e7) {
    bad_value(flag, value, expectation);
  }
  return parsed;
}

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CommandLine result;
  LaunchOptions& options = result.options;
  size_t i = 0;
  while (i < args.size()) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h") {
      result.show_help = true;
      return result;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM starts here
    if (arg.compare(0, 2, "--") != 0) throw UsageError("unknown option '" + arg + "'");

    // "--flag=value" or "--flag value"; torchrun accepts '_' and '-' interchangeably.
    size_t equals = arg.find('=');
    std::string spelled = arg.substr(0, equals);
    std::string canonical = spelled.substr(2);
    for (char& c : canonical) {
      if (c == '_') c = '-';
    }
    const FlagSpec* flag = find_flag(canonical);
    if (flag == nullptr) throw UsageError("unknown option '" + spelled + "'");
    ++i;

    if (flag->kind == FlagKind::kSwitch) {
      if (equals != std::string::npos) {
        throw UsageError("option " + spelled + " takes no value, got '" + arg + "'");
      }
      if (canonical == "help") {
        result.show_help = true;
        return result;
      }
      if (canonical == "standalone") options.standalone = true;
      if (canonical == "no-prefix") options.prefix_output = false;
      continue;
    }

    std::string value;
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (flag->kind == FlagKind::kOptionalValue) {
      value = i < args.size() && takes_as_value(canonical, args[i]) ? args[i++] : kTeeBare;
    } else {
      // A following "--something" is the next option, not this one's value.
      if (i >= args.size() || args[i].compare(0, 2, "--") == 0) {
        throw UsageError("option " + spelled + " needs a value");
      }
      value = args[i++];
    }

    if (canonical == "nproc-per-node") {
      options.nproc_per_node = parse_nproc(spelled, value);
    } else if (canonical == "nnodes") {
      const std::string expectation = "expected a positive integer N or MIN:MAX";
      const size_t colon = value.find(':');
      if (colon == std::string::npos) {
        options.nnodes = parse_int(spelled, value, 1, std::numeric_limits<int>::max(), expectation);
        options.min_nodes = options.nnodes;
      } else {
        try {
          options.min_nodes =
              parse_int(spelled, value.substr(0, colon), 1, std::numeric_limits<int>::max(), expectation);
          options.nnodes =
              parse_int(spelled, value.substr(colon + 1), 1, std::numeric_limits<int>::max(), expectation);
        } catch (const UsageError&) {
          bad_value(spelled, value, expectation);
        }
        if (options.min_nodes > options.nnodes) bad_value(spelled, value, "MIN must not exceed MAX");
      }
    } else if (canonical == "rdzv-backend") {
      if (value != "c10d" && value != "static") bad_value(spelled, value, "expected 'c10d' or 'static'");
      options.rdzv_backend = value;
    } else if (canonical == "rdzv-endpoint") {
      const size_t colon = value.rfind(':');
      const std::string host = colon == std::string::npos ? value : value.substr(0, colon);
      if (host.empty()) bad_value(spelled, value, "expected HOST or HOST:PORT");
      if (colon != std::string::npos) {
        try {
          parse_int(spelled, value.substr(colon + 1), 1, 65535, "");
        } catch (const UsageError&) {
          bad_value(spelled, value, "expected HOST or HOST:PORT, PORT in 1..65535");
        }
      }
      options.rdzv_endpoint = value;
    } else if (canonical == "rdzv-conf") {
      // KEY=VALUE[,KEY=VALUE...]; the keys torchrun's c10d backend knows, plus heartbeat_timeout.
      std::stringstream entries(value);
      for (std::string entry; std::getline(entries, entry, ',');) {
        if (entry.empty()) continue;
        const size_t eq = entry.find('=');
        if (eq == std::string::npos) bad_value(spelled, value, "expected KEY=VALUE[,KEY=VALUE...]");
        const std::string key = entry.substr(0, eq);
        const std::string number = entry.substr(eq + 1);
        const std::string label = spelled + " " + key;
        if (key == "join_timeout") {
          options.join_timeout_seconds = parse_seconds(label, number);
        } else if (key == "last_call_timeout") {
          options.last_call_timeout_seconds = parse_seconds(label, number);
        } else if (key == "heartbeat_timeout") {
          options.heartbeat_timeout_seconds = parse_seconds(label, number);
        } else if (key == "read_timeout" || key == "timeout" || key == "is_host" || key == "close_timeout") {
          // torchrun's other keys: accepted so torchrun command lines keep working; every socket
          // operation here has its own deadline.
        } else {
          bad_value(spelled, value,
                    "unknown key '" + key + "' (known: join_timeout, last_call_timeout, heartbeat_timeout)");
        }
      }
    } else if (canonical == "local-addr") {
      if (value.empty()) bad_value(spelled, value, "expected a host name or IP address");
      options.local_addr = value;
    } else if (canonical == "monitor-interval") {
      options.monitor_interval_seconds = parse_seconds(spelled, value);
      if (options.monitor_interval_seconds <= 0) bad_value(spelled, value, "expected a number of seconds > 0");
    } else if (canonical == "node-rank") {
      options.node_rank_given = true;
      options.node_rank =
          parse_int(spelled, value, 0, std::numeric_limits<int>::max(), "expected an integer >= 0");
    } else if (canonical == "master-addr") {
      if (value.empty()) bad_value(spelled, value, "expected a host name or IP address");
      options.master_addr = value;
    } else if (canonical == "master-port") {
      options.master_port = parse_int(spelled, value, 1, 65535, "expected a port in 1..65535");
    } else if (canonical == "grace-period") {
      options.grace_period_seconds = parse_seconds(spelled, value);
    } else if (canonical == "max-restarts") {
      options.max_restarts =
          parse_int(spelled, value, 0, std::numeric_limits<int>::max(), "expected an integer >= 0");
    } else if (canonical == "log-dir") {
      if (value.empty()) bad_value(spelled, value, "expected a directory");
      options.log_dir = value;
    } else if (canonical == "tee") {
      options.tee = parse_int(spelled, value, 0, kTeeStdout | kTeeStderr,
                              "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)");
    } else if (canonical == "rdzv-id" || canonical == "run-id") {
      if (value.empty()) bad_value(spelled, value, "expected a non-empty id");
      options.run_id = value;
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
       << "  --tee [N]            with --log-dir, show the workers' output on the console too;\n"
       << "                       N as in torchrun: 1 stdout, 2 stderr, 3 both; a bare --tee "
          "is 3\n"
       << "                       (default: off)\n"
       << "  --rdzv-id ID         job id, given to workers as TORCHELASTIC_RUN_ID and DDP_RUN_ID;\n"
       << "                       --run-id is the same flag (default: " << defaults.run_id << ")\n"
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
       << "  --local-addr ADDR    the address other nodes reach this node at, and the workers'\n"
       << "                       MASTER_ADDR when it is node 0 (default: none, the address this node\n"
       << "                       reaches the store from)\n"
       << "  --monitor-interval S seconds between an agent's heartbeats to the store (default: "
       << defaults.monitor_interval_seconds << ")\n"
       << "  -h, --help           print this help and exit\n"
       << "  --                   end of options; the next word is PROGRAM\n"
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
       << "nothing; use it for stack dumps. A worker that does not handle SIGUSR1 dies of it.\n"
       << "\n"
       << "Exit status: 0 if all workers of an attempt exit 0, 1 if a worker fails with no\n"
       << "restart left (a root-cause summary goes to stderr), 128+N if ddprun receives signal N\n"
       << "(SIGINT, SIGTERM and SIGHUP are forwarded to the workers and never cause a restart),\n"
       << "2 for bad usage.\n";
  return text.str();
}

}  // namespace ddprun
