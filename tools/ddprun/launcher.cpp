#include "launcher.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
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
#include <memory>
#include <sstream>
#include <stdexcept>

#include "error_record.h"
#include "line_forwarder.h"
#include "posix_util.h"
#include "rdzv.h"
#include "signal_pipe.h"
#include "watchdog.h"

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

// One attempt of the job: start the workers, watch them and their output, stop them.
class Job {
 public:
  // The Job borrows everything; all of it must outlive the Job.
  Job(const LaunchOptions& options, const Assignment& assignment, const Environment& shared_environment,
      const std::string& error_dir, Watchdog& watchdog, SignalPipe& signals, RdzvClient* client = nullptr)
      : options_(options),
        assignment_(assignment),
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
    shared.set("MASTER_ADDR", assignment_.master_addr);
    shared.set("MASTER_PORT", std::to_string(assignment_.master_port));
    shared.set("TORCHELASTIC_RESTART_COUNT", std::to_string(assignment_.restart_count));
    shared.set("DDPRUN_ATTEMPT", std::to_string(assignment_.attempt));
    shared.set("WORLD_SIZE", std::to_string(assignment_.world_size));
    shared.set("GROUP_RANK", std::to_string(assignment_.node_rank));
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
    for (Worker& worker : workers_) {
      Environment environment = shared;
      environment.set("RANK", std::to_string(worker.global_rank));
      environment.set("LOCAL_RANK", std::to_string(worker.local_rank));
      environment.set("ROLE_RANK", std::to_string(worker.global_rank));
      // Where the worker records its first error (torchrun's convention), so that the summary
      // names the earliest original error rather than whichever worker exited first.
      worker.error_file = error_file_for(worker);
      ::unlink(worker.error_file.c_str());
      environment.set("TORCHELASTIC_ERROR_FILE", worker.error_file);
      // ddp writes its collective traces here (trace_rank<R>.jsonl) when a
      // collective fails, next to the attempt's logs.
      if (!options_.log_dir.empty()) environment.set("DDP_LOG_DIR", attempt_log_dir(options_.log_dir, attempt_));
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
      int fd = ::open(worker.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC,
                      0644);
      if (fd < 0) throw_errno("cannot create log file '" + worker.log_path + "'");
      worker.log_file = FileDescriptor(fd);
    }
  }

  // Where the lines of one of the worker's streams go.
  std::vector<LineSink> sinks_for(const Worker& worker, int console_fd, int tee_bit) const {
    const std::string prefix =
        options_.prefix_output ? "[rank" + std::to_string(worker.global_rank) + "]: " : "";
    if (options_.log_dir.empty()) return {LineSink{console_fd, prefix}};
    std::vector<LineSink> sinks{LineSink{worker.log_file.get(), ""}};
    if ((options_.tee & tee_bit) != 0) sinks.push_back(LineSink{console_fd, prefix});
    return sinks;
  }

  void spawn(Worker& worker, const Environment& environment) {
    // Everything the child needs is built before fork, so the child only makes system calls.
    std::vector<char*> argv = c_string_array(options_.command);
    std::vector<char*> envp = c_string_array(environment.entries());
    const std::string exec_failure = "ddprun: cannot execute '" + options_.command[0] + "': ";
    std::vector<LineSink> out_sinks = sinks_for(worker, STDOUT_FILENO, kTeeStdout);
    std::vector<LineSink> err_sinks = sinks_for(worker, STDERR_FILENO, kTeeStderr);

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
    while (true) {
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
    for (size_t i = first_stream; i < fds.size(); ++i) {
      if (fds[i].revents != 0) fd_streams[i - first_stream]->read_some();
    }
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

  AttemptOutcome report_outcome() const {
    AttemptOutcome outcome;
    outcome.received_signal = received_signal_;
    outcome.worker_failed = first_failed_ != nullptr;
    outcome.stopped_by_rendezvous = stopped_by_rendezvous_;
    outcome.store_lost = store_lost_;
    if (outcome.received_signal == 0 && !outcome.worker_failed && !stopped_by_rendezvous_ && !store_lost_)
      return outcome;
    for (const Worker& worker : workers_) {
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
      say("stopped " + worker.label() + ": " + how);
    }
    if (received_signal_ != 0)
      say("received " + signal_name(received_signal_) + ", workers stopped");
    if (first_failed_ != nullptr) {
      // The earliest original error any worker recorded; failing that, the earliest recorded
      // consequence; failing that, the first worker that failed.
      const Worker* root = first_failed_;
      ErrorRecord best;
      for (const Worker& worker : workers_) {
        ErrorRecord record = read_error_record(worker.error_file);
        if (!record.present) continue;
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
      failure.last_line = root->last_words();
      failure.log_path = root->log_path;
      failure.record = best;
    }
    return outcome;
  }

  const LaunchOptions& options_;
  const Assignment& assignment_;
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
      : options_(options), signals_({SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGUSR1}) {
    if (options_.log_dir.empty()) error_dir_ = make_error_dir();
  }
  ~Session() { remove_error_dir(); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int run() {
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
      AttemptOutcome outcome = Job(options_, assignment, shared, error_dir_, watchdog_, signals_).run();
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
          describe_exit(failure.exit_code, failure.term_signal) +
          "); restarting all workers (restart " + std::to_string(attempt + 1) + " of " +
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
    std::string why;
    int error_number = 0;
    // The agent on the endpoint's host hosts the store (the first one there to bind it); the
    // store listens on that address only. It lives as long as this ddprun.
    std::unique_ptr<RdzvServer> server = RdzvServer::try_bind(host, port, config, &why, &error_number);
    if (server) {
      say("hosting the rendezvous store on " + host + ":" + std::to_string(port) + " (run id '" + options_.run_id +
          "', " + std::to_string(options_.min_nodes) + ".." + std::to_string(options_.nnodes) + " nodes)");
    } else if (error_number != EADDRINUSE && error_number != EADDRNOTAVAIL) {
      say("cannot host the rendezvous store on " + host + ":" + std::to_string(port) + " (" + why +
          "); joining it as a client");
    }
    if (options_.node_rank_given) say("--node-rank is ignored with --rdzv-backend c10d: the rendezvous assigns node ranks");
    RdzvClient client(host, port, options_.local_addr, options_.monitor_interval_seconds,
                      options_.heartbeat_timeout_seconds);
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
        write_all(STDERR_FILENO, block);
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
          Job(options_, assignment, shared, error_dir_, watchdog_, signals_, &client).run();
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
                       describe_exit(f.exit_code, f.term_signal), f.last_line, f.log_path, recorded ? "1" : "0",
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
      pollfd fds[2] = {{signals_.read_fd(), POLLIN, 0}, {client.wake_fd(), POLLIN, 0}};
      if (::poll(fds, 2, 200) > 0 && fds[1].revents != 0) client.drain_wake();
    }
  }

  // The environment every worker of every attempt shares.
  Environment shared_environment() const {
    Environment environment = Environment::inherited();
    environment.set("LOCAL_WORLD_SIZE", std::to_string(options_.nproc_per_node));
    environment.set("ROLE_NAME", "default");
    environment.set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
    environment.set("TORCHELASTIC_RUN_ID", options_.run_id);
    environment.set("DDP_RUN_ID", options_.run_id);
    if (std::getenv("OMP_NUM_THREADS") == nullptr && options_.nproc_per_node > 1) {
      // Each worker's OpenMP pool would otherwise take every core, oversubscribing the node.
      environment.set("OMP_NUM_THREADS", "1");
      say("OMP_NUM_THREADS is not set; giving each of the " +
          std::to_string(options_.nproc_per_node) +
          " workers OMP_NUM_THREADS=1 so they do not oversubscribe the CPUs. Set it yourself to "
          "tune performance.");
    }
    return environment;
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
        "  exit: " + describe_exit(failure.exit_code, failure.term_signal),
        detail,
    };
    if (!failure.log_path.empty()) lines.push_back("  log: " + failure.log_path);
    std::string block;
    for (const std::string& line : lines) block += "ddprun: " + line + "\n";
    write_all(STDERR_FILENO, block);  // one write: the block stays together
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
  const bool c10d = options.rdzv_backend == "c10d";
  if (options.rdzv_backend != "static" && !c10d) {
    throw invalid("--rdzv-backend", options.rdzv_backend, "expected 'c10d' or 'static'");
  }
  if (c10d && options.rdzv_endpoint.empty()) {
    throw std::invalid_argument("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]");
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
  if (options.run_id.empty()) {
    throw invalid("--rdzv-id", options.run_id, "expected a non-empty id");
  }
  if (options.standalone && options.nnodes != 1) {
    throw std::invalid_argument("--standalone runs a single node, but --nnodes is " +
                                std::to_string(options.nnodes) + "; drop one of them");
  }
  if (options.monitor_interval_seconds <= 0 || !std::isfinite(options.monitor_interval_seconds)) {
    throw invalid("--monitor-interval", format_seconds(options.monitor_interval_seconds),
                  "expected a number of seconds > 0");
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
