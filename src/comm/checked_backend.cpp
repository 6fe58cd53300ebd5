#include "comm/checked_backend.h"

#include "common/duration_text.h"
#include "common/error_text.h"

#include <ddp/error.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace ddp::detail {
namespace {

// A backend's Work whose wait() reports Gloo's own exceptions (which are
// not c10::Errors, and would escape ProcessGroup::wait's message) as
// ddp::Errors carrying their text; everything else is the backend's.
class CheckedWork final : public c10d::Work {
 public:
  explicit CheckedWork(c10::intrusive_ptr<c10d::Work> inner)
      : Work(-1, inner->retrieveOpType()), inner_(std::move(inner)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    try {
      return inner_->wait(timeout);
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(detail::message_of(e));
    }
  }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
};

// Wraps the backend so that a collective which fails as it starts (Gloo
// throws at once when a peer's connection is already gone: "Read error ...
// Connection reset by peer") gets ddp's usual message, naming the
// operation, the rank and the cause, like a failure found by wait().
class CheckedBackend final : public c10d::Backend {
 public:
  CheckedBackend(c10::intrusive_ptr<c10d::Backend> inner, const World& world, std::chrono::milliseconds timeout)
      : Backend(world.rank, world.world_size), inner_(std::move(inner)), timeout_(timeout) {}

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

#define DDP_CHECKED(name, operation, parameters, arguments)                                  \
  c10::intrusive_ptr<c10d::Work> name parameters override {                                 \
    return checked(operation, [&] { return inner_->name arguments; });                      \
  }
  DDP_CHECKED(broadcast, "broadcast", (std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o), (t, o))
  DDP_CHECKED(allreduce, "all_reduce", (std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o), (t, o))
  DDP_CHECKED(allreduce_sparse, "all_reduce", (std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o), (t, o))
  DDP_CHECKED(allreduce_coalesced, "all_reduce", (std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o),
              (t, o))
  DDP_CHECKED(reduce, "reduce", (std::vector<at::Tensor>& t, const c10d::ReduceOptions& o), (t, o))
  DDP_CHECKED(allgather, "all_gather",
              (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(_allgather_base, "all_gather", (at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(allgather_coalesced, "all_gather",
              (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(allgather_into_tensor_coalesced, "all_gather",
              (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o),
              (out, in, o))
  DDP_CHECKED(gather, "gather",
              (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::GatherOptions& o),
              (out, in, o))
  DDP_CHECKED(scatter, "scatter",
              (std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in, const c10d::ScatterOptions& o),
              (out, in, o))
  DDP_CHECKED(reduce_scatter, "reduce_scatter",
              (std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
               const c10d::ReduceScatterOptions& o),
              (out, in, o))
  DDP_CHECKED(_reduce_scatter_base, "reduce_scatter",
              (at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o), (out, in, o))
  DDP_CHECKED(reduce_scatter_tensor_coalesced, "reduce_scatter",
              (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::ReduceScatterOptions& o),
              (out, in, o))
  DDP_CHECKED(alltoall_base, "all_to_all",
              (at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits,
               const c10d::AllToAllOptions& o),
              (out, in, out_splits, in_splits, o))
  DDP_CHECKED(alltoall, "all_to_all",
              (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o), (out, in, o))
  DDP_CHECKED(send, "send", (std::vector<at::Tensor>& t, int to, int tag), (t, to, tag))
  DDP_CHECKED(recv, "recv", (std::vector<at::Tensor>& t, int from, int tag), (t, from, tag))
  DDP_CHECKED(recvAnysource, "recv", (std::vector<at::Tensor>& t, int tag), (t, tag))
  DDP_CHECKED(barrier, "barrier", (const c10d::BarrierOptions& o), (o))
#undef DDP_CHECKED

 private:
  template <typename Start>
  c10::intrusive_ptr<c10d::Work> checked(const char* operation, Start&& start) {
    try {
      return c10::make_intrusive<CheckedWork>(start());
    } catch (const Error&) {
      throw;  // already ddp's
    } catch (const c10::Error& e) {
      fail(operation, e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(operation, detail::message_of(e));  // Gloo's own exceptions are not c10::Errors
    }
  }
  [[noreturn]] void fail(const char* operation, const std::string& cause) const {
    DDP_PEER_CHECK(false, "ddp: ", operation, " failed on rank ", getRank(), " of ", getSize(),
                   " as it started (timeout ", seconds_text(timeout_),
                   "); a peer may have died or stopped calling collectives. Cause: ", cause);
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_checked_backend(c10::intrusive_ptr<c10d::Backend> inner, const World& world,
                                                       std::chrono::milliseconds timeout) {
  return c10::make_intrusive<CheckedBackend>(std::move(inner), world, timeout);
}

}  // namespace ddp::detail
