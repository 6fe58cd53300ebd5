#pragma once

// The Work of a backend that runs its collectives itself (on the caller's
// thread or its own), not through Gloo or NCCL: MPI and shared memory.
// wait() blocks until finish() is called; its future serves comm hooks, as
// Gloo's does. Backends differ in what an overrun wait means, and may run a
// collective that is still queued on the waiting thread (run_if_queued).

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <vector>

namespace ddp::detail {

class ThreadedWork : public c10d::Work {
 public:
  ThreadedWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!isCompleted()) run_if_queued();
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout == kNoTimeout) {
      cv_.wait(lock, [&] { return completed_; });
    } else if (!cv_.wait_for(lock, timeout + grace_after_timeout(), [&] { return completed_; })) {
      lock.unlock();
      throw_overrun(timeout);
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      completed_ = true;
      error_ = error;
      cv_.notify_all();
    }
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 protected:
  /// How much longer than the collective's timeout wait() waits.
  virtual std::chrono::milliseconds grace_after_timeout() const { return std::chrono::milliseconds(0); }
  /// Before wait() blocks: a backend whose thread has not yet taken this
  /// collective may run it here instead (a thread that waits has nothing
  /// better to do, and a sleeping worker would take a wake-up to start).
  virtual void run_if_queued() {}
  /// Throws the backend's error for a wait that ran past its bound.
  [[noreturn]] virtual void throw_overrun(std::chrono::milliseconds timeout) const = 0;

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool completed_ = false;
  std::exception_ptr error_;
};

}  // namespace ddp::detail
