// A worker for ddprun's tests: it needs no torch and does whatever its flags ask, in this order:
//   setup:   --trap-term         on SIGTERM print "rank N got SIGTERM" and exit 0
//            --ignore-term       ignore SIGTERM
//            --trap-usr1         on SIGUSR1 print "rank N got SIGUSR1" and go on
//            --spawn-grandchild DIR  fork a child that sleeps 300 s in our process group, holding
//                                our stdout/stderr; its pid goes to DIR/grandchild.<rank>
//            --pid-file DIR      write our pid to DIR/pid.<rank> (after the above: "ready")
//            --barrier           with --pid-file: wait (up to 10 s) until every local rank of
//                                this node wrote its pid file, so that no rank fails before
//                                the others are ready
//   output:  --print-env         one line: RANK=.. LOCAL_RANK=.. ... ("<unset>" if unset)
//            --print-args ARGS.. print each remaining argument as "arg: <ARG>" and exit 0
//            --print-cpus        one line: "cpus: <Cpus_allowed_list of /proc/self/status>"
//            --lines N           N long numbered lines on stdout, then one line on stderr
//            --err TEXT          print TEXT on stderr (repeatable; before the --out lines)
//            --out TEXT          print TEXT on stdout (repeatable; before the exit actions)
//            --record-error-on-rank R TEXT        if our rank is R, record TEXT as an original
//                                error in $TORCHELASTIC_ERROR_FILE, as ddp programs do, and
//                                print "error: TEXT" on stderr
//            --record-consequence-on-rank R TEXT  the same, recorded as a consequence
//            --sync-after-output DIR  then wait (up to 10 s) until every local rank of this
//                                node got here on this attempt, so that no rank fails before
//                                the others have printed (marker files DIR/printed.<A>.<rank>)
//   exit:    --exit-code-on-rank R CODE   exit with CODE if our rank is R
//            --signal-on-rank R SIG       raise SIG (number or name, e.g. SIGSEGV) if rank is R
//            --on-attempt A      do the two above only if $TORCHELASTIC_RESTART_COUNT is A
//                                (default: on every attempt)
//            --wait-for-file PATH  before the two above, wait (up to 10 s) until PATH exists
//   then:    --sleep SECONDS, --say TEXT (print TEXT), --partial-line (print text without '\n')
// The rank comes from $RANK (0 if unset).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

namespace {

struct ProbeOptions {
  bool print_env = false;
  bool print_cpus = false;
  bool print_args = false;
  std::vector<std::string> args_to_print;
  int lines = 0;
  bool partial_line = false;
  int exit_code_rank = -1;
  int exit_code = 0;
  int signal_rank = -1;
  int signal_number = 0;
  double sleep_seconds = 0;
  std::vector<std::string> say;
  std::vector<std::string> err_lines;
  std::vector<std::string> out_lines;
  int only_on_attempt = -1;
  std::string wait_for_file;
  std::string sync_dir;
  std::string pid_dir;
  std::string grandchild_dir;
  bool trap_term = false;
  bool ignore_term = false;
  bool trap_usr1 = false;
  bool barrier = false;
  int record_rank = -1;
  std::string record_text;
  bool record_consequence = false;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "launcher_probe: %s\n", message.c_str());
  std::exit(64);
}

int to_int(const std::string& text) {
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0') usage_error("not an integer: '" + text + "'");
  return static_cast<int>(value);
}

int to_signal(const std::string& text) {
  static const struct {
    const char* name;
    int number;
  } kNames[] = {{"SEGV", SIGSEGV}, {"KILL", SIGKILL}, {"ABRT", SIGABRT}, {"TERM", SIGTERM},
                {"INT", SIGINT},   {"BUS", SIGBUS},   {"FPE", SIGFPE},   {"HUP", SIGHUP}};
  std::string name = text.compare(0, 3, "SIG") == 0 ? text.substr(3) : text;
  for (const auto& known : kNames) {
    if (name == known.name) return known.number;
  }
  return to_int(text);
}

