#include "job.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <thread>

#include "console.h"
#include "etcd_rendezvous.h"
#include "launcher_test_seams.h"
#include "rdzv.h"
#include "signal_pipe.h"
#include "watchdog.h"

namespace ddprun {
namespace {

std::string host_name_for_reports() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "unknown host";
  return name;
}

// After the final SIGKILL, how long we keep reading pipes that some process which left the
// workers' process groups may still hold open. Their data is not worth hanging for.
constexpr std::chrono::seconds kAbandonPipesAfterKill{2};

// Killed by a signal while ddprun was stopping the workers (ddprun's SIGTERM or SIGKILL, or
// a signal it forwarded).
static bool stopped_by_teardown(const Worker& worker) {
  return worker.exited_while_stopping && worker.term_signal != 0;
}
// Stopped by the teardown after recording an original error of its own before it began.
static bool stopped_after_own_error(const Worker& worker, const ErrorRecord& record) {
  return stopped_by_teardown(worker) && record.present && !record.consequence;
}

}  // namespace

Job::Job(const LaunchOptions& options, const Assignment& assignment, const Environment& shared_environment,
         const WorkerSetup& setup, const std::string& error_dir, Watchdog& watchdog, SignalPipe& signals,
         RdzvClient* client)
    : options_(options),
      assignment_(assignment),
      setup_(setup),
      attempt_(assignment.attempt),
      error_dir_(error_dir),
      shared_environment_(shared_environment),
      watchdog_(watchdog),
      signals_(signals),
      client_(client) {}

