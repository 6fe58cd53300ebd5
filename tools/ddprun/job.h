// One attempt of the job: start the workers (worker_setup.cpp), supervise them and their
// output, tear them all down when one fails or ddprun is asked to stop, and name the root
// cause (job.cpp). The Session (session.cpp) runs one Job per attempt.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <string>
#include <vector>

#include "error_record.h"
#include "launcher.h"
#include "line_forwarder.h"
#include "posix_util.h"
#include "worker_setup.h"

namespace ddprun {

class EtcdRendezvous;
class RdzvClient;
class SignalPipe;
class Watchdog;

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
  // Why one of its log files ends early ("'PATH': No space left on device"), and then its last
  // lines, which the summary quotes since no file holds them. Empty if its logs are whole.
  std::string log_write_error;
  std::vector<std::string> recent_lines;
  // The worker's recorded error (TORCHELASTIC_ERROR_FILE), when one was recorded.
  ErrorRecord record;
};

struct AttemptOutcome {
  int received_signal = 0;  // ddprun was asked to stop: never restart
  // Under --fault-tolerance: every worker failed for good (none of them finished), or one failed
  // at start-up twice alike (startup_failure).
  bool worker_failed = false;
  // Under --fault-tolerance: a worker that never trained failed at start-up again with its
  // predecessor's exit code, which ended the job; ddprun already said so in one line.
  bool startup_failure = false;
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
  // --fault-tolerance: this node's part of its workers' replica ids ("node0-5f3a9c21"), unique
  // to this ddprun so that a node started again never reuses one.
  std::string ft_node_id;
};

// One attempt of the job: start the workers, watch them and their output, stop them.
class Job {
 public:
  // The Job borrows everything; all of it must outlive the Job.
  Job(const LaunchOptions& options, const Assignment& assignment, const Environment& shared_environment,
      const WorkerSetup& setup, const std::string& error_dir, Watchdog& watchdog, SignalPipe& signals,
      RdzvClient* client = nullptr);

  AttemptOutcome run();

  // With --rdzv-backend etcd-v2: this node's first failure is told to the others, and (outside
  // --fault-tolerance) another node's stops this node's workers. Set before run().
  void set_etcd_rendezvous(EtcdRendezvous* rendezvous) { etcd_ = rendezvous; }

 private:
  enum class Stage {
    kRunning,   // workers are running normally
    kStopping,  // workers were sent SIGTERM (or a forwarded signal); waiting for the grace period
    kKilled,    // workers were sent SIGKILL
  };

  using Clock = std::chrono::steady_clock;

  // Setting the workers up (worker_setup.cpp).
  void start_workers();
  // --fault-tolerance: starts `failed`'s local rank again as its next incarnation (alone, or
  // as one member of its replica group). startup_exit_code: the exit code of the group's
  // failure if it was at start-up, else -1.
  void restart_as_next_incarnation(Worker& failed, int startup_exit_code);
  // --ft-replica-size: the first local rank of `local_rank`'s replica group, and the
  // DDP_FT_REPLICA_ID of that group's `incarnation`.
  int group_first_local_rank(int local_rank) const;
  std::string replica_id_for(int local_rank, int incarnation) const;
  void set_progress_file(Worker& worker) const;
  Environment environment_for(const Worker& worker) const;
  std::string error_file_for(const Worker& worker) const;
  void open_log_files();
  void open_stream_files();
  const CpuList& cpus_of(const Worker& worker) const;
  std::vector<LineSink> sinks_for(const Worker& worker, int console_fd, int stream) const;
  void spawn(Worker& worker, const Environment& environment);

  // Supervising and tearing down (job.cpp).
  void watch_until_done();
  void check_rendezvous();
  bool any_stream_open() const;
  void wait_for_events();
  void handle_signals();
  void collect_exits();
  void handle_fault_tolerant_exits(const std::vector<Worker*>& newly_failed);
  void end_after_startup_failure(Worker& worker);
  // --ft-replica-size: the current members of `failed`'s replica group other than `failed`.
  std::vector<Worker*> group_siblings(const Worker& failed);
  // Kills the group of a sibling of a failed worker at once and reaps it: it cannot train without
  // the failed one, so no grace period.
  void stop_with_its_group(Worker& sibling);
  void reap(Worker& worker);
  void stop_workers(int signal_number);
  void kill_workers(bool early);
  void kill_all_groups();
  void reap_all();
  AttemptOutcome report_outcome() const;

  const LaunchOptions& options_;
  const Assignment& assignment_;
  const WorkerSetup& setup_;
  FileDescriptor filtered_stdout_;  // torchrun's attempt_<A>/filtered_stdout.log
  FileDescriptor filtered_stderr_;
  std::string filtered_stdout_path_;
  std::string filtered_stderr_path_;
  const int attempt_;
  const std::string& error_dir_;
  const Environment& shared_environment_;
  Watchdog& watchdog_;
  SignalPipe& signals_;
  RdzvClient* client_;
  EtcdRendezvous* etcd_ = nullptr;
  bool stopped_by_rendezvous_ = false;
  bool store_lost_ = false;
  // A deque: restarts under --fault-tolerance add incarnations while pointers to the earlier
  // ones (first_failed_) stay valid. A replaced worker stays, reaped already, for the summary.
  std::deque<Worker> workers_;
  Environment workers_environment_;  // what every worker shares, set by start_workers()
  int fault_restarts_used_ = 0;
  bool rendezvous_change_said_ = false;
  Stage stage_ = Stage::kRunning;
  Clock::time_point kill_deadline_;
  Clock::time_point abandon_deadline_;
  int received_signal_ = 0;
  bool killed_early_ = false;
  const Worker* first_failed_ = nullptr;  // the first worker that failed while running
  const Worker* startup_failed_ = nullptr;  // --fault-tolerance: see AttemptOutcome::startup_failure
  long long teardown_started_ns_ = 0;      // wall clock (as error files have it) of the first stop
};

}  // namespace ddprun
