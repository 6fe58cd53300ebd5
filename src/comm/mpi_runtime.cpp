// See mpi_runtime.h. Compiled only with DDP_WITH_MPI (CMake gives this file
// MPI's include directories and the definition).
#include "comm/mpi_runtime.h"

#ifdef DDP_WITH_MPI
#include <ddp/error.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

namespace ddp::detail {

MpiRuntime& MpiRuntime::get(std::chrono::milliseconds setup_timeout) {
  // Never destroyed: ranks may still hold process groups at exit, and
  // MPI_Finalize runs from an atexit hook instead.
  static MpiRuntime* runtime = new MpiRuntime(setup_timeout);
  return *runtime;
}

bool MpiRuntime::run_now(std::function<void()> job, std::optional<std::chrono::milliseconds> limit) {
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<Done>();
  enqueue([state, job = std::move(job)] {
    try {
      job();
    } catch (...) {
      state->error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->done = true;
    state->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(state->mutex);
  if (limit) {
    if (!state->cv.wait_for(lock, *limit, [&] { return state->done; })) return false;
  } else {
    state->cv.wait(lock, [&] { return state->done; });
  }
  if (state->error) std::rethrow_exception(state->error);
  return true;
}

void MpiRuntime::enqueue(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(std::move(job));
  cv_.notify_one();
}

bool MpiRuntime::try_run_here(const std::function<void()>& job) {
  if (!callers_may_run_) return false;
  std::unique_lock<std::mutex> queue_lock(mutex_);
  if (progress_busy_ || !queue_.empty()) return false;
  // Free: the progress thread takes it only after marking itself busy.
  std::lock_guard<std::mutex> calls(mpi_calls_);
  queue_lock.unlock();
  job();
  return true;
}

void MpiRuntime::add_pending(MPI_Request request, std::function<void(int)> done) {
  pending_requests_.push_back(request);
  pending_done_.push_back(std::move(done));
}

void MpiRuntime::watch(uint64_t id, const std::string& what, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(watch_mutex_);
  watched_[id] = Watched{what, CollectiveName{}, Clock::now(), timeout};
}

void MpiRuntime::watch(uint64_t id, const CollectiveName& what, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(watch_mutex_);
  watched_[id] = Watched{std::string(), what, Clock::now(), timeout};
}

std::string MpiRuntime::CollectiveName::text() const {
  return std::string(op) + " #" + std::to_string(number) + " on rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " (mpi)";
}

void MpiRuntime::unwatch(uint64_t id) {
  std::lock_guard<std::mutex> lock(watch_mutex_);
  watched_.erase(id);
}

MpiRuntime::MpiRuntime(std::chrono::milliseconds setup_timeout) {
  progress_ = std::thread([this] { progress_loop(); });
  progress_.detach();
  watchdog_ = std::thread([this] { watchdog_loop(); });
  watchdog_.detach();
  // MPI_Init_thread waits for every rank of the launch: one that exited or
  // crashed before it would hold this one there forever, and nothing can
  // interrupt it. The watchdog guards it like a collective.
  const uint64_t init_id = next_id();
  watch(init_id, "MPI_Init_thread (MPI's start-up, which waits for every rank of the launch)", setup_timeout);
  // Initialise now, on the progress thread: every later call finds MPI up.
  run_now([this] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided_);
      std::atexit([] { MpiRuntime::get().finalize(); });
    } else {
      MPI_Query_thread(&provided_);
    }
    mpi_initialized_ = true;
  });
  callers_may_run_ = provided_ >= MPI_THREAD_SERIALIZED;
  unwatch(init_id);
  DDP_CHECK(provided_ >= MPI_THREAD_FUNNELED, "ddp: the MPI library granted thread level ", provided_,
            " but ddp's MPI backend needs MPI_THREAD_FUNNELED (", MPI_THREAD_FUNNELED,
            "): rebuild or reconfigure MPI with thread support");
}

void MpiRuntime::finalize() {
  // From an atexit hook on the main thread: the progress thread makes the
  // call, as FUNNELED requires. A process leaving after an error may have
  // a collective stuck on that thread; it exits without MPI_Finalize then
  // (mpirun reports the non-zero exit and stops the other ranks).
  run_now(
      [] {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
      },
      std::chrono::seconds(5));
}

void MpiRuntime::progress_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (pending_requests_.empty()) {
        cv_.wait(lock, [&] { return !queue_.empty(); });
      } else {
        cv_.wait_for(lock, std::chrono::microseconds(50), [&] { return !queue_.empty(); });
      }
      if (!queue_.empty()) {
        job = std::move(queue_.front());
        queue_.pop_front();
        progress_busy_ = true;
      }
    }
    {
      std::lock_guard<std::mutex> calls(mpi_calls_);
      if (job) job();
      poll_pending();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    progress_busy_ = !pending_requests_.empty();
  }
}