AttemptOutcome Job::run() {
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

void Job::watch_until_done() {
  // A test seam (tests/test_ddprun_console.cpp, through the launcher the tests build): hold this
  // loop once, as a call that blocks would, so that a test can show the heartbeat then stops
  // speaking for this node. Zero in the shipped ddprun.
  if (const auto stall = detail::test_seams().stall_supervisor; stall.count() > 0 && client_ != nullptr) {
    std::this_thread::sleep_for(stall);
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
void Job::check_rendezvous() {
  if (etcd_ != nullptr && stage_ == Stage::kRunning && !options_.fault_tolerance) {
    const std::string failure = etcd_->other_failure();
    if (!failure.empty()) {
      say("stopping the workers on this node: another node failed: " + failure);
      stopped_by_rendezvous_ = true;
      stop_workers(SIGTERM);
    }
  }
  if (client_ == nullptr || stage_ != Stage::kRunning) return;
  if (options_.fault_tolerance) {
    // The workers settle membership among themselves: a lost node or a lost store host is
    // theirs to survive, not a reason to stop this node's.
    const RdzvView view = client_->view();
    const bool lost = client_->store_lost();
    if ((lost || view.kind == RdzvView::kStop || view.kind == RdzvView::kLost || view.kind == RdzvView::kFail) &&
        !rendezvous_change_said_) {
      rendezvous_change_said_ = true;
      say("fault tolerance: " +
          (lost ? "lost the rendezvous store at " + client_->endpoint() : "the rendezvous says: " + view.text) +
          "; this node's workers go on");
    }
    return;
  }
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

bool Job::any_stream_open() const {
  for (const Worker& worker : workers_) {
    for (const LineForwarder& stream : worker.streams) {
      if (stream.is_open()) return true;
    }
  }
  return false;
}

// Sleeps until a signal, worker output, or the current stage's deadline.
void Job::wait_for_events() {
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
  if (client_ != nullptr || etcd_ != nullptr) {
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

void Job::handle_signals() {
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

void Job::collect_exits() {
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
  if (options_.fault_tolerance && stage_ == Stage::kRunning) {
    handle_fault_tolerant_exits(newly_failed);
    return;
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
  if (first && etcd_ != nullptr) {
    const Worker& failed = *newly_failed.front();
    etcd_->notify_failing("rank " + std::to_string(failed.global_rank) + " on node " +
                          std::to_string(assignment_.node_rank) + " (" + host_name_for_reports() + ", pid " +
                          std::to_string(failed.pid) + "): " + describe_exit(failed.exit_code, failed.term_signal));
  }
  stop_workers(SIGTERM);
}

namespace {

// The furthest training step a worker's last lines name ("step 17", "step=17", "step: 17"),
// as ddp's fault-tolerant loop logs it; empty when none does. The largest over both streams:
// an old membership line on stderr ("... failed at step 1") must not hide the step lines
// stdout printed since.
std::string last_step_named(const Worker& worker) {
  static const std::regex kStep(R"((?:^|[^A-Za-z_])step[ =:]+(\d+))", std::regex::icase);
  std::string furthest;
  for (const LineForwarder& stream : worker.streams) {
    for (const std::string& line : stream.recent_lines()) {
      for (auto it = std::sregex_iterator(line.begin(), line.end(), kStep); it != std::sregex_iterator(); ++it) {
        const std::string step = (*it)[1].str();
        if (furthest.empty() || step.size() > furthest.size() || (step.size() == furthest.size() && step > furthest)) {
          furthest = step;
        }
      }
    }
  }
  return furthest;
}

// Whether a worker that ended had got past its start-up: ddp's fault-tolerance layer created
// its progress file at its first committed step, or it printed a membership line (it was let
// into a generation), or its last lines name a training step. Any sign counts: calling a worker
// that trained a start-up failure would end the job, while the opposite mistake only costs a
// restart.
bool took_part_in_training(const Worker& worker) {
  if (!worker.progress_file.empty() && ::access(worker.progress_file.c_str(), F_OK) == 0) return true;
  for (const LineForwarder& stream : worker.streams) {
    if (stream.marker_seen()) return true;
  }
  return !last_step_named(worker).empty();
}

}  // namespace

// --fault-tolerance: a failed worker is started again, as a new replica, while the others train
// on. With --ft-replica-size S its replica group (S consecutive local ranks sharing one replica
// id) cannot go on without it: the group's other members are killed at once and all S start
// again as the group's next incarnation, for one restart. Each failure is one line.
void Job::handle_fault_tolerant_exits(const std::vector<Worker*>& newly_failed) {
  for (Worker* worker : newly_failed) {
    // A member of a group that an earlier failure of this round already stopped: ddprun's own
    // doing, or a failure of its own that the group's restart already answers.
    if (worker->stopped_with_group) continue;
    if (first_failed_ == nullptr) first_failed_ = worker;
    for (LineForwarder& stream : worker->streams) stream.read_available();
    // Its children go with it, and its zombie at once: a job that restarts workers for days
    // must not collect one per restart. Nothing signals its group after this.
    ::killpg(worker->pid, SIGKILL);
    reap(*worker);
    // A usage error (a bad argument, a missing file) fails every incarnation the same way
    // before it trains; a crash by a signal, or a failure once training began, may not recur.
    const bool at_startup = worker->term_signal == 0 && !took_part_in_training(*worker);
    if (at_startup && worker->previous_startup_exit_code == worker->exit_code) {
      end_after_startup_failure(*worker);
      return;
    }
    const std::vector<Worker*> siblings = group_siblings(*worker);
    for (Worker* sibling : siblings) stop_with_its_group(*sibling);
    const std::string step = last_step_named(*worker);
    int running = 0;
    for (const Worker& other : workers_) running += other.exited ? 0 : 1;
    const int first = group_first_local_rank(worker->local_rank);
    const std::string group = "its replica group (local ranks " + std::to_string(first) + "-" +
                              std::to_string(first + options_.ft_replica_size - 1) + ")";
    const bool grouped = options_.ft_replica_size > 1;
    std::string line = "fault tolerance: " + worker->label() + " failed: " +
                       describe_exit(worker->exit_code, worker->term_signal) +
                       (step.empty() ? "" : " (its last step: " + step + ")");
    if (fault_restarts_used_ < options_.max_restarts) {
      ++fault_restarts_used_;
      say(line + (grouped ? "; restarting " + group : "; restarting it alone") + " as replica " +
          replica_id_for(worker->local_rank, worker->incarnation + 1) + " (restart " +
          std::to_string(fault_restarts_used_) + " of " + std::to_string(options_.max_restarts) + "); " +
          std::to_string(running) + " other worker(s) of this node go on");
      // The group's start-up failure is each new member's to repeat: whichever of them fails at
      // start-up alike, the group would never train.
      const int startup_exit_code = at_startup ? worker->exit_code : -1;
      std::vector<Worker*> members = siblings;
      members.push_back(worker);
      std::sort(members.begin(), members.end(),
                [](const Worker* a, const Worker* b) { return a->local_rank < b->local_rank; });
      for (Worker* member : members) {
        member->replaced = true;
        restart_as_next_incarnation(*member, startup_exit_code);
      }
    } else {
      worker->given_up = true;
      for (Worker* sibling : siblings) sibling->given_up = true;
      say(line + "; not restarting it (--max-restarts " + std::to_string(options_.max_restarts) + " used up)" +
          (grouped ? "; stopped the rest of " + group + " too" : "") + "; " + std::to_string(running) +
          " other worker(s) of this node go on");
    }
  }
}

std::vector<Worker*> Job::group_siblings(const Worker& failed) {
  std::vector<Worker*> siblings;
  if (options_.ft_replica_size == 1) return siblings;
  const int first = group_first_local_rank(failed.local_rank);
  for (Worker& other : workers_) {
    // The current incarnation of each other local rank of the group: earlier ones were
    // replaced, and a group given up stays given up.
    if (&other == &failed || other.replaced || other.given_up || other.stopped_with_group) continue;
    if (group_first_local_rank(other.local_rank) != first) continue;
    siblings.push_back(&other);
  }
  return siblings;
}

void Job::stop_with_its_group(Worker& sibling) {
  sibling.stopped_with_group = true;
  // Its children too, if it had exited already (finished, or failed in the same instant).
  ::killpg(sibling.pid, SIGKILL);
  if (!sibling.exited) {
    sibling.sigkilled_by_launcher = true;
    // As reap() does, keeping how it ended: it never failed in collect_exits()'s eyes.
    watchdog_.forget(sibling.pid);
    int status = 0;
    pid_t reaped = -1;
    while ((reaped = ::waitpid(sibling.pid, &status, 0)) < 0 && errno == EINTR) {
    }
    sibling.exited = true;
    sibling.reaped = true;
    if (reaped == sibling.pid && WIFEXITED(status)) {
      sibling.exit_code = WEXITSTATUS(status);
    } else {
      sibling.term_signal = reaped == sibling.pid && WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
    }
  } else {
    reap(sibling);
  }
  for (LineForwarder& stream : sibling.streams) stream.read_available();
}

// --fault-tolerance: `worker` failed at start-up as its previous incarnation did, with the
// same exit code. Restarting it again would only fail again, so the job ends, in one line.
void Job::end_after_startup_failure(Worker& worker) {
  startup_failed_ = &worker;
  worker.given_up = true;
  std::string where;
  if (!worker.log_path.empty()) {
    where = "its log: " + worker.log_path;
  } else if (!worker.stdout_path.empty() || !worker.stderr_path.empty()) {
    where = "its output: " + (worker.stdout_path.empty() ? "" : worker.stdout_path) +
            (!worker.stdout_path.empty() && !worker.stderr_path.empty() ? " and " : "") +
            (worker.stderr_path.empty() ? "" : worker.stderr_path);
  } else {
    where = "its output is on the console above (--log-dir DIR keeps each rank's in a file)";
  }
  std::string exit_text = describe_exit(worker.exit_code, worker.term_signal);
  if (worker.exit_code == 127) exit_text += " (the program could not be executed?)";
  const std::string previous =
      options_.ft_replica_size > 1 ? "its replica group's previous incarnation" : "its previous incarnation";
  say("fault tolerance: " + worker.label() + " failed at start-up again with " + exit_text + ", as " + previous +
      " did, and never trained (no committed step): it would fail the same way "
      "each time (a bad argument? a missing file?), so ddprun stops restarting it and ends the job; its last "
      "line: " + worker.last_words() + "; " + where);
  stop_workers(SIGTERM);
}

void Job::stop_workers(int signal_number) {
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
  for (const Worker& worker : workers_) {
    if (!worker.reaped) ::killpg(worker.pid, signal_number);
  }
}

// early: because ddprun was asked to stop, before the grace period was over.
void Job::kill_workers(bool early) {
  killed_early_ = early;
  for (Worker& worker : workers_) {
    if (!worker.exited) worker.sigkilled_by_launcher = true;
  }
  kill_all_groups();
  stage_ = Stage::kKilled;
  abandon_deadline_ = Clock::now() + kAbandonPipesAfterKill;
}

void Job::kill_all_groups() {
  for (const Worker& worker : workers_) {
    if (worker.pid > 0 && !worker.reaped) ::killpg(worker.pid, SIGKILL);
  }
}

void Job::reap_all() {
  for (Worker& worker : workers_) reap(worker);
}

void Job::reap(Worker& worker) {
  if (worker.pid <= 0 || worker.reaped) return;
  // Before the reap frees the id: the watchdog must never kill a group of that id again.
  watchdog_.forget(worker.pid);
  int status = 0;
  while (::waitpid(worker.pid, &status, 0) < 0 && errno == EINTR) {
  }
  worker.reaped = true;
}

AttemptOutcome Job::report_outcome() const {
  AttemptOutcome outcome;
  outcome.received_signal = received_signal_;
  outcome.worker_failed = first_failed_ != nullptr;
  outcome.startup_failure = startup_failed_ != nullptr && received_signal_ == 0;
  if (options_.fault_tolerance && first_failed_ != nullptr && received_signal_ == 0 && startup_failed_ == nullptr) {
    // The job goes on without those given up: it succeeds when the workers still running
    // finish, and fails only when none did.
    const bool some_finished = std::any_of(workers_.begin(), workers_.end(), [](const Worker& worker) {
      return worker.exited && !worker.failed() && !worker.replaced;
    });
    outcome.worker_failed = !some_finished;
    if (some_finished) return outcome;
  }
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
    failure.log_write_error = root->file_write_error();
    if (!failure.log_write_error.empty()) failure.recent_lines = root->recent_lines();
    failure.record = best;
  }
  return outcome;
}

}  // namespace ddprun
