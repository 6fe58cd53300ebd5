#include "launcher.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "console.h"
#include "cpu_binding.h"
#include "error_record.h"
#include "line_forwarder.h"
#include "posix_util.h"
#include "rdzv.h"
#include "signal_pipe.h"
#include "std_spec.h"
#include "watchdog.h"

#include <ddp/launch_env.h>

extern char** environ;

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

// After the final SIGKILL, how long we keep reading pipes that some process which left the
// workers' process groups may still hold open. Their data is not worth hanging for.
constexpr std::chrono::seconds kAbandonPipesAfterKill{2};

std::string format_seconds(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

// --virtual-local-rank: the one device a worker of `local_rank` sees, as torchrun picks it.
// Throws std::invalid_argument if CUDA_VISIBLE_DEVICES has no entry for it.
std::string virtual_local_rank_device(int local_rank) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) return std::to_string(local_rank);
  // torchrun splits on ',' and strips each entry, nothing more.
  std::vector<std::string> devices;
  std::stringstream entries(visible);
  for (std::string entry; std::getline(entries, entry, ',');) devices.push_back(entry);
  if (std::string(visible).empty() || std::string(visible).back() == ',') devices.emplace_back();
  if (local_rank >= static_cast<int>(devices.size())) {
    throw std::invalid_argument("--virtual-local-rank gives each local rank one entry of CUDA_VISIBLE_DEVICES='" +
                                std::string(visible) + "', but local rank " + std::to_string(local_rank) +
                                " has none; lower --nproc-per-node or list more devices");
  }
  std::string device = devices[static_cast<size_t>(local_rank)];
  const size_t first = device.find_first_not_of(" \t");
  return first == std::string::npos ? "" : device.substr(first, device.find_last_not_of(" \t") - first + 1);
}

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

// What ddprun catches: SIGCHLD to watch its workers, SIGUSR1 to pass on for stack dumps, and
// the --signals-to-handle that stop the job.
std::vector<int> caught_signals(const LaunchOptions& options) {
  std::vector<int> signals = {SIGCHLD, SIGUSR1};
  for (int signal_number : options.handled_signals) {
    if (std::find(signals.begin(), signals.end(), signal_number) == signals.end()) signals.push_back(signal_number);
  }
  return signals;
}

// KEY=VALUE strings as execve wants them; set() replaces an existing KEY.
class Environment {
 public:
  static Environment inherited() {
    Environment environment;
    for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
      environment.entries_.emplace_back(*entry);
    }
    return environment;
  }

  void set(const std::string& key, const std::string& value) {
    const std::string key_prefix = key + "=";
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                  [&](const std::string& entry) {
                                    return entry.compare(0, key_prefix.size(), key_prefix) == 0;
                                  }),
                   entries_.end());
    entries_.push_back(key_prefix + value);
  }

  const std::vector<std::string>& entries() const { return entries_; }

 private:
  std::vector<std::string> entries_;
};

