// The job's MPI under the mpi backend (backend_mpi.cpp): MPI's start-up and
// finalisation, the one progress thread that makes every MPI call, and the
// watchdog that ends the job when a call overruns its timeout.
//
// A file of its own because it lives as long as the process, where a
// backend lives as long as its process group, and because it holds the
// threads and the time limits, where backend_mpi.cpp only maps c10d's
// collectives onto MPI calls. These two files are the only ones that include
// mpi.h; both compile to nothing MPI-specific without DDP_WITH_MPI.
#pragma once

#ifdef DDP_WITH_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ddp::detail {

// Started on the progress thread, which makes every MPI call but MPI_Abort
// and the small collectives that callers run themselves (try_run_here);
// those need MPI_THREAD_SERIALIZED, and without it everything runs on the
// progress thread (MPI_THREAD_FUNNELED).
class MpiRuntime {
 public:
  using Clock = std::chrono::steady_clock;

  /// The first call initialises MPI, and ends the process if that takes
  /// longer than `setup_timeout` (MPI's start-up cannot be interrupted).
  static MpiRuntime& get(std::chrono::milliseconds setup_timeout = std::chrono::minutes(30));

  /// Runs `job` on the progress thread and waits for it (setup calls).
  /// With a `limit`, gives up waiting after it and returns false.
  bool run_now(std::function<void()> job, std::optional<std::chrono::milliseconds> limit = std::nullopt);

  void enqueue(std::function<void()> job);

  /// Runs `job` on the calling thread, now, if the progress thread has
  /// nothing queued, running or pending, and MPI granted
  /// MPI_THREAD_SERIALIZED; returns false without running it otherwise.
  /// A small collective then skips the two thread hand-offs (a wake-up of
  /// the progress thread, then of the caller), which cost more than the
  /// collective itself. Order is kept: a job queued earlier by any thread
  /// makes this one queue behind it.
  bool try_run_here(const std::function<void()>& job);

  /// A non-blocking request to complete on the progress thread; `done` runs
  /// there once it has, with the completion's return code.
  void add_pending(MPI_Request request, std::function<void(int)> done);

  /// A collective's name for the watchdog's report, put into words only if
  /// it is reported: "all_reduce #12 on rank 0 of 2 (mpi)".
  struct CollectiveName {
    const char* op;
    int64_t number;
    int rank;
    int size;
    std::string text() const;
  };

  /// What the watchdog guards: every operation started and not finished,
  /// by id, with its label, start and timeout.
  void watch(uint64_t id, const std::string& what, std::chrono::milliseconds timeout);
  void watch(uint64_t id, const CollectiveName& what, std::chrono::milliseconds timeout);
  void unwatch(uint64_t id);
  uint64_t next_id() { return next_id_.fetch_add(1); }

  int thread_level() const { return provided_; }

 private:
  explicit MpiRuntime(std::chrono::milliseconds setup_timeout);
  void finalize();
  void progress_loop();
  void poll_pending();
  void watchdog_loop();
  [[noreturn]] void end_overdue_job(const std::string& what, std::chrono::milliseconds timeout) const;

  std::thread progress_;
  std::thread watchdog_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  // Under mutex_: the progress thread is running a job or has requests to
  // complete, so a caller may not run one itself.
  bool progress_busy_ = false;
  // Held by whichever thread makes MPI calls, the progress thread or a
  // caller in try_run_here: MPI_THREAD_SERIALIZED allows one at a time.
  std::mutex mpi_calls_;
  bool callers_may_run_ = false;
  // Touched on the progress thread only.
  std::vector<MPI_Request> pending_requests_;
  std::vector<std::function<void(int)>> pending_done_;
  struct Watched {
    std::string what;  // or, when empty:
    CollectiveName collective;
    Clock::time_point since;
    std::chrono::milliseconds timeout;
  };
  std::mutex watch_mutex_;
  std::map<uint64_t, Watched> watched_;
  std::atomic<uint64_t> next_id_{0};
  std::atomic<bool> mpi_initialized_{false};
  int provided_ = 0;
};

}  // namespace ddp::detail

#endif  // DDP_WITH_MPI
