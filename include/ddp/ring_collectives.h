#pragma once

// Reduce-scatter and all-gather built from point-to-point sends around a
// ring of ranks. Gloo has both collectives, but its reduce-scatter costs
// about twice an all-reduce of the same buffer and its all-gather more than
// an all-reduce (bench/MEMORY.md measures them side by side); a ring moves
// each byte once per hop, (N-1)/N of the buffer per rank, which is half of an
// all-reduce's traffic. FSDP uses these on Gloo; NCCL's own are used on GPUs.
//
// Operations run one after another on a thread of their own, in the order
// they were started, so they overlap the caller's computation and ranks that
// start the same operations in the same order always match.

#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

namespace ddp {

class RingCollectives {
 public:
  /// A started operation; wait() returns when its output is ready and
  /// rethrows its error, if any.
  class Pending {
   public:
    Pending() = default;
    explicit Pending(std::shared_future<void> done) : done_(std::move(done)) {}
    bool valid() const { return done_.valid(); }
    void wait() const {
      if (done_.valid()) done_.get();
    }

   private:
    std::shared_future<void> done_;
  };

  explicit RingCollectives(std::shared_ptr<ProcessGroup> group);
  ~RingCollectives();
  RingCollectives(const RingCollectives&) = delete;
  RingCollectives& operator=(const RingCollectives&) = delete;

  /// Rank r's `output` becomes the sum over ranks of part r of `input`
  /// (input.numel() == world size * output.numel(), both contiguous).
  Pending reduce_scatter(at::Tensor output, at::Tensor input);
  /// `output` becomes every rank's `input`, rank r's at r * input.numel().
  Pending all_gather(at::Tensor output, at::Tensor input);

 private:
  Pending enqueue(std::function<void(uint32_t tag)> operation);
  void run();
  void exchange(at::Tensor& send, at::Tensor& receive, uint32_t tag);

  std::shared_ptr<ProcessGroup> group_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<std::function<void(uint32_t)>, std::shared_ptr<std::promise<void>>>> queue_;
  bool stopping_ = false;
  uint32_t next_tag_ = 0;
  std::exception_ptr failure_;  // the first failed operation's error; the worker thread's alone
  std::thread worker_;
};

}  // namespace ddp
