// When the shared-memory backend runs a collective, on real ranks
// (support/ranks.h): an asynchronous one, of any size, goes to the backend's
// thread, so the caller goes on (DDP's backward) while a late peer is still
// on its way; one issued with c10d's asyncOp false runs on the caller's
// thread; a thread that waits for collectives still queued runs them itself,
// in the order issued, whichever it waits for first.

#include <support/ranks.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace ddp::testing;

namespace {

using Clock = std::chrono::steady_clock;
using Group = std::shared_ptr<ddp::ProcessGroup>;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Rank 1 issues its side 400 ms after rank 0: an all-reduce that rank 0
// runs on its own thread blocks it for those 400 ms.
constexpr auto kLate = std::chrono::milliseconds(400);

void async_all_reduce_returns_before_the_peer_arrives(int64_t numel) {
  expect_all_succeeded(run_on_ranks(2, [numel](const Group& group) {
    ASSERT_EQ(group->backend(), ddp::BackendKind::kShm);
    at::Tensor t = at::full({numel}, float(group->rank() + 1));
    group->barrier();
    if (group->rank() == 1) std::this_thread::sleep_for(kLate);
    const auto start = Clock::now();
    auto work = group->all_reduce_async(t);
    const double issued_ms = ms_since(start);
    if (group->rank() == 0) {
      EXPECT_LT(issued_ms, 100.0) << numel * 4 << " bytes: all_reduce_async blocked the caller until the late peer "
                                  << "arrived";
      EXPECT_FALSE(work->isCompleted());
    }
    group->wait(work, "all_reduce");
    EXPECT_TRUE(at::equal(t, at::full({numel}, 3.0f)));
  }));
}

TEST(ShmOverlap, SmallAsyncAllReduceReturnsBeforeThePeerArrives) {
  async_all_reduce_returns_before_the_peer_arrives(1024);  // 4 KB
}

TEST(ShmOverlap, OneMebibyteAsyncAllReduceReturnsBeforeThePeerArrives) {
  async_all_reduce_returns_before_the_peer_arrives(256 * 1024);  // 1 MiB, the old inline limit
}

// c10d's asyncOp false: the caller waits at once, so the backend runs it on
// the caller's thread and the Work is complete when the call returns.
TEST(ShmOverlap, SynchronousOpRunsOnTheCallersThread) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    ASSERT_EQ(group->backend(), ddp::BackendKind::kShm);
    for (int64_t numel : {int64_t{1}, int64_t{1024}, int64_t{3 * 1000 * 1000}}) {
      std::vector<at::Tensor> tensors{at::full({numel}, float(group->rank() + 1))};
      c10d::AllreduceOptions opts;
      opts.asyncOp = false;
      auto work = group->c10d_backend()->allreduce(tensors, opts);
      EXPECT_TRUE(work->isCompleted()) << numel;
      work->wait();
      EXPECT_TRUE(at::equal(tensors[0], at::full({numel}, 3.0f))) << numel;
    }
  }));
}

// Waiting for the last of a queue first: the waiting thread (or the worker)
// runs everything before it in order; results are right, synchronous calls
// in between included.
TEST(ShmOverlap, WaitingOutOfOrderRunsTheQueueInOrder) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    ASSERT_EQ(group->backend(), ddp::BackendKind::kShm);
    for (int round = 0; round < 20; ++round) {
      std::vector<at::Tensor> tensors;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int i = 0; i < 6; ++i) {
        const int64_t numel = i % 3 == 0 ? 600 * 1000 : i % 3 == 1 ? 1000 : 3;
        tensors.push_back(at::full({numel}, float(group->rank() * 10 + i + round)));
        works.push_back(group->all_reduce_async(tensors.back()));
      }
      at::Tensor sync = at::full({17}, float(group->rank() + round));
      group->all_reduce(sync);
      EXPECT_TRUE(at::equal(sync, at::full({17}, float(1 + 2 * round))));
      for (int i = 5; i >= 0; --i) group->wait(works[i], "all_reduce");
      for (int i = 0; i < 6; ++i) {
        EXPECT_TRUE(at::equal(tensors[i], at::full_like(tensors[i], float(10 + 2 * (i + round))))) << round << " " << i;
      }
    }
  }));
}

}  // namespace
