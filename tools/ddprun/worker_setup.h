// How one worker process is prepared: its environment, where its output goes (log files,
// torchrun's stream files, the console), the CPUs it is bound to, and the fork and exec that
// start it. The Job (job.h) owns the workers; its members that set them up live in
// worker_setup.cpp.
#pragma once

#include <sys/types.h>

#include <set>
#include <string>
#include <vector>

#include "cpu_binding.h"
#include "line_forwarder.h"
#include "posix_util.h"

namespace ddprun {

// KEY=VALUE strings as execve wants them; set() replaces an existing KEY.
class Environment {
 public:
  static Environment inherited();

  void set(const std::string& key, const std::string& value);

  const std::vector<std::string>& entries() const { return entries_; }

 private:
  std::vector<std::string> entries_;
};

// One worker process of an attempt, as its Job knows it.
struct Worker {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;           // also the id of the worker's own process group
  FileDescriptor log_file;  // with --log-dir: where both streams go
  std::string log_path;
  // torchrun's <local_rank>/stdout.log and stderr.log: the redirected and teed streams.
  FileDescriptor stdout_file;
  FileDescriptor stderr_file;
  std::string stdout_path;
  std::string stderr_path;
  std::string error_file;  // its TORCHELASTIC_ERROR_FILE
  std::vector<LineForwarder> streams;  // its stdout and stderr, in that order
  // Observed exiting. The zombie is kept until the attempt ends, so that its pid, the id of its
  // process group, cannot be reused while ddprun may still signal that group; under
  // --fault-tolerance a failed worker's group is killed at once and the zombie reaped then.
  bool exited = false;
  bool reaped = false;  // its group is never signalled again
  int exit_code = -1;
  int term_signal = 0;
  bool exited_while_stopping = false;
  bool sigkilled_by_launcher = false;
  // --fault-tolerance: which start of this local rank it is (0 first), its DDP_FT_REPLICA_ID,
  // and whether a later incarnation took its place or it failed with no restart left.
  int incarnation = 0;
  std::string replica_id;
  bool replaced = false;
  bool given_up = false;
  // --ft-replica-size: ddprun killed it because another member of its replica group failed; its
  // end is not a failure of its own.
  bool stopped_with_group = false;
  // --fault-tolerance: the file DDP_FT_PROGRESS_FILE names, which ddp's fault-tolerance layer
  // creates at the worker's first committed step; and, for a restarted incarnation, the exit
  // code of the one before it if that one failed at start-up (never trained), else -1.
  std::string progress_file;
  int previous_startup_exit_code = -1;

  bool failed() const { return term_signal != 0 || exit_code != 0; }
  std::string label() const {
    return "rank " + std::to_string(global_rank) + " (local rank " + std::to_string(local_rank) +
           ", pid " + std::to_string(pid) + (replica_id.empty() ? "" : ", replica " + replica_id) + ")";
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
  // Why one of its files stopped getting lines (a full disk); empty if none did.
  std::string file_write_error() const {
    for (const LineForwarder& stream : streams) {
      if (!stream.file_write_error().empty()) return stream.file_write_error();
    }
    return "";
  }
  // Its last lines with text, from stderr if it wrote any there, else from stdout.
  std::vector<std::string> recent_lines() const {
    for (size_t i = streams.size(); i-- > 0;) {
      if (!streams[i].recent_lines().empty()) return streams[i].recent_lines();
    }
    return {};
  }
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

// <log_dir>/attempt_<A>, where ddprun's per-rank logs and error files of attempt A go.
std::string attempt_log_dir(const std::string& log_dir, int attempt);

// mkdir -p, with an error that names the directory.
void create_directories(const std::string& path);

// --virtual-local-rank: the one device a worker of `local_rank` sees, as torchrun picks it.
// Throws std::invalid_argument if CUDA_VISIBLE_DEVICES has no entry for it.
std::string virtual_local_rank_device(int local_rank);

}  // namespace ddprun