// argv/envp view of strings; valid while `strings` lives.
std::vector<char*> c_string_array(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (const std::string& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

struct Worker {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;           // also the id of the worker's own process group
  FileDescriptor log_file;  // with --log-dir: where both streams go
  std::string log_path;
  // torchrun's <local_rank>/stdout.log and stderr.log: the redirected and teed streams.
  FileDescriptor stdout_file;
  FileDescriptor stderr_file;
  std::string error_file;  // its TORCHELASTIC_ERROR_FILE
  std::vector<LineForwarder> streams;  // its stdout and stderr, in that order
  bool exited = false;  // observed exiting; the zombie is reaped only at the very end
  int exit_code = -1;
  int term_signal = 0;
  bool exited_while_stopping = false;
  bool sigkilled_by_launcher = false;

  bool failed() const { return term_signal != 0 || exit_code != 0; }
  std::string label() const {
    return "rank " + std::to_string(global_rank) + " (local rank " + std::to_string(local_rank) +
           ", pid " + std::to_string(pid) + ")";
  }
  // What the worker said last: its last error line (stderr first), else its last stderr line,
  // else its last stdout line. Stack frames never count.
  std::string last_words() const {
    for (size_t i = streams.size(); i-- > 0;) {
      if (!streams[i].last_error_line().empty()) return streams[i].last_error_line();
    }
    for (size_t i = streams.size(); i-- > 0;) {
      if (!streams[i].last_line().empty()) return streams[i].last_line();
    }
    return "(no output)";
  }
};

// The worker whose failure ended an attempt, as the final report describes it.
struct FailedWorker {
  int global_rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  int exit_code = -1;
  int term_signal = 0;
  std::string exit_text;  // how it ended, as the reports say it
  std::string last_line;
  std::string log_path;  // empty without --log-dir
  // The worker's recorded error (TORCHELASTIC_ERROR_FILE), when one was recorded.
  ErrorRecord record;
};

struct AttemptOutcome {
  int received_signal = 0;  // ddprun was asked to stop: never restart
  bool worker_failed = false;
  FailedWorker first_failure;  // when worker_failed
  // With the c10d rendezvous: the store asked us to stop (another node failed, a node was lost
  // or is joining), or the store itself stopped answering.
  bool stopped_by_rendezvous = false;
  bool store_lost = false;
};

// Where one attempt's workers sit in the job.
struct Assignment {
  int attempt = 0;        // rounds of the job, from 0: names log directories and error files
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: restarts after failures so far
  int node_rank = 0;
  int nnodes = 1;
  int world_size = 1;
  int base_rank = 0;  // global rank of local rank 0
  std::string master_addr;
  int master_port = 0;
};

// What every attempt's workers get beyond their environment, worked out once per run.
struct WorkerSetup {
  // torchrun's <log_dir>/<run_id>_<random>, where the redirected and teed streams go; empty
  // without --log-dir, --redirects and --tee.
  std::string stream_log_dir;
  std::set<int> console_local_ranks;     // --local-ranks-filter; empty: every rank
  std::vector<CpuList> cpus_by_local_rank;  // empty entries: not bound
  // OMP_NUM_THREADS was unset and --cpu-bind gives each worker its own CPUs: each gets as many
  // threads as it has CPUs.
  bool omp_threads_from_cpus = false;
};

std::string attempt_log_dir(const std::string& log_dir, int attempt) {
  return log_dir + "/attempt_" + std::to_string(attempt);
}

// mkdir -p, with an error that names the directory.
void create_directories(const std::string& path) {
  std::error_code error;
  std::filesystem::create_directories(path, error);
  if (error) {
    throw std::runtime_error("cannot create log directory '" + path + "': " + error.message());
  }
}

// Truncated, appended to (lines of several workers may share it).
FileDescriptor create_log_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw_errno("cannot create log file '" + path + "'");
  return FileDescriptor(fd);
}

// One attempt of the job: start the workers, watch them and their output, stop them.
class Job {
 public:
  // The Job borrows everything; all of it must outlive the Job.
  Job(const LaunchOptions& options, const Assignment& assignment, const Environment& shared_environment,
      const WorkerSetup& setup, const std::string& error_dir, Watchdog& watchdog, SignalPipe& signals,
      RdzvClient* client = nullptr)
      : options_(options),
        assignment_(assignment),
        setup_(setup),
        attempt_(assignment.attempt),
        error_dir_(error_dir),
        shared_environment_(shared_environment),
        watchdog_(watchdog),
        signals_(signals),
        client_(client) {}

  AttemptOutcome run() {
    try {
      start_workers();
      watch_until_done();
    } catch (...) {
      kill_all_groups();
      reap_all();
      throw;
    }
    // Grandchildren left in the workers' process groups (daemons, stray helpers) must not
    // outlive the attempt. The zombie group leaders keep the group ids from being reused.
    kill_all_groups();
    reap_all();
    return report_outcome();
  }

 private:
  enum class Stage {
    kRunning,   // workers are running normally
    kStopping,  // workers were sent SIGTERM (or a forwarded signal); waiting for the grace period
    kKilled,    // workers were sent SIGKILL
  };

  void start_workers() {
    Environment shared = shared_environment_;
    shared.set(ddp::launch_env::kMasterAddr, assignment_.master_addr);
    shared.set(ddp::launch_env::kMasterPort, std::to_string(assignment_.master_port));
    shared.set(ddp::launch_env::kRestartCount, std::to_string(assignment_.restart_count));
    shared.set("DDPRUN_ATTEMPT", std::to_string(assignment_.attempt));
    shared.set(ddp::launch_env::kWorldSize, std::to_string(assignment_.world_size));
    shared.set(ddp::launch_env::kGroupRank, std::to_string(assignment_.node_rank));
    shared.set("GROUP_WORLD_SIZE", std::to_string(assignment_.nnodes));
    shared.set("ROLE_WORLD_SIZE", std::to_string(assignment_.world_size));

    workers_.reserve(static_cast<size_t>(options_.nproc_per_node));
    for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
      Worker worker;
      worker.local_rank = local_rank;
      worker.global_rank = assignment_.base_rank + local_rank;
      workers_.push_back(std::move(worker));
    }
    // Every log file exists before the first worker starts, so a log directory we cannot write
    // stops the attempt before any work is done.
    if (!options_.log_dir.empty()) open_log_files();
    if (!setup_.stream_log_dir.empty()) open_stream_files();
    for (Worker& worker : workers_) {
      Environment environment = shared;
      if (setup_.omp_threads_from_cpus) {
        environment.set("OMP_NUM_THREADS", std::to_string(cpus_of(worker).size()));
      }
      environment.set(ddp::launch_env::kRank, std::to_string(worker.global_rank));
      environment.set(ddp::launch_env::kLocalRank, std::to_string(worker.local_rank));
      if (options_.virtual_local_rank) {
        // As torchrun: each worker sees only its own GPU, as device 0.
        environment.set(ddp::launch_env::kLocalRank, "0");
        environment.set("CUDA_VISIBLE_DEVICES", virtual_local_rank_device(worker.local_rank));
      }
      environment.set("ROLE_RANK", std::to_string(worker.global_rank));
      // Where the worker records its first error (torchrun's convention), so that the summary
      // names the earliest original error rather than whichever worker exited first.
      worker.error_file = error_file_for(worker);
      ::unlink(worker.error_file.c_str());
      environment.set(ddp::launch_env::kErrorFile, worker.error_file);
      // ddp writes its collective traces here (trace_rank<R>.jsonl) when a
      // collective fails, next to the attempt's logs.
      if (!options_.log_dir.empty()) environment.set(ddp::launch_env::kLogDir, attempt_log_dir(options_.log_dir, attempt_));
      spawn(worker, environment);
    }
  }

  std::string error_file_for(const Worker& worker) const {
    if (!options_.log_dir.empty()) {
      return attempt_log_dir(options_.log_dir, attempt_) + "/rank_" + std::to_string(worker.global_rank) +
             ".error.json";
    }
    return error_dir_ + "/attempt_" + std::to_string(attempt_) + ".rank_" + std::to_string(worker.global_rank) +
           ".error.json";
  }

  void open_log_files() {
    const std::string directory = attempt_log_dir(options_.log_dir, attempt_);
    create_directories(directory);
    for (Worker& worker : workers_) {
      worker.log_path = directory + "/rank_" + std::to_string(worker.global_rank) + ".log";
      worker.log_file = create_log_file(worker.log_path);
    }
  }

  // torchrun's layout: <stream_log_dir>/attempt_<A>/<local_rank>/{stdout,stderr}.log for the
  // streams --redirects or --tee name, and attempt_<A>/filtered_{stdout,stderr}.log for the
  // --duplicate-*-filters.
  void open_stream_files() {
    const std::string attempt_dir = setup_.stream_log_dir + "/attempt_" + std::to_string(attempt_);
    for (Worker& worker : workers_) {
      const std::string directory = attempt_dir + "/" + std::to_string(worker.local_rank);
      create_directories(directory);
      const int streams = std_streams_for(options_.redirects, worker.local_rank) |
                          std_streams_for(options_.tee_spec, worker.local_rank);
      if ((streams & kStdOut) != 0) worker.stdout_file = create_log_file(directory + "/stdout.log");
      if ((streams & kStdErr) != 0) worker.stderr_file = create_log_file(directory + "/stderr.log");
    }
    if (!options_.duplicate_stdout_filters.empty()) filtered_stdout_ = create_log_file(attempt_dir + "/filtered_stdout.log");
    if (!options_.duplicate_stderr_filters.empty()) filtered_stderr_ = create_log_file(attempt_dir + "/filtered_stderr.log");
  }

  const CpuList& cpus_of(const Worker& worker) const {
    static const CpuList kUnbound;
    const size_t index = static_cast<size_t>(worker.local_rank);
    return index < setup_.cpus_by_local_rank.size() ? setup_.cpus_by_local_rank[index] : kUnbound;
  }

  // Where the lines of one of the worker's streams (kStdOut or kStdErr) go, as torchrun sends
  // them: a redirected stream only to its file, a teed one to its file and to the console with
  // torchrun's "[<role><local_rank>]:" (and, matching a --duplicate-*-filter, to the filtered
  // file), any other to the console with ddprun's "[rank<R>]: " (which --no-prefix drops, so
  // that the console reads as torchrun's). --local-ranks-filter keeps the other ranks off the
  // console (and out of the filtered file, as torchrun does). With --log-dir, ddprun's
  // rank_<R>.log gets both streams whatever the rest says.
  std::vector<LineSink> sinks_for(const Worker& worker, int console_fd, int stream) const {
    const bool redirected = (std_streams_for(options_.redirects, worker.local_rank) & stream) != 0;
    const bool teed = (std_streams_for(options_.tee_spec, worker.local_rank) & stream) != 0;
    const bool shown = setup_.console_local_ranks.empty() || setup_.console_local_ranks.count(worker.local_rank) != 0;
    const std::string torchrun_prefix = "[" + options_.role + std::to_string(worker.local_rank) + "]:";
    std::vector<LineSink> sinks;
    if (worker.log_file.get() >= 0) sinks.push_back(LineSink{worker.log_file.get(), "", /*console=*/false, {}});
    const FileDescriptor& stream_file = stream == kStdOut ? worker.stdout_file : worker.stderr_file;
    if (stream_file.get() >= 0) sinks.push_back(LineSink{stream_file.get(), "", /*console=*/false, {}});
    if (!shown) return sinks;
    if (teed) {
      sinks.push_back(LineSink{console_fd, torchrun_prefix, /*console=*/true, {}});
      const FileDescriptor& filtered = stream == kStdOut ? filtered_stdout_ : filtered_stderr_;
      const auto& filters = stream == kStdOut ? options_.duplicate_stdout_filters : options_.duplicate_stderr_filters;
      if (filtered.get() >= 0) sinks.push_back(LineSink{filtered.get(), torchrun_prefix, /*console=*/false, filters});
    } else if (!redirected) {
      const std::string prefix = options_.prefix_output ? "[rank" + std::to_string(worker.global_rank) + "]: " : "";
      sinks.push_back(LineSink{console_fd, prefix, /*console=*/true, {}});
    }
    return sinks;
  }

  void spawn(Worker& worker, const Environment& environment) {
    // Everything the child needs is built before fork, so the child only makes system calls.
    std::vector<char*> argv = c_string_array(options_.command);
    std::vector<char*> envp = c_string_array(environment.entries());
    const std::string exec_failure = "ddprun: cannot execute '" + options_.command[0] + "': ";
    std::vector<LineSink> out_sinks = sinks_for(worker, STDOUT_FILENO, kStdOut);
    std::vector<LineSink> err_sinks = sinks_for(worker, STDERR_FILENO, kStdErr);
    const CpuList& cpus = cpus_of(worker);
    cpu_set_t cpu_set;
    CPU_ZERO(&cpu_set);
    for (int cpu : cpus) CPU_SET(cpu, &cpu_set);
    const std::string bind_failure = "ddprun: cannot bind local rank " + std::to_string(worker.local_rank) +
                                     " to CPUs " + format_cpu_list(cpus) + ": ";

    int out_pipe[2];
    int err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw_errno("pipe2");
    if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
      int saved = errno;
      ::close(out_pipe[0]);
      ::close(out_pipe[1]);
      errno = saved;
      throw_errno("pipe2");
    }

    const pid_t launcher_pid = ::getpid();
    // Blocked across fork: a signal arriving before the child has reset its dispositions would
    // otherwise run our handler in the child and write into the launcher's signal pipe.
    sigset_t all_signals;
    sigset_t previous_mask;
    sigfillset(&all_signals);
    ::sigprocmask(SIG_BLOCK, &all_signals, &previous_mask);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Own process group, so that stopping a worker also reaches the processes it started.
      ::setpgid(0, 0);
      // Dies with the launcher even when the launcher is SIGKILLed and cannot clean up...
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      // ...unless the launcher died before prctl took effect.
      if (::getppid() != launcher_pid) ::_exit(1);
      signals_.reset_in_child();
      ::signal(SIGPIPE, SIG_DFL);
      // ensure_standard_fds_open() guarantees the pipe ends are not 1 or 2 themselves.
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      // Before exec, so that every thread the program starts inherits it.
      if (!cpus.empty() && ::sched_setaffinity(0, sizeof cpu_set, &cpu_set) != 0) {
        const char* reason = std::strerror(errno);
        write_all(STDERR_FILENO, bind_failure.data(), bind_failure.size());
        write_all(STDERR_FILENO, reason, std::strlen(reason));
        write_all(STDERR_FILENO, "\n", 1);
        ::_exit(127);
      }
      sigset_t no_signals;
      sigemptyset(&no_signals);
      ::sigprocmask(SIG_SETMASK, &no_signals, nullptr);
      ::execvpe(argv[0], argv.data(), envp.data());
      const char* reason = std::strerror(errno);
      write_all(STDERR_FILENO, exec_failure.data(), exec_failure.size());
      write_all(STDERR_FILENO, reason, std::strlen(reason));
      write_all(STDERR_FILENO, "\n", 1);
      ::_exit(127);
    }
    const int fork_errno = errno;
    ::sigprocmask(SIG_SETMASK, &previous_mask, nullptr);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    if (pid < 0) {
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
      errno = fork_errno;
      throw_errno("fork");
    }
    // Also done here so the group exists before we could signal it, whoever runs first.
    ::setpgid(pid, pid);
    worker.pid = pid;
    watchdog_.watch(pid);

    worker.streams.emplace_back(out_pipe[0], std::move(out_sinks));
    worker.streams.emplace_back(err_pipe[0], std::move(err_sinks));
  }

  void watch_until_done() {
    // A test hook (tests/test_ddprun_console.cpp): hold this loop once, as a call that blocks
    // would, so that a test can show the heartbeat then stops speaking for this node.
    if (const char* stall = std::getenv("DDPRUN_TEST_STALL_SUPERVISOR_SECONDS"); stall && client_ != nullptr) {
      std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(stall)));
    }
    while (true) {
      // The heartbeat speaks for this loop: a node stuck here must look lost to the others.
      if (client_ != nullptr) client_->mark_supervisor_alive();
      handle_signals();
      collect_exits();
      check_rendezvous();

      const bool all_exited = std::all_of(workers_.begin(), workers_.end(),
                                          [](const Worker& worker) { return worker.exited; });
      if (all_exited && !any_stream_open()) return;

      if (all_exited && stage_ == Stage::kRunning) {
        // The workers are done but their output pipes are still open: a process they started
        // is still running in one of their groups. Stop it like any worker.
        stop_workers(SIGTERM);
      }
      const Clock::time_point now = Clock::now();
      if (stage_ == Stage::kStopping && now >= kill_deadline_) kill_workers(/*early=*/false);
      if (stage_ == Stage::kKilled && all_exited && now >= abandon_deadline_) {
        // Only a process that left the workers' groups can still hold the pipes open.
        for (Worker& worker : workers_) {
          for (LineForwarder& stream : worker.streams) stream.close();
        }
        return;
      }
      wait_for_events();
    }
  }

  // With the c10d rendezvous: stop the workers when the store says so, or when it is gone.
  void check_rendezvous() {
    if (client_ == nullptr || stage_ != Stage::kRunning) return;
    if (client_->store_lost()) {
      say("lost the rendezvous store at " + client_->endpoint() + ": no answer for " +
          format_seconds(std::round(client_->seconds_since_answer() * 10) / 10) +
          " s (the ddprun hosting it is gone, or the network is cut); stopping the workers");
      store_lost_ = true;
      stop_workers(SIGTERM);
      return;
    }
    const RdzvView view = client_->view();
    if (view.kind == RdzvView::kStop && view.round == attempt_) {
      say("stopping the workers on this node: " + view.text);
      stopped_by_rendezvous_ = true;
      stop_workers(SIGTERM);
    } else if (view.kind == RdzvView::kLost || view.kind == RdzvView::kFail) {
      say("stopping the workers on this node: " + view.text);
      store_lost_ = true;  // no later round can include this node
      stop_workers(SIGTERM);
    }
  }

  bool any_stream_open() const {
    for (const Worker& worker : workers_) {
      for (const LineForwarder& stream : worker.streams) {
        if (stream.is_open()) return true;
      }
    }
    return false;
  }

  // Sleeps until a signal, worker output, or the current stage's deadline.
  void wait_for_events() {
    std::vector<pollfd> fds;
    std::vector<LineForwarder*> fd_streams;
    fds.push_back({signals_.read_fd(), POLLIN, 0});
    if (client_ != nullptr) fds.push_back({client_->wake_fd(), POLLIN, 0});
    const size_t first_stream = fds.size();
    for (Worker& worker : workers_) {
      for (LineForwarder& stream : worker.streams) {
        if (!stream.is_open()) continue;
        fds.push_back({stream.fd(), POLLIN, 0});
        fd_streams.push_back(&stream);
      }
    }
    const size_t console_fds = fds.size();
    console_add_poll_fds(fds);

    int timeout_ms = -1;  // SIGCHLD and the forwarded signals arrive through the signal pipe
    if (stage_ != Stage::kRunning) {
      const Clock::time_point deadline =
          stage_ == Stage::kStopping ? kill_deadline_ : abandon_deadline_;
      auto remaining =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<long long>(remaining + 1, 0, 60 * 1000));
    }
    if (client_ != nullptr) {
      // The store's silence is measured here, whether or not the heartbeat thread wakes us.
      const int monitor_ms = static_cast<int>(std::max(10.0, options_.monitor_interval_seconds * 1000));
      timeout_ms = timeout_ms < 0 ? monitor_ms : std::min(timeout_ms, monitor_ms);
    }

    int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) return;
      throw_errno("poll");
    }
    // One read per stream per round keeps a chatty worker from starving the others.
    if (client_ != nullptr && fds[1].revents != 0) client_->drain_wake();
    for (size_t i = first_stream; i < console_fds; ++i) {
      if (fds[i].revents != 0) fd_streams[i - first_stream]->read_some();
    }
    console_flush();
  }

  void handle_signals() {
    for (int signal_number : signals_.drain()) {
      if (signal_number == SIGCHLD) continue;  // collect_exits() looks at every worker anyway
      const std::string name = signal_name(signal_number);
      if (signal_number == SIGUSR1) {
        // For stack dumps: passed on to every running worker (not their process groups), and
        // nothing is stopped.
        int forwarded = 0;
        for (const Worker& worker : workers_) {
          if (!worker.exited && ::kill(worker.pid, SIGUSR1) == 0) ++forwarded;
        }
        say("received SIGUSR1, forwarded it to " + std::to_string(forwarded) + " worker(s)");
        continue;
      }
      if (stage_ == Stage::kRunning) {
        received_signal_ = signal_number;
        say("received " + name + ", forwarding it to the workers (SIGKILL follows after " +
            format_seconds(options_.grace_period_seconds) + " s)");
        stop_workers(signal_number);
      } else {
        // Also while stopping after a failure: a request to stop rules out a restart.
        if (received_signal_ == 0) received_signal_ = signal_number;
        if (stage_ == Stage::kStopping) {
          // A second request to stop means the user does not want to wait for the grace period.
          say("received " + name + " while stopping the workers; killing them now");
          kill_workers(/*early=*/true);
        }
      }
    }
  }

  void collect_exits() {
    std::vector<Worker*> newly_failed;
    for (Worker& worker : workers_) {
      if (worker.exited) continue;
      siginfo_t info;
      std::memset(&info, 0, sizeof info);
      // WNOWAIT leaves the zombie in place: while it exists its pid (= its process group id)
      // cannot be reused, so signalling the group later cannot hit an unrelated process.
      if (::waitid(P_PID, static_cast<id_t>(worker.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          info.si_pid == 0) {
        continue;
      }
      worker.exited = true;
      if (info.si_code == CLD_EXITED) {
        worker.exit_code = info.si_status;
      } else {
        worker.term_signal = info.si_status;
      }
      if (stage_ != Stage::kRunning) {
        worker.exited_while_stopping = true;
      } else if (worker.failed()) {
        newly_failed.push_back(&worker);
      }
    }
    if (newly_failed.empty()) return;

    const bool first = first_failed_ == nullptr;
    if (first) first_failed_ = newly_failed.front();
    for (Worker* worker : newly_failed) {
      // Its last words (a stack trace, an error message) belong before our verdict.
      for (LineForwarder& stream : worker->streams) stream.read_available();
      std::string message =
          worker->label() + " failed: " + describe_exit(worker->exit_code, worker->term_signal);
      if (worker->term_signal == 0 && worker->exit_code == 127) {
        message += " (127 usually means the program could not be executed)";
      }
      say(message);
    }
    if (first && client_ != nullptr) {
      // At once, so that the other nodes stop their workers while ours stop.
      const Worker& failed = *newly_failed.front();
      client_->notify_failing(attempt_, failed.global_rank, describe_exit(failed.exit_code, failed.term_signal));
    }
    stop_workers(SIGTERM);
  }

  void stop_workers(int signal_number) {
    if (teardown_started_ns_ == 0) {
      teardown_started_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count();
    }
    stage_ = Stage::kStopping;
    kill_deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(options_.grace_period_seconds));
    // Exited workers' groups too: their leaders are zombies, but their children may live on.
    for (const Worker& worker : workers_) ::killpg(worker.pid, signal_number);
  }

  // early: because ddprun was asked to stop, before the grace period was over.
  void kill_workers(bool early) {
    killed_early_ = early;
    for (Worker& worker : workers_) {
      if (!worker.exited) worker.sigkilled_by_launcher = true;
    }
    kill_all_groups();
    stage_ = Stage::kKilled;
    abandon_deadline_ = Clock::now() + kAbandonPipesAfterKill;
  }

  void kill_all_groups() {
    for (const Worker& worker : workers_) {
      if (worker.pid > 0) ::killpg(worker.pid, SIGKILL);
    }
  }

  void reap_all() {
    for (Worker& worker : workers_) {
      if (worker.pid <= 0) continue;
      // Before the reap frees the id: the watchdog must never kill a group of that id again.
      watchdog_.forget(worker.pid);
      int status = 0;
      while (::waitpid(worker.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }

  // Killed by a signal while ddprun was stopping the workers (ddprun's SIGTERM or SIGKILL, or
  // a signal it forwarded).
  static bool stopped_by_teardown(const Worker& worker) {
    return worker.exited_while_stopping && worker.term_signal != 0;
  }
  // Stopped by the teardown after recording an original error of its own before it began.
  static bool stopped_after_own_error(const Worker& worker, const ErrorRecord& record) {
    return stopped_by_teardown(worker) && record.present && !record.consequence;
  }

  AttemptOutcome report_outcome() const {
    AttemptOutcome outcome;
    outcome.received_signal = received_signal_;
    outcome.worker_failed = first_failed_ != nullptr;
    outcome.stopped_by_rendezvous = stopped_by_rendezvous_;
    outcome.store_lost = store_lost_;
    if (outcome.received_signal == 0 && !outcome.worker_failed && !stopped_by_rendezvous_ && !store_lost_)
      return outcome;
    std::vector<ErrorRecord> records;
    for (const Worker& worker : workers_) {
      records.push_back(read_error_record(worker.error_file));
      ErrorRecord& record = records.back();
      // Written after ddprun began stopping the workers: it describes the stop, not its cause.
      if (record.present && teardown_started_ns_ > 0 && record.timestamp_ns > teardown_started_ns_) {
        record.consequence = true;
      }
    }
    for (size_t i = 0; i < workers_.size(); ++i) {
      const Worker& worker = workers_[i];
      if (!worker.exited_while_stopping) continue;
      std::string how;
      if (worker.sigkilled_by_launcher && worker.term_signal == SIGKILL) {
        how = killed_early_
                  ? "still running when ddprun was asked to stop, killed with SIGKILL"
                  : "still running after the " + format_seconds(options_.grace_period_seconds) +
                        " s grace period, killed with SIGKILL";
      } else {
        how = describe_exit(worker.exit_code, worker.term_signal);
      }
      if (stopped_after_own_error(worker, records[i])) how += ", after it had failed with its own error";
      say("stopped " + worker.label() + ": " + how);
    }
    if (received_signal_ != 0)
      say("received " + signal_name(received_signal_) + ", workers stopped");
    if (first_failed_ != nullptr) {
      // The earliest original error any worker recorded; failing that, the earliest recorded
      // consequence; failing that, the first worker that failed.
      const Worker* root = first_failed_;
      ErrorRecord best;
      for (size_t i = 0; i < workers_.size(); ++i) {
        const Worker& worker = workers_[i];
        const ErrorRecord& record = records[i];
        if (!record.present) continue;
        // A consequence from a worker the teardown killed says less than the exit of the
        // worker that failed on its own first.
        if (record.consequence && &worker != first_failed_ && stopped_by_teardown(worker)) continue;
        const bool better = !best.present || (best.consequence && !record.consequence) ||
                            (best.consequence == record.consequence && record.timestamp_ns < best.timestamp_ns);
        if (better) {
          best = record;
          root = &worker;
        }
      }
      FailedWorker& failure = outcome.first_failure;
      failure.global_rank = root->global_rank;
      failure.local_rank = root->local_rank;
      failure.pid = root->pid;
      failure.exit_code = root->exit_code;
      failure.term_signal = root->term_signal;
      // Its own error, not the signal that ended it while it was exiting over that error.
      failure.exit_text = stopped_after_own_error(*root, best)
                              ? "failed with its own error; ddprun then stopped it with " + signal_name(root->term_signal)
                              : describe_exit(root->exit_code, root->term_signal);
      failure.last_line = root->last_words();
      failure.log_path = root->log_path;
      failure.record = best;
    }
    return outcome;
  }

  const LaunchOptions& options_;
  const Assignment& assignment_;
  const WorkerSetup& setup_;
  FileDescriptor filtered_stdout_;  // torchrun's attempt_<A>/filtered_stdout.log
  FileDescriptor filtered_stderr_;
  const int attempt_;
  const std::string& error_dir_;
  const Environment& shared_environment_;
  Watchdog& watchdog_;
  SignalPipe& signals_;
  RdzvClient* client_;
  bool stopped_by_rendezvous_ = false;
  bool store_lost_ = false;
  std::vector<Worker> workers_;
  Stage stage_ = Stage::kRunning;
  Clock::time_point kill_deadline_;
  Clock::time_point abandon_deadline_;
  int received_signal_ = 0;
  bool killed_early_ = false;
  const Worker* first_failed_ = nullptr;  // the first worker that failed while running
  long long teardown_started_ns_ = 0;      // wall clock (as error files have it) of the first stop
};

// Whether a server could listen on 127.0.0.1:port now. SO_REUSEADDR like c10d's TCPStore, so
// the previous attempt's connections lingering in TIME_WAIT do not count as a user of the port.
bool loopback_port_is_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return bound;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "(unknown host)";
  return name;
}

// The whole run: the attempts, and what lives across them.
class Session {
 public:
  explicit Session(const LaunchOptions& options)
      : options_(options), signals_(caught_signals(options)) {
    if (options_.log_dir.empty()) error_dir_ = make_error_dir();
  }
  ~Session() { remove_error_dir(); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int run() {
    setup_ = worker_setup();
    if (options_.rdzv_backend == "c10d") return run_rendezvous();
    const Environment shared = shared_environment();
    Assignment assignment;
    assignment.master_addr = options_.standalone ? "127.0.0.1" : options_.master_addr;
    assignment.master_port = options_.standalone ? pick_free_port() : options_.master_port;
    assignment.node_rank = options_.node_rank;
    assignment.nnodes = options_.nnodes;
    assignment.world_size = options_.nnodes * options_.nproc_per_node;
    assignment.base_rank = options_.node_rank * options_.nproc_per_node;
    int& master_port = assignment.master_port;

    for (int attempt = 0;; ++attempt) {
      assignment.attempt = attempt;
      assignment.restart_count = attempt;
      AttemptOutcome outcome = Job(options_, assignment, shared, setup_, error_dir_, watchdog_, signals_).run();
      if (outcome.received_signal != 0) return finish(128 + outcome.received_signal);
      if (!outcome.worker_failed) return finish(0);
      if (attempt >= options_.max_restarts) {
        report_root_cause(attempt, outcome.first_failure);
        return finish(1);
      }
      // A stop request that arrived once the attempt was over still rules out a restart.
      if (const int stop_signal = pending_stop_signal()) {
        say("received " + signal_name(stop_signal) + "; not restarting the workers");
        return finish(128 + stop_signal);
      }
      const FailedWorker& failure = outcome.first_failure;
      say("rank " + std::to_string(failure.global_rank) + " failed (" +
          failure.exit_text + "); restarting all workers (restart " + std::to_string(attempt + 1) + " of " +
          std::to_string(options_.max_restarts) + ")");
      if (options_.standalone && !loopback_port_is_free(master_port)) {
        const int previous_port = master_port;
        master_port = pick_free_port();
        say("port " + std::to_string(previous_port) +
            " on 127.0.0.1 is taken now; the restarted workers use port " +
            std::to_string(master_port));
      }
    }
  }

 private:
  // The whole run with the c10d rendezvous: every round's place in the job comes from the
  // agents' store, which one of the agents hosts.
  int run_rendezvous() {
    const Environment shared = shared_environment();
    std::string host = options_.rdzv_endpoint;
    int port = 29400;
    const size_t colon = host.rfind(':');
    if (colon != std::string::npos) {
      port = std::atoi(host.c_str() + colon + 1);
      host = host.substr(0, colon);
    }
    RdzvConfig config;
    config.run_id = options_.run_id;
    config.min_nodes = options_.min_nodes;
    config.max_nodes = options_.nnodes;
    config.max_restarts = options_.max_restarts;
    config.join_timeout = options_.join_timeout_seconds;
    config.last_call_timeout = options_.last_call_timeout_seconds;
    config.heartbeat_timeout = options_.heartbeat_timeout_seconds;
    std::string secret_file = options_.rdzv_secret_file;
    if (secret_file.empty() && std::getenv("DDP_RDZV_SECRET_FILE") != nullptr) secret_file = std::getenv("DDP_RDZV_SECRET_FILE");
    if (!secret_file.empty()) config.secret = load_rdzv_secret(secret_file);
    std::string why;
    int error_number = 0;
    // The agent on the endpoint's host hosts the store (the first one there to bind it); the
    // store listens on that address only. It lives as long as this ddprun.
    std::unique_ptr<RdzvServer> server = RdzvServer::try_bind(host, port, config, &why, &error_number);
    if (server) {
      say("hosting the rendezvous store on " + host + ":" + std::to_string(port) + " (run id '" + options_.run_id +
          "', " + std::to_string(options_.min_nodes) + ".." + std::to_string(options_.nnodes) + " nodes)");
      if (config.secret.empty()) {
        say("warning: the rendezvous store has no secret: anyone who can reach " + host + ":" + std::to_string(port) +
            " can join this job or end it, as with torchrun's; give every node the same --rdzv-secret-file "
            "(docs/security.md)");
      }
    } else if (error_number != EADDRINUSE && error_number != EADDRNOTAVAIL) {
      say("cannot host the rendezvous store on " + host + ":" + std::to_string(port) + " (" + why +
          "); joining it as a client");
    }
    if (options_.node_rank_given) say("--node-rank is ignored with --rdzv-backend c10d: the rendezvous assigns node ranks");
    RdzvClient client(host, port, options_.local_addr, options_.monitor_interval_seconds,
                      options_.heartbeat_timeout_seconds, config.secret);
    client.join(options_.run_id, host_name(), options_.nproc_per_node, server != nullptr,
                options_.join_timeout_seconds);
    client.start_heartbeat();
    auto end_job = [&](int code) {
      // The others may still be polling for the outcome: the store goes when they know it.
      if (server) server->wait_until_everyone_knows(options_.heartbeat_timeout_seconds + 1);
      return finish(code);
    };

    int last_round = -1;
    while (true) {
      RdzvView view;
      if (const int stop_signal = wait_for_round(client, last_round, &view)) {
        say("received " + signal_name(stop_signal) + "; leaving the job");
        client.leave();
        return finish(128 + stop_signal);
      }
      if (view.kind == RdzvView::kDone) return end_job(0);
      if (view.kind == RdzvView::kFail) {
        std::string block;
        std::stringstream lines(view.text);
        for (std::string line; std::getline(lines, line);) block += "ddprun: " + line + "\n";
        console_write(STDERR_FILENO, block, /*own=*/true);
        return end_job(1);
      }
      if (view.kind != RdzvView::kRound) {
        say(view.text);
        return finish(1);
      }
      Assignment assignment;
      assignment.attempt = view.round;
      assignment.restart_count = view.restart_count;
      assignment.node_rank = view.node_rank;
      assignment.nnodes = view.nnodes;
      assignment.world_size = view.world_size;
      assignment.base_rank = view.base_rank;
      assignment.master_addr = view.master_addr;
      assignment.master_port = view.master_port;
      say("rendezvous round " + std::to_string(view.round) + " (" + view.text + "): node rank " +
          std::to_string(view.node_rank) + " of " + std::to_string(view.nnodes) + ", ranks " +
          std::to_string(view.base_rank) + ".." + std::to_string(view.base_rank + options_.nproc_per_node - 1) +
          " of world size " + std::to_string(view.world_size) + ", master " + view.master_addr + ":" +
          std::to_string(view.master_port));
      AttemptOutcome outcome =
          Job(options_, assignment, shared, setup_, error_dir_, watchdog_, signals_, &client).run();
      last_round = view.round;
      if (outcome.received_signal != 0) {
        client.report(view.round, "signal", {signal_name(outcome.received_signal)});
        return finish(128 + outcome.received_signal);
      }
      if (outcome.store_lost) return finish(1);
      if (outcome.worker_failed) {
        const FailedWorker& f = outcome.first_failure;
        const bool recorded = f.record.present;
        client.report(view.round, "failed",
                      {std::to_string(f.global_rank), std::to_string(f.local_rank), std::to_string(f.pid),
                       f.exit_text, f.last_line, f.log_path, recorded ? "1" : "0",
                       recorded ? f.record.message : "", recorded && f.record.consequence ? "1" : "0",
                       std::to_string(recorded ? f.record.timestamp_ns : 0), host_name()});
      } else {
        client.report(view.round, outcome.stopped_by_rendezvous ? "stopped" : "success", {});
      }
    }
  }

  // Waits for this node's next round (or the job's end). Returns a stop signal if ddprun was
  // asked to stop meanwhile, else 0 with *view set.
  int wait_for_round(RdzvClient& client, int& last_round, RdzvView* view) {
    std::string last_wait_text;
    while (true) {
      client.mark_supervisor_alive();
      for (int signal_number : signals_.drain()) {
        if (signal_number != SIGCHLD && signal_number != SIGUSR1) return signal_number;
      }
      *view = client.view();
      if (view->kind == RdzvView::kRound && view->round > last_round) return 0;
      if (view->kind == RdzvView::kStop && view->round > last_round) {
        // A round that formed and was stopped before we saw it: we are in it, so we end it.
        say("rendezvous round " + std::to_string(view->round) +
            " was stopped before this node started its workers: " + view->text);
        client.report(view->round, "stopped", {});
        last_round = view->round;
        continue;
      }
      if (view->kind == RdzvView::kDone || view->kind == RdzvView::kFail || view->kind == RdzvView::kLost) return 0;
      if (client.store_lost()) {
        view->kind = RdzvView::kLost;
        view->text = "lost the rendezvous store at " + client.endpoint() + ": no answer for " +
                     format_seconds(std::round(client.seconds_since_answer() * 10) / 10) +
                     " s (the ddprun hosting it is gone, or the network is cut)";
        return 0;
      }
      if (view->kind == RdzvView::kWait && view->text != last_wait_text && last_round < 0) {
        last_wait_text = view->text;
        say("waiting for the rendezvous at " + client.endpoint() + ": " + view->text);
      }
      std::vector<pollfd> fds = {{signals_.read_fd(), POLLIN, 0}, {client.wake_fd(), POLLIN, 0}};
      console_add_poll_fds(fds);
      if (::poll(fds.data(), fds.size(), 200) > 0 && fds[1].revents != 0) client.drain_wake();
      console_flush();
    }
  }

  // The environment every worker of every attempt shares.
  Environment shared_environment() const {
    Environment environment = Environment::inherited();
    environment.set(ddp::launch_env::kLocalWorldSize, std::to_string(options_.nproc_per_node));
    environment.set("ROLE_NAME", options_.role);
    environment.set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
    environment.set("TORCHELASTIC_SIGNALS_TO_HANDLE", options_.signals_to_handle);
    // Rank 0 of the workers hosts their store (ddp's ProcessGroup, torch's env://); ddprun hosts
    // none, unlike torchrun's agent, so a worker must not wait for one.
    environment.set(ddp::launch_env::kUseAgentStore, "False");
    if (std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr) {
      environment.set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
    }
    environment.set(ddp::launch_env::kRunId, options_.run_id);
    environment.set(ddp::launch_env::kDdpRunId, options_.run_id);
    if (setup_.omp_threads_from_cpus) {
      say("OMP_NUM_THREADS is not set; with --cpu-bind cores, setting it for each of the " +
          std::to_string(options_.nproc_per_node) +
          " workers to the number of CPUs it is bound to, so they use their own CPUs and no others; "
          "please further tune it for your application as needed");
    } else if (std::getenv("OMP_NUM_THREADS") == nullptr && options_.nproc_per_node > 1) {
      // Each worker's OpenMP pool would otherwise take every core, oversubscribing the node.
      environment.set("OMP_NUM_THREADS", "1");
      say("OMP_NUM_THREADS is not set; setting it to 1 for each of the " +
          std::to_string(options_.nproc_per_node) +
          " workers by default, as torchrun does, to avoid your system being overloaded; please further "
          "tune it for your application as needed");
    }
    return environment;
  }

  // Once per run: where the streams' files go, which ranks the console shows, and the CPUs.
  WorkerSetup worker_setup() const {
    WorkerSetup setup;
    setup.console_local_ranks = parse_local_ranks(options_.local_ranks_filter);
    const CpuBindingPlan binding =
        plan_cpu_binding(options_.numa_binding, options_.cpu_bind, options_.nproc_per_node);
    for (const std::string& note : binding.notes) say(note);
    setup.cpus_by_local_rank = binding.by_local_rank;
    setup.omp_threads_from_cpus = options_.cpu_bind == "cores" && std::getenv("OMP_NUM_THREADS") == nullptr;
    const bool some_stream_to_file = options_.redirects != "0" || options_.tee_spec != "0";
    if (options_.log_dir.empty() && !some_stream_to_file) return setup;
    // As torchrun: without --log-dir, the streams' files go to a fresh temporary directory.
    std::string root = options_.log_dir;
    if (root.empty()) root = make_temp_dir("torchelastic_");
    setup.stream_log_dir = make_temp_dir(options_.run_id + "_", root);
    if (options_.log_dir.empty()) {
      say("redirected and teed output goes to " + setup.stream_log_dir + "/attempt_<A>/<local rank>/");
    }
    return setup;
  }

  // mkdtemp of <parent>/<prefix>XXXXXX; parent defaults to $TMPDIR or /tmp.
  static std::string make_temp_dir(const std::string& prefix, std::string parent = "") {
    if (parent.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    std::string pattern = parent + "/" + prefix + "XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) throw_errno("cannot create log directory '" + pattern + "'");
    return buffer.data();
  }

  // SIGINT, SIGTERM or SIGHUP delivered since the last attempt looked; 0 if none.
  int pending_stop_signal() {
    int stop_signal = 0;
    for (int signal_number : signals_.drain()) {
      if (signal_number != SIGCHLD && signal_number != SIGUSR1 && stop_signal == 0) stop_signal = signal_number;
    }
    return stop_signal;
  }

  void report_root_cause(int restarts_used, const FailedWorker& failure) const {
    std::string heading = "root cause (first failure of the last attempt):";
    std::string detail = "  last error line: " + failure.last_line;
    if (failure.record.present && !failure.record.consequence) {
      heading = "root cause (the earliest original error of the last attempt):";
      detail = "  error: " + failure.record.message;
    } else if (failure.record.present) {
      heading =
          "root cause (the earliest error of the last attempt; every recorded error is a "
          "consequence of another failure, such as a worker that died without a message):";
      detail = "  error (a consequence): " + failure.record.message;
    }
    std::vector<std::string> lines = {
        "job failed after " + std::to_string(restarts_used) + " restart(s)",
        heading,
        "  rank: " + std::to_string(failure.global_rank) + " (local rank " +
            std::to_string(failure.local_rank) + "), host: " + host_name() +
            ", pid: " + std::to_string(failure.pid),
        "  exit: " + failure.exit_text,
        detail,
    };
    if (!failure.log_path.empty()) lines.push_back("  log: " + failure.log_path);
    std::string block;
    for (const std::string& line : lines) block += "ddprun: " + line + "\n";
    console_write(STDERR_FILENO, block, /*own=*/true);  // queued whole: no worker line lands inside
  }

  int finish(int exit_code) {
    // Every worker was reaped and forgotten; the watchdog may go.
    watchdog_.dismiss();
    remove_error_dir();
    return exit_code;
  }

  // Without --log-dir, the workers' error files live in a private directory that goes with
  // the session.
  static std::string make_error_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/ddprun-errors-XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) throw_errno("cannot create a directory for the workers' error files");
    return buffer.data();
  }

  void remove_error_dir() {
    if (error_dir_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(error_dir_, ignored);
    error_dir_.clear();
  }

  const LaunchOptions& options_;
  WorkerSetup setup_;
  // Forked first, before any handler or worker pipe exists that it should not inherit.
  Watchdog watchdog_;
  SignalPipe signals_;
  std::string error_dir_;  // without --log-dir: the workers' error files
};

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

}  // namespace

void validate(const LaunchOptions& options) {
  auto invalid = [](const std::string& flag, const std::string& value, const std::string& why) {
    return std::invalid_argument("invalid value '" + value + "' for " + flag + ": " + why);
  };
  if (options.nproc_per_node < 1) {
    throw invalid("--nproc-per-node", std::to_string(options.nproc_per_node), "must be at least 1");
  }
  if (options.nnodes < 1) {
    throw invalid("--nnodes", std::to_string(options.nnodes), "must be at least 1");
  }
  // Every rank must fit RANK and WORLD_SIZE, which workers read as an int.
  const long long world_size = static_cast<long long>(options.nnodes) * options.nproc_per_node;
  if (world_size > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("--nnodes " + std::to_string(options.nnodes) + " times --nproc-per-node " +
                                std::to_string(options.nproc_per_node) + " is " + std::to_string(world_size) +
                                " workers, more than the limit of " +
                                std::to_string(std::numeric_limits<int>::max()) + " ranks in a job");
  }
  const bool c10d = options.rdzv_backend == "c10d";
  if (options.rdzv_backend != "static" && !c10d) {
    throw invalid("--rdzv-backend", options.rdzv_backend, "expected 'c10d' or 'static'");
  }
  if (c10d && options.rdzv_endpoint.empty()) {
    throw std::invalid_argument("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]");
  }
  if (!c10d && !options.rdzv_secret_file.empty()) {
    throw std::invalid_argument("--rdzv-secret-file protects the c10d rendezvous store; it needs --rdzv-backend c10d");
  }
  if (c10d && options.standalone) {
    throw std::invalid_argument("--standalone runs a single node without a rendezvous; drop it or --rdzv-backend c10d");
  }
  if (!c10d && options.min_nodes != options.nnodes) {
    throw invalid("--nnodes", std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes),
                  "MIN:MAX needs --rdzv-backend c10d");
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
  }
  IgnoreSigpipe ignore_sigpipe;  // a closed stdout must cost us output, not the job
  return Session(options_).run();
}

}  // namespace ddprun
