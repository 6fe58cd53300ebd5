// A thread of a communication hook's own, for hooks whose collectives depend
// on each other (hierarchical all-reduce: reduce, then all-reduce, then
// broadcast; PowerSGD: P, then Q). run() hands each bucket's job here and
// returns its future at once, so the autograd thread goes on with the rest
// of backward. Buckets arrive in launch order, which is the same on every
// rank, and the thread takes them first in, first out, so every rank issues
// the same collectives in the same order. Those collectives must go to
// groups that nothing else uses meanwhile (the hook's own), or another
// thread's collectives could come between them in another order elsewhere.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace ddp::detail {

class HookThread {
 public:
  HookThread() : worker_([this] { work(); }) {}

  // Runs the jobs already queued, then ends.
  ~HookThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    worker_.join();
  }

  HookThread(const HookThread&) = delete;
  HookThread& operator=(const HookThread&) = delete;

  // The future completes with what `job` returns, or with its exception.
  // `like` gives the result's device (a CUDA future records its streams).
  c10::intrusive_ptr<c10::ivalue::Future> submit(const at::Tensor& like, std::function<at::Tensor()> job) {
    auto future = like.is_cpu() ? c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get())
                                : c10::make_intrusive<c10::ivalue::Future>(
                                      c10::TensorType::get(), std::vector<c10::Device>{like.device()});
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(Job{std::move(job), future});
    }
    ready_.notify_one();
    return future;
  }

 private:
  struct Job {
    std::function<at::Tensor()> run;
    c10::intrusive_ptr<c10::ivalue::Future> done;
  };

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      try {
        job.done->markCompleted(job.run());
      } catch (...) {
        job.done->setError(std::current_exception());
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread worker_;  // last: it starts in the constructor and uses the members above
};

}  // namespace ddp::detail
