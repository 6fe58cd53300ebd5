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
      options.nnodes = parse_int(spelled, value, 1, std::numeric_limits<int>::max(),
                                 "expected a positive integer");
    } else if (canonical == "node-rank") {
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
       << "  --node-rank I        rank of this node, 0 <= I < nnodes (default: "
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
       << "  -h, --help           print this help and exit\n"
       << "  --                   end of options; the next word is PROGRAM\n"
       << "\n"
       << "Everything from PROGRAM on is passed to PROGRAM untouched. If OMP_NUM_THREADS is unset\n"
       << "and there is more than one worker, workers get OMP_NUM_THREADS=1.\n"
       << "\n"
       << "Exit status: 0 if all workers of an attempt exit 0, 1 if a worker fails with no\n"
       << "restart left (a root-cause summary goes to stderr), 128+N if ddprun receives signal N\n"
       << "(SIGINT, SIGTERM and SIGHUP are forwarded to the workers and never cause a restart),\n"
       << "2 for bad usage.\n";
  return text.str();
}

}  // namespace ddprun
