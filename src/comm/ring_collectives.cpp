#include "comm/ring_collectives.h"

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace ddp::detail {

namespace {

constexpr int64_t kReduceScatter = 1, kAllGather = 2;
// Tags cycle through this many operations; messages of one operation are
// never confused with those of the next (every rank numbers them alike).
constexpr uint64_t kTagCycle = 1u << 19;

const char* kind_name(int64_t kind) {
  return kind == kReduceScatter ? "reduce_scatter" : kind == kAllGather ? "all_gather" : "an unknown operation";
}

}  // namespace

// An ordinary c10d Work: wait(timeout) blocks until the ring thread has run
// the operation and rethrows its error, if any.
// Its future (what comm hooks and the gradient engine wait on) completes
// with the output, or with the error.
class RingCollectives::RingWork : public c10d::Work {
 public:
  RingWork(int rank, c10d::OpType type, at::Tensor output)
      : c10d::Work(rank, type),
        output_(std::move(output)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(std::move(error));
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{output_}));
    }
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  at::Tensor output_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

RingCollectives::RingCollectives(std::unique_ptr<RingTransport> transport, uint32_t tag_base)
    : transport_(std::move(transport)), tag_base_(tag_base) {
  worker_ = std::thread([this] { run(); });
}

RingCollectives::~RingCollectives() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

c10::intrusive_ptr<c10d::Work> RingCollectives::enqueue(Operation operation, c10d::OpType type, at::Tensor output) {
  auto work = c10::make_intrusive<RingWork>(transport_->rank(), type, std::move(output));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DDP_CHECK(!stopping_, "ddp: ring ", type == c10d::OpType::REDUCE_SCATTER ? "reduce_scatter" : "all_gather",
              " started on a process group that is shutting down");
    queue_.emplace_back(std::move(operation), work);
  }
  wake_.notify_one();
  return work;
}

void RingCollectives::run() {
  for (;;) {
    Operation operation;
    c10::intrusive_ptr<RingWork> work;
    uint64_t sequence;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) {
        // Nobody will wait for what is left: do not talk to the peers again.
        // The works complete outside the lock, since their futures run
        // callbacks.
        auto left = std::move(queue_);
        queue_.clear();
        lock.unlock();
        for (auto& entry : left) {
          entry.second->complete(std::make_exception_ptr(
              Error("ddp: ring operation cancelled: its process group was shut down first")));
        }
        return;
      }
      operation = std::move(queue_.front().first);
      work = std::move(queue_.front().second);
      queue_.pop_front();
      sequence = next_sequence_++;
    }
    // After a failure (a dead peer, a timeout, a mismatch) the ring is
    // broken: later operations fail at once instead of each waiting out the
    // timeout.
    if (failure_) {
      work->complete(failure_);
      continue;
    }
    // Nothing may escape this thread: an exception here would end the
    // process with std::terminate. Errors go to the waiter instead.
    try {
      operation(tag_base_ + static_cast<uint32_t>(sequence % kTagCycle) * 2, sequence);
      // The operation holds its tensors (FSDP's full gradient, as the
      // reduce-scatter's input): released before the waiter wakes, not
      // after, so that a finished collective holds no memory.
      operation = nullptr;
      work->complete(nullptr);
    } catch (...) {
      operation = nullptr;
      failure_ = std::current_exception();
      work->complete(failure_);
    }
  }
}

// Sends `send` to the next rank while receiving `receive` from the previous.
void RingCollectives::exchange(at::Tensor& send, at::Tensor& receive, uint32_t tag, const char* what) {
  const int world = transport_->size(), rank = transport_->rank();
  auto sent = transport_->send(send, (rank + 1) % world, static_cast<int>(tag));
  auto received = transport_->recv(receive, (rank + world - 1) % world, static_cast<int>(tag));
  transport_->wait(received, what);
  transport_->wait(sent, what);
}