ProbeOptions parse(int argc, char** argv) {
  ProbeOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&](const char* what) -> std::string {
      if (i + 1 >= argc) usage_error(flag + " needs " + what);
      return argv[++i];
    };
    if (flag == "--print-cpus") {
      options.print_cpus = true;
    } else if (flag == "--print-env") {
      options.print_env = true;
    } else if (flag == "--print-args") {
      options.print_args = true;
      options.args_to_print.assign(argv + i + 1, argv + argc);
      break;
    } else if (flag == "--lines") {
      options.lines = to_int(value("N"));
    } else if (flag == "--partial-line") {
      options.partial_line = true;
    } else if (flag == "--exit-code-on-rank") {
      options.exit_code_rank = to_int(value("R"));
      options.exit_code = to_int(value("CODE"));
    } else if (flag == "--signal-on-rank") {
      options.signal_rank = to_int(value("R"));
      options.signal_number = to_signal(value("SIG"));
    } else if (flag == "--sleep") {
      options.sleep_seconds = std::atof(value("SECONDS").c_str());
    } else if (flag == "--err") {
      options.err_lines.push_back(value("TEXT"));
    } else if (flag == "--out") {
      options.out_lines.push_back(value("TEXT"));
    } else if (flag == "--sync-after-output") {
      options.sync_dir = value("DIR");
    } else if (flag == "--wait-for-file") {
      options.wait_for_file = value("PATH");
    } else if (flag == "--on-attempt") {
      options.only_on_attempt = to_int(value("A"));
    } else if (flag == "--say") {
      options.say.push_back(value("TEXT"));
    } else if (flag == "--pid-file") {
      options.pid_dir = value("DIR");
    } else if (flag == "--spawn-grandchild") {
      options.grandchild_dir = value("DIR");
    } else if (flag == "--trap-term") {
      options.trap_term = true;
    } else if (flag == "--ignore-term") {
      options.ignore_term = true;
    } else if (flag == "--trap-usr1") {
      options.trap_usr1 = true;
    } else if (flag == "--barrier") {
      options.barrier = true;
    } else if (flag == "--record-error-on-rank" || flag == "--record-consequence-on-rank") {
      options.record_rank = to_int(value("R"));
      options.record_text = value("TEXT");
      options.record_consequence = flag == "--record-consequence-on-rank";
    } else {
      usage_error("unknown flag '" + flag + "'");
    }
  }
  return options;
}

int int_from_env(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : fallback;
}

// Written then renamed, so a test polling for the file never reads it half-written.
void write_pid_file(const std::string& dir, const std::string& name, pid_t pid) {
  const std::string path = dir + "/" + name;
  const std::string temporary = path + ".tmp";
  {
    std::ofstream file(temporary);
    file << pid << "\n";
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    usage_error("cannot write " + path + ": " + std::strerror(errno));
  }
}

bool file_exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// The record ddp::record_error writes (src/launch/error_file.cpp), renamed into place whole.
void record_error(const std::string& text, bool consequence) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') usage_error("TORCHELASTIC_ERROR_FILE is not set");
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  const long long ns = static_cast<long long>(now.tv_sec) * 1000000000LL + now.tv_nsec;
  const std::string temporary = std::string(path) + ".tmp";
  {
    std::ofstream file(temporary);
    file << "{\"message\": {\"message\": \"" << text << "\", \"extraInfo\": {\"py_callstack\": \"\", "
         << "\"timestamp\": \"" << now.tv_sec << "\"}}, \"ddp\": {\"timestamp_ns\": " << ns
         << ", \"consequence\": " << (consequence ? "true" : "false") << "}}\n";
  }
  if (std::rename(temporary.c_str(), path) != 0) usage_error("cannot write " + std::string(path));
  std::fprintf(stderr, "error: %s\n", text.c_str());
}

// Waits until <dir>/<name_prefix><r> exists for every local rank r of this node.
void wait_for_local_ranks(const std::string& dir, const std::string& name_prefix, int rank,
                          const std::string& flag) {
  const int first_rank = rank - int_from_env("LOCAL_RANK", 0);
  const int local_ranks = int_from_env("LOCAL_WORLD_SIZE", 1);
  const timespec step{0, 5 * 1000 * 1000};
  for (int waited = 0; waited < 2000; ++waited) {
    bool all_ready = true;
    for (int r = first_rank; r < first_rank + local_ranks; ++r) {
      all_ready = all_ready && file_exists(dir + "/" + name_prefix + std::to_string(r));
    }
    if (all_ready) return;
    nanosleep(&step, nullptr);
  }
  usage_error(flag + ": the other local ranks did not get there within 10 s");
}

void sleep_for(double seconds) {
  timespec remaining{};
  remaining.tv_sec = static_cast<time_t>(seconds);
  remaining.tv_nsec = static_cast<long>((seconds - static_cast<double>(remaining.tv_sec)) * 1e9);
  while (nanosleep(&remaining, &remaining) != 0 && errno == EINTR) {
  }
}

char g_term_message[64];
size_t g_term_message_size = 0;

void on_term(int) {
  ssize_t ignored = write(STDOUT_FILENO, g_term_message, g_term_message_size);
  (void)ignored;
  _exit(0);
}

char g_usr1_message[64];
size_t g_usr1_message_size = 0;

void on_usr1(int) {
  ssize_t ignored = write(STDOUT_FILENO, g_usr1_message, g_usr1_message_size);
  (void)ignored;
}

