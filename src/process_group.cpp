// ProcessGroup: create() (rendezvous.cpp finds the ranks, checked_backend.cpp
// wraps the backend), the collectives, and the environment's defaults for
// its options. The checks around each collective (trace, desync check,
// explain_stall) are in collective_debug.cpp.

#include <ddp/process_group.h>

#include <ddp/error.h>
#include <ddp/launch_env.h>

#include "backends.h"
#include "checked_backend.h"
#include "duration_text.h"
#include "rendezvous.h"
#include "ring_collectives.h"

#include <ddp/device.h>
#include <ddp/stack_dump.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <csignal>
#include <cstdlib>
#include <mutex>
#include <optional>

namespace ddp {
namespace {

using detail::seconds_text;

// The GPU an NCCL rank uses: the one the caller chose, else its local
// rank's. Checked before rendezvous, so a missing GPU fails with its cause.
c10::Device nccl_device(const World& world, const c10::Device& requested) {
  DDP_CHECK(detail::nccl_available(), "ddp: this build of ddp has no NCCL support (no CUDA headers or nccl.h ",
              "were found when it was configured); use the gloo backend or rebuild with CUDA");
  int devices = visible_cuda_devices();
  DDP_CHECK(devices > 0, "ddp: the NCCL backend needs a CUDA device, but none is visible ",
              "(check CUDA_VISIBLE_DEVICES); use the gloo backend for CPU training");
  if (requested.is_cuda() && requested.has_index()) {
    DDP_CHECK(requested.index() < devices, "ddp: NCCL was asked to use ", requested.str(), " but only ", devices,
                " CUDA device(s) are visible");
    return requested;
  }
  return device_for_local_rank(world.local_rank, devices, DeviceOptions().kind(DeviceKind::kCuda));
}

// The ring's view of its group: rank, size, send, recv and wait, each
// through the group, so ring messages are traced like any other.
class GroupTransport final : public detail::RingTransport {
 public:
  explicit GroupTransport(ProcessGroup& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  c10::intrusive_ptr<c10d::Work> send(at::Tensor& tensor, int to, int tag) override {
    return group_.send_async(tensor, to, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(at::Tensor& tensor, int from, int tag) override {
    return group_.recv_async(tensor, from, tag);
  }
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) override { group_.wait(work, what); }

 private:
  ProcessGroup& group_;
};

}  // namespace


BackendKind resolve_backend(BackendKind backend, const c10::Device& device) {
  if (backend != BackendKind::kAuto) return backend;
  // The launcher's or the user's choice for programs that leave it to auto,
  // e.g. mpirun -x DDP_BACKEND=mpi ./train.
  if (const char* chosen = std::getenv("DDP_BACKEND"); chosen && *chosen) {
    BackendKind kind = parse_backend(chosen);
    if (kind != BackendKind::kAuto) return kind;
  }
  return device.is_cuda() ? BackendKind::kNccl : BackendKind::kGloo;
}

std::string default_run_id() {
  for (const char* name : {launch_env::kDdpRunId, launch_env::kRunId}) {
    if (const char* id = std::getenv(name)) {
      if (*id) return id;
    }
  }
  return "none";
}

bool mpi_available() { return detail::mpi_available(); }

BackendKind parse_backend(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "nccl") return BackendKind::kNccl;
  if (name == "mpi") return BackendKind::kMpi;
  DDP_CHECK(false, "ddp: unknown backend '", name, "'; use auto, gloo, nccl or mpi");
}

std::string to_string(BackendKind backend) {
  switch (backend) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
    case BackendKind::kMpi: return "mpi";
  }
  return "?";
}

std::chrono::milliseconds default_timeout() {
  if (const char* text = std::getenv("DDP_TIMEOUT_SECONDS")) {
    char* end = nullptr;
    double seconds = std::strtod(text, &end);
    DDP_CHECK(end != text && *end == '\0' && seconds >= 0.001 && seconds <= 1e9, "ddp: environment variable ",
                "DDP_TIMEOUT_SECONDS='", text, "' must be a number of seconds between 0.001 and 1e9");
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return std::chrono::minutes(30);
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const World& world, ProcessGroupOptions options) {
  DDP_CHECK(options.timeout().count() > 0, "ddp: the process group timeout must be positive");
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->world_ = world;
  group->options_ = options;
  BackendKind kind = resolve_backend(options.backend(), options.device());
  group->backend_kind_ = kind;
  // NCCL only moves tensors on its GPU, so small bookkeeping tensors live
  // there too; Gloo's live on the CPU.
  c10::Device device(c10::kCPU);
  if (kind == BackendKind::kNccl) device = nccl_device(world, options.device());
  group->control_options_ = at::TensorOptions().device(device);

  const std::chrono::milliseconds timeout = options.timeout();
  if (kind == BackendKind::kMpi) {
    // MPI's launcher already wired the ranks together: no TCPStore. The store
    // is this process's own; ddp's collectives never need a shared one.
    DDP_CHECK(device.is_cpu() && !options.device().is_cuda(), "ddp: the mpi backend moves CPU tensors; ",
              "use nccl for ", options.device().str());
    group->store_ = c10::make_intrusive<c10d::HashStore>();
    group->backend_ = detail::make_mpi_backend(group->world_, timeout);
    return group;
  }
  require_master(world);
  // Cuts the store's connection when a wait of c10d's outlives the
  // rendezvous deadline (see StoreDeadline); unused for one process.
  std::optional<detail::StoreDeadline> store_deadline;
  try {
    if (world.world_size == 1) {
      // One process: a private in-memory store; collectives are still real
      // (the backend runs them over a group of one), so code paths match.
      group->store_ = c10::make_intrusive<c10d::HashStore>();
    } else {
      store_deadline.emplace(world.master_port);
      group->store_ = detail::rendezvous(world, options.run_id(), timeout, *store_deadline);
    }
    auto backend_store = c10::make_intrusive<c10d::PrefixStore>("ddp/backend", group->store_);
    group->backend_ = detail::make_checked_backend(
        kind == BackendKind::kNccl ? detail::make_nccl_backend(backend_store, world, device, timeout)
                                   : detail::make_gloo_backend(backend_store, world, timeout),
        world, timeout);
  } catch (const c10::Error& e) {
    if (!store_deadline || !store_deadline->expired() || dynamic_cast<const Error*>(&e) != nullptr) throw;
    detail::throw_store_did_not_answer(world, timeout, *store_deadline, e);
  }
  if (store_deadline) store_deadline->disarm();
  if (world.world_size > 1) group->start_progress_responder();
  install_stack_dump_handler(SIGUSR1);
  detail::install_transport_failure_handler();
  detail::register_trace_for_dumps(group.get(), group->trace_.get(), world.rank);
  return group;
}

ProcessGroup::ProcessGroup() : trace_(std::make_shared<CollectiveTrace>()) {
  // DDP_TRACE=off exists to measure what the trace costs (bench/RESULTS.md).
  const char* trace = std::getenv("DDP_TRACE");
  tracing_ = !(trace && std::string(trace) == "off");
}

ProcessGroup::~ProcessGroup() {
  detail::unregister_trace_for_dumps(this);
  try {
    shutdown();
  } catch (...) {
    // A destructor must not throw; shutdown errors were already reported.
  }
}

std::string ProcessGroup::unique_store_prefix(const std::string& purpose) {
  return "ddp/" + purpose + "/" + std::to_string(store_prefixes_issued_++) + "/";
}

void ProcessGroup::shutdown() {
  responder_.reset();  // joins its thread before the store goes
  {
    // The rings talk through backend_: stop them first.
    std::lock_guard<std::mutex> lock(rings_mutex_);
    reduce_scatter_ring_.reset();
    all_gather_ring_.reset();
  }
  backend_.reset();
  store_.reset();
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* operation) const {
  try {
    if (backend_kind_ == BackendKind::kNccl) {
      // NCCL's wait() with a timeout spins the host until the GPU is done;
      // without one it only makes the current stream wait on the
      // collective's event. The communicator's watchdog already enforces
      // options_.timeout() (set in make_nccl_backend).
      work->wait();
    } else {
      work->wait(options_.timeout());
    }
  } catch (const c10::Error& e) {
    const std::string stall = explain_stall(e.what_without_backtrace());
    DDP_PEER_CHECK(false, "ddp: ", operation, " failed on rank ", world_.rank, " of ", world_.world_size,
                   " (timeout ", seconds_text(options_.timeout()), "); a peer may have died or stopped calling ",
                   "collectives. ", stall, stall.empty() ? "" : " ", "Cause: ", e.what_without_backtrace());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_reduce_async(at::Tensor& tensor, c10d::ReduceOp op) {
  DDP_CHECK(backend_, "ddp: all_reduce on a process group that was shut down");
  const uint64_t seq = enter("all_reduce", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.timeout = options_.timeout();
  return track(seq, backend_->allreduce(tensors, opts));
}

void ProcessGroup::all_reduce(at::Tensor& tensor, c10d::ReduceOp op) {
  wait(all_reduce_async(tensor, op), "all_reduce");
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  DDP_CHECK(backend_, "ddp: broadcast on a process group that was shut down");
  const uint64_t seq = enter("broadcast", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = options_.timeout();
  wait(track(seq, backend_->broadcast(tensors, opts)), "broadcast");
}

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& tensor) {
  DDP_CHECK(backend_, "ddp: all_gather on a process group that was shut down");
  std::vector<at::Tensor> inputs{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  const uint64_t seq = enter("all_gather", inputs[0]);
  wait(track(seq, backend_->allgather(outputs, inputs, opts)), "all_gather");
  return outputs[0];
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_gather_into_async(at::Tensor& output, at::Tensor& input) {
  DDP_CHECK(backend_, "ddp: all_gather on a process group that was shut down");
  DDP_CHECK(output.numel() == input.numel() * size(), "ddp: all_gather_into needs an output of ", size(),
              " x ", input.numel(), " elements, got ", output.numel());
  const uint64_t seq = enter("all_gather_into", input);
  if (uses_rings(output) && output.is_contiguous() && input.is_contiguous()) {
    return track(seq, ring_all_gather(output, input));
  }
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  return track(seq, backend_->_allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::reduce_scatter_async(at::Tensor& output, at::Tensor& input,
                                                                  c10d::ReduceOp op) {
  DDP_CHECK(backend_, "ddp: reduce_scatter on a process group that was shut down");
  DDP_CHECK(input.numel() == output.numel() * size(), "ddp: reduce_scatter needs an input of ", size(),
              " x ", output.numel(), " elements, got ", input.numel());
  const uint64_t seq = enter("reduce_scatter", input);
  if (uses_rings(input) && op == c10d::ReduceOp::SUM && output.is_contiguous() && input.is_contiguous()) {
    return track(seq, ring_reduce_scatter(output, input));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  opts.timeout = options_.timeout();
  return track(seq, backend_->_reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::send_async(at::Tensor& tensor, int to, int tag) {
  DDP_CHECK(backend_, "ddp: send on a process group that was shut down");
  const uint64_t seq = enter("send", tensor);
  std::vector<at::Tensor> tensors{tensor};
  return track(seq, backend_->send(tensors, to, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::recv_async(at::Tensor& tensor, int from, int tag) {
  DDP_CHECK(backend_, "ddp: recv on a process group that was shut down");
  const uint64_t seq = enter("recv", tensor);
  std::vector<at::Tensor> tensors{tensor};
  return track(seq, backend_->recv(tensors, from, tag));
}

void ProcessGroup::barrier() {
  DDP_CHECK(backend_, "ddp: barrier on a process group that was shut down");
  const uint64_t seq = enter("barrier", at::Tensor());
  c10d::BarrierOptions opts;
  opts.timeout = options_.timeout();
  wait(track(seq, backend_->barrier(opts)), "barrier");
}

void detail::RingDeleter::operator()(detail::RingCollectives* ring) const { delete ring; }

bool ProcessGroup::uses_rings(const at::Tensor& tensor) const {
  // Gloo sends only CPU tensors; NCCL's own collectives are rings already.
  return backend_kind_ == BackendKind::kGloo && size() > 1 && tensor.is_cpu();
}

// Tag spaces of the two rings (send/recv tags; Gloo's collectives use slots
// of their own).
constexpr uint32_t kReduceScatterTags = 1u << 24, kAllGatherTags = 2u << 24;

c10::intrusive_ptr<c10d::Work> ProcessGroup::ring_reduce_scatter(at::Tensor& output, at::Tensor& input) {
  std::lock_guard<std::mutex> lock(rings_mutex_);
  if (!reduce_scatter_ring_) {
    reduce_scatter_ring_.reset(new detail::RingCollectives(std::make_unique<GroupTransport>(*this), kReduceScatterTags));
  }
  return reduce_scatter_ring_->reduce_scatter(output, input);
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::ring_all_gather(at::Tensor& output, at::Tensor& input) {
  std::lock_guard<std::mutex> lock(rings_mutex_);
  if (!all_gather_ring_) {
    all_gather_ring_.reset(new detail::RingCollectives(std::make_unique<GroupTransport>(*this), kAllGatherTags));
  }
  return all_gather_ring_->all_gather(output, input);
}

std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options) {
  return ProcessGroup::create(world_from_env(), options);
}

}  // namespace ddp
