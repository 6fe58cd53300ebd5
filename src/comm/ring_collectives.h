#pragma once

// Internal, not API: reduce-scatter and all-gather built from point-to-point
// sends around a ring of ranks, behind ProcessGroup::reduce_scatter_async and
// ProcessGroup::all_gather_into_async for Gloo CPU tensors. Gloo has both
// collectives, but its reduce-scatter costs about twice an all-reduce of the
// same buffer (bench/MEMORY.md measures them side by side); a ring moves each
// byte once per hop, (N-1)/N of the buffer per rank, which is half of an
// all-reduce's traffic.
//
// Operations of one RingCollectives run one after another on a thread of its
// own, in the order they were started, so they overlap the caller's
// computation, and ranks that start the same operations in the same order
// always match. Each operation first exchanges a small header (kind, size,
// dtype, sequence number) with its neighbours: ranks that started different
// operations get an error naming both from the Work's wait(), instead of
// Gloo aborting the process on its I/O thread when the sizes differ.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace ddp::detail {

/// What a ring needs of its process group: its place in the world and
/// point-to-point messages. ProcessGroup provides one (process_group.cpp),
/// so the ring never depends on ProcessGroup itself.
class RingTransport {
 public:
  virtual ~RingTransport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual c10::intrusive_ptr<c10d::Work> send(at::Tensor& tensor, int to, int tag) = 0;
  virtual c10::intrusive_ptr<c10d::Work> recv(at::Tensor& tensor, int from, int tag) = 0;
  /// Waits for `work`; on failure throws an error that names `what`.
  virtual void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) = 0;
};

class RingCollectives {
 public:
  /// Runs over `transport`, with send/recv tags from `tag_base` on, so that
  /// two instances (one for reduce-scatters, one for all-gathers) never take
  /// each other's messages.
  RingCollectives(std::unique_ptr<RingTransport> transport, uint32_t tag_base);
  ~RingCollectives();
  RingCollectives(const RingCollectives&) = delete;
  RingCollectives& operator=(const RingCollectives&) = delete;

  /// Rank r's `output` becomes the sum over ranks of part r of `input`
  /// (input.numel() == world size * output.numel(), both contiguous).
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor output, at::Tensor input);
  /// `output` becomes every rank's `input`, rank r's at r * input.numel().
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor output, at::Tensor input);

 private:
  class RingWork;
  using Operation = std::function<void(uint32_t tag, uint64_t sequence)>;
  c10::intrusive_ptr<c10d::Work> enqueue(Operation operation, c10d::OpType type, at::Tensor output);
  void run();
  void exchange(at::Tensor& send, at::Tensor& receive, uint32_t tag, const char* what);
  void check_header(int64_t kind, int64_t part, at::ScalarType dtype, uint64_t sequence, uint32_t tag);

  const std::unique_ptr<RingTransport> transport_;
  const uint32_t tag_base_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<Operation, c10::intrusive_ptr<RingWork>>> queue_;
  bool stopping_ = false;
  uint64_t next_sequence_ = 0;
  std::exception_ptr failure_;  // the first failed operation's error; the worker thread's alone
  std::thread worker_;
};

}  // namespace ddp::detail