void print_env_line() {
  const char* names[] = {"RANK",
                         "LOCAL_RANK",
                         "WORLD_SIZE",
                         "LOCAL_WORLD_SIZE",
                         "GROUP_RANK",
                         "GROUP_WORLD_SIZE",
                         "ROLE_RANK",
                         "ROLE_WORLD_SIZE",
                         "MASTER_ADDR",
                         "MASTER_PORT",
                         "OMP_NUM_THREADS",
                         "TORCHELASTIC_RESTART_COUNT",
                         "TORCHELASTIC_MAX_RESTARTS",
                         "TORCHELASTIC_RUN_ID",
                         "DDP_RUN_ID",
                         "DDPRUN_ATTEMPT"};
  std::string line;
  for (const char* name : names) {
    const char* value = std::getenv(name);
    if (!line.empty()) line += ' ';
    line += std::string(name) + "=" + (value != nullptr ? value : "<unset>");
  }
  std::printf("%s\n", line.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const ProbeOptions options = parse(argc, argv);
  const int rank = int_from_env("RANK", 0);

  if (options.trap_term) {
    g_term_message_size = static_cast<size_t>(
        std::snprintf(g_term_message, sizeof g_term_message, "rank %d got SIGTERM\n", rank));
    signal(SIGTERM, on_term);
  }
  if (options.ignore_term) signal(SIGTERM, SIG_IGN);
  if (options.trap_usr1) {
    g_usr1_message_size = static_cast<size_t>(
        std::snprintf(g_usr1_message, sizeof g_usr1_message, "rank %d got SIGUSR1\n", rank));
    struct sigaction action {};
    action.sa_handler = on_usr1;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &action, nullptr);
  }
  if (!options.grandchild_dir.empty()) {
    std::fflush(nullptr);
    pid_t child = fork();
    if (child == 0) {
      signal(SIGTERM, SIG_DFL);
      sleep_for(300);
      _exit(0);
    }
    if (child < 0) usage_error(std::string("fork: ") + std::strerror(errno));
    write_pid_file(options.grandchild_dir, "grandchild." + std::to_string(rank), child);
  }
  if (!options.pid_dir.empty()) {
    write_pid_file(options.pid_dir, "pid." + std::to_string(rank), getpid());
    if (options.barrier) wait_for_local_ranks(options.pid_dir, "pid.", rank, "--barrier");
  }

  if (options.print_env) print_env_line();
  if (options.print_cpus) {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("Cpus_allowed_list:", 0) == 0) {
        std::printf("cpus: %s\n", line.substr(line.find_first_not_of(" \t", 18)).c_str());
      }
    }
  }
  if (options.print_args) {
    for (const std::string& arg : options.args_to_print) std::printf("arg: %s\n", arg.c_str());
    return 0;
  }
  for (int line = 0; line < options.lines; ++line) {
    // ~320-byte lines do not divide stdio's 4 KiB buffer, so many are split across two writes.
    std::printf("rank %d line %d %s\n", rank, line, std::string(300, 'x').c_str());
  }
  if (options.lines > 0) std::fprintf(stderr, "rank %d stderr line\n", rank);
  for (const std::string& text : options.err_lines) std::fprintf(stderr, "%s\n", text.c_str());
  for (const std::string& text : options.out_lines) std::printf("%s\n", text.c_str());
  if (options.record_rank == rank) record_error(options.record_text, options.record_consequence);
  std::fflush(nullptr);

  if (!options.sync_dir.empty()) {
    const std::string prefix =
        "printed." + std::to_string(int_from_env("TORCHELASTIC_RESTART_COUNT", 0)) + ".";
    write_pid_file(options.sync_dir, prefix + std::to_string(rank), getpid());
    wait_for_local_ranks(options.sync_dir, prefix, rank, "--sync-after-output");
  }
  if (!options.wait_for_file.empty()) {
    const timespec step{0, 5 * 1000 * 1000};
    for (int waited = 0; !file_exists(options.wait_for_file); ++waited) {
      if (waited == 2000) usage_error("--wait-for-file: " + options.wait_for_file + " not there");
      nanosleep(&step, nullptr);
    }
  }
  const bool this_attempt =
      options.only_on_attempt < 0 ||
      int_from_env("TORCHELASTIC_RESTART_COUNT", 0) == options.only_on_attempt;
  if (this_attempt && options.exit_code_rank == rank) return options.exit_code;
  if (this_attempt && options.signal_rank == rank) {
    rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);  // a test's crash should not litter the disk
    signal(options.signal_number, SIG_DFL);
    raise(options.signal_number);
  }
  if (options.sleep_seconds > 0) sleep_for(options.sleep_seconds);
  for (const std::string& text : options.say) std::printf("%s\n", text.c_str());
  if (options.partial_line) std::printf("rank %d partial line without newline", rank);
  std::fflush(nullptr);
  return 0;
}