// The previous rank must be starting the same operation: same kind, size,
// dtype and number. Sizes that differ would otherwise reach Gloo, which
// aborts the process on its own thread.
void RingCollectives::check_header(int64_t kind, int64_t part, at::ScalarType dtype, uint64_t sequence,
                                   uint32_t tag) {
  at::Tensor mine = at::tensor({kind, part, static_cast<int64_t>(dtype), static_cast<int64_t>(sequence)}, at::kLong);
  at::Tensor theirs = at::empty_like(mine);
  exchange(mine, theirs, tag, "ring collective header exchange");
  const int64_t* h = theirs.data_ptr<int64_t>();
  const int previous = (transport_->rank() + transport_->size() - 1) % transport_->size();
  DDP_CHECK(h[0] == kind && h[1] == part && h[2] == static_cast<int64_t>(dtype) &&
                h[3] == static_cast<int64_t>(sequence),
            "ddp: ranks started different collectives: rank ", transport_->rank(), "'s ", kind_name(kind), " #",
            sequence, " of ", part, " ", dtype, " elements per rank met rank ", previous, "'s ", kind_name(h[0]),
            " #", h[3], " of ", h[1], " ", static_cast<at::ScalarType>(h[2]),
            " elements per rank. Every rank must start the same collectives in the same order (look for a "
            "branch that runs on some ranks only)");
}

c10::intrusive_ptr<c10d::Work> RingCollectives::reduce_scatter(at::Tensor output, at::Tensor input) {
  const int64_t world = transport_->size();
  DDP_CHECK(input.is_contiguous() && output.is_contiguous() && input.numel() == world * output.numel(),
            "ddp: ring reduce_scatter needs contiguous tensors, the input ", world, " times the output's ",
            output.numel(), " elements; got ", input.numel());
  return enqueue(
      [this, output, input](uint32_t tag, uint64_t sequence) mutable {
        const int64_t world = transport_->size(), rank = transport_->rank(), part = output.numel();
        if (world == 1) {
          output.copy_(input.view_as(output));
          return;
        }
        check_header(kReduceScatter, part, input.scalar_type(), sequence, tag);
        auto chunk = [&](int64_t i) { return input.view({-1}).narrow(0, ((i % world) + world) % world * part, part); };
        // Step s passes on the running sum of chunk r-1-s; after N-1 steps
        // the sum that arrives, plus this rank's own chunk r, is complete.
        at::Tensor outgoing = chunk(rank - 1).clone();
        at::Tensor incoming = at::empty_like(outgoing);
        for (int64_t step = 0; step + 1 < world; ++step) {
          exchange(outgoing, incoming, tag + 1, "ring reduce_scatter exchange");
          at::Tensor mine = chunk(rank - 2 - step);
          if (step + 2 < world) {
            at::add_out(outgoing, mine, incoming);
          } else {
            at::add_out(output, mine.view_as(output), incoming.view_as(output));
          }
        }
      },
      c10d::OpType::REDUCE_SCATTER, output);
}

c10::intrusive_ptr<c10d::Work> RingCollectives::all_gather(at::Tensor output, at::Tensor input) {
  const int64_t world = transport_->size();
  DDP_CHECK(input.is_contiguous() && output.is_contiguous() && output.numel() == world * input.numel(),
            "ddp: ring all_gather needs contiguous tensors, the output ", world, " times the input's ",
            input.numel(), " elements; got ", output.numel());
  return enqueue(
      [this, output, input](uint32_t tag, uint64_t sequence) mutable {
        const int64_t world = transport_->size(), rank = transport_->rank(), part = input.numel();
        auto chunk = [&](int64_t i) { return output.view({-1}).narrow(0, ((i % world) + world) % world * part, part); };
        chunk(rank).copy_(input.view({-1}));
        if (world == 1) return;
        check_header(kAllGather, part, input.scalar_type(), sequence, tag);
        // Step s forwards chunk r-s, which arrived in the step before.
        for (int64_t step = 0; step + 1 < world; ++step) {
          at::Tensor outgoing = chunk(rank - step);
          at::Tensor incoming = chunk(rank - step - 1);
          exchange(outgoing, incoming, tag + 1, "ring all_gather exchange");
        }
      },
      c10d::OpType::_ALLGATHER_BASE, output);
}

}  // namespace ddp::detail