void MpiRuntime::poll_pending() {
  if (pending_requests_.empty()) return;
  int count = static_cast<int>(pending_requests_.size());
  std::vector<int> indices(pending_requests_.size());
  std::vector<MPI_Status> statuses(pending_requests_.size());
  int completed = 0;
  int rc = MPI_Testsome(count, pending_requests_.data(), &completed, indices.data(), statuses.data());
  if (completed == MPI_UNDEFINED || completed == 0) {
    if (rc == MPI_SUCCESS) return;
  }
  std::vector<char> finished(pending_requests_.size(), 0);
  for (int i = 0; i < completed; ++i) {
    finished[indices[i]] = 1;
    pending_done_[indices[i]](rc);
  }
  size_t keep = 0;
  for (size_t i = 0; i < pending_requests_.size(); ++i) {
    if (finished[i]) continue;
    pending_requests_[keep] = pending_requests_[i];
    pending_done_[keep] = std::move(pending_done_[i]);
    ++keep;
  }
  pending_requests_.resize(keep);
  pending_done_.resize(keep);
}

void MpiRuntime::watchdog_loop() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::optional<Watched> overdue;
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      const auto now = Clock::now();
      for (const auto& [id, w] : watched_) {
        if (now - w.since >= w.timeout) {
          overdue = w;
          break;  // the oldest id first: the map is ordered
        }
      }
    }
    if (overdue) {
      end_overdue_job(overdue->what.empty() ? overdue->collective.text() : overdue->what, overdue->timeout);
    }
  }
}

// The messages go straight to stderr, not through TORCH_WARN: the process
// ends on the next line, from a thread no caller waits on, so nothing could
// catch an exception, and a warning handler a program installed could hold
// or drop the one line that says why the job ended.
void MpiRuntime::end_overdue_job(const std::string& what, std::chrono::milliseconds timeout) const {
  const double seconds = static_cast<double>(timeout.count()) / 1000.0;
  if (!mpi_initialized_) {
    // MPI_Abort is undefined before MPI_Init returns; this process ends
    // alone, and its exit makes the launcher stop the others.
    std::fprintf(stderr,
                 "error: ddp: %s did not finish within the timeout of %.3g s: a rank of this launch probably "
                 "exited or crashed before it started MPI (look for an earlier error or exit in the other "
                 "ranks' output), or the launcher cannot reach every node. Nothing can interrupt MPI's "
                 "start-up, so ddp ends this process.\n",
                 what.c_str(), seconds);
    std::fflush(stderr);
    std::_Exit(1);
  }
  std::fprintf(stderr,
               "ddp: %s did not finish within the timeout of %.3g s; a peer may have died or stopped calling "
               "collectives. MPI cannot cancel a collective, so ddp ends the whole job (MPI_Abort) for the "
               "launcher to stop every rank.\n",
               what.c_str(), seconds);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

}  // namespace ddp::detail

#endif  // DDP_WITH_MPI
