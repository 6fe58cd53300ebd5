#include "command_line.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

namespace ddprun {
namespace {

enum class FlagKind { kValue, kSwitch };

struct FlagSpec {
  const char* name;  // canonical spelling, without the leading "--"
  FlagKind kind;
};

constexpr FlagSpec kFlags[] = {
    {"nproc-per-node", FlagKind::kValue}, {"nnodes", FlagKind::kValue},
    {"node-rank", FlagKind::kValue},      {"master-addr", FlagKind::kValue},
    {"master-port", FlagKind::kValue},    {"grace-period", FlagKind::kValue},
    {"standalone", FlagKind::kSwitch},    {"no-prefix", FlagKind::kSwitch},
    {"help", FlagKind::kSwitch},
};

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
       << "stops every worker as soon as one of them fails.\n"
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
       << "  -h, --help           print this help and exit\n"
       << "  --                   end of options; the next word is PROGRAM\n"
       << "\n"
       << "Everything from PROGRAM on is passed to PROGRAM untouched. If OMP_NUM_THREADS is unset\n"
       << "and there is more than one worker, workers get OMP_NUM_THREADS=1.\n"
       << "\n"
       << "Exit status: 0 if every worker exits 0, 1 if a worker fails, 128+N if ddprun receives\n"
       << "signal N (SIGINT, SIGTERM and SIGHUP are forwarded to the workers), 2 for bad usage.\n";
  return text.str();
}

}  // namespace ddprun
