#include <ddp/ring_collectives.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace ddp {

RingCollectives::RingCollectives(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {
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

RingCollectives::Pending RingCollectives::enqueue(std::function<void(uint32_t)> operation) {
  auto promise = std::make_shared<std::promise<void>>();
  Pending pending(promise->get_future().share());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(std::move(operation), std::move(promise));
  }
  wake_.notify_one();
  return pending;
}

void RingCollectives::run() {
  for (;;) {
    std::function<void(uint32_t)> operation;
    std::shared_ptr<std::promise<void>> promise;
    uint32_t tag;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) {
        // Nobody will wait for what is left: do not talk to the peers again.
        for (auto& entry : queue_) {
          entry.second->set_exception(std::make_exception_ptr(
              c10::Error(std::string("ddp: ring operation cancelled: the FSDP engine was destroyed first"))));
        }
        queue_.clear();
        return;
      }
      operation = std::move(queue_.front().first);
      promise = std::move(queue_.front().second);
      queue_.pop_front();
      // Every rank numbers its operations alike, so tags match across ranks
      // and keep one operation's messages apart from the next one's.
      tag = next_tag_;
      next_tag_ = (next_tag_ + 1) % (1u << 20);
    }
    // After a failure (a dead peer, a timeout) the ring is broken: later
    // operations fail at once instead of each waiting out the timeout.
    if (failure_) {
      promise->set_exception(failure_);
      continue;
    }
    try {
      operation(tag);
      promise->set_value();
    } catch (...) {
      failure_ = std::current_exception();
      promise->set_exception(failure_);
    }
  }
}

// Sends `send` to the next rank while receiving `receive` from the previous.
void RingCollectives::exchange(at::Tensor& send, at::Tensor& receive, uint32_t tag) {
  const int world = group_->size(), rank = group_->rank();
  auto sent = group_->send_async(send, (rank + 1) % world, static_cast<int>(tag));
  auto received = group_->recv_async(receive, (rank + world - 1) % world, static_cast<int>(tag));
  group_->wait(received, "ring exchange (receive)");
  group_->wait(sent, "ring exchange (send)");
}

RingCollectives::Pending RingCollectives::reduce_scatter(at::Tensor output, at::Tensor input) {
  const int64_t world = group_->size();
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous() && input.numel() == world * output.numel(),
              "ddp: ring reduce_scatter needs contiguous tensors, the input ", world, " times the output's ",
              output.numel(), " elements; got ", input.numel());
  return enqueue([this, output, input](uint32_t tag) mutable {
    const int64_t world = group_->size(), rank = group_->rank(), part = output.numel();
    auto chunk = [&](int64_t i) { return input.view({-1}).narrow(0, ((i % world) + world) % world * part, part); };
    if (world == 1) {
      output.copy_(input.view_as(output));
      return;
    }
    // Step s passes on the running sum of chunk r-1-s; after N-1 steps the
    // sum that arrives, plus this rank's own chunk r, is complete.
    at::Tensor outgoing = chunk(rank - 1).clone();
    at::Tensor incoming = at::empty_like(outgoing);
    for (int64_t step = 0; step + 1 < world; ++step) {
      exchange(outgoing, incoming, tag);
      at::Tensor mine = chunk(rank - 2 - step);
      if (step + 2 < world) {
        at::add_out(outgoing, mine, incoming);
      } else {
        at::add_out(output, mine.view_as(output), incoming.view_as(output));
      }
    }
  });
}

RingCollectives::Pending RingCollectives::all_gather(at::Tensor output, at::Tensor input) {
  const int64_t world = group_->size();
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous() && output.numel() == world * input.numel(),
              "ddp: ring all_gather needs contiguous tensors, the output ", world, " times the input's ",
              input.numel(), " elements; got ", output.numel());
  return enqueue([this, output, input](uint32_t tag) mutable {
    const int64_t world = group_->size(), rank = group_->rank(), part = input.numel();
    auto chunk = [&](int64_t i) { return output.view({-1}).narrow(0, ((i % world) + world) % world * part, part); };
    chunk(rank).copy_(input.view({-1}));
    // Step s forwards chunk r-s, which arrived in the step before.
    for (int64_t step = 0; step + 1 < world; ++step) {
      at::Tensor outgoing = chunk(rank - step);
      at::Tensor incoming = chunk(rank - step - 1);
      exchange(outgoing, incoming, tag);
    }
  });
}

}  // namespace ddp
