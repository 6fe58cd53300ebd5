#include <ddp/process_group.h>

#include "backends.h"

#include <ddp/device.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

namespace ddp {
namespace {

std::string seconds_text(std::chrono::milliseconds timeout) {
  double seconds = static_cast<double>(timeout.count()) / 1000.0;
  std::ostringstream out;
  out << seconds << " s";
  return out.str();
}

// Binds rank 0's listening socket ourselves rather than letting the store do
// it: a busy port then fails at once with the address in the message, and the
// store listens only on MASTER_ADDR's interface instead of on all of them.
int listen_on(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &result);
  TORCH_CHECK(rc == 0 && result != nullptr, "ddp: cannot resolve MASTER_ADDR=", host, ": ",
              gai_strerror(rc));
  int last_errno = 0;
  int fd = -1;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 2048) == 0) break;
    last_errno = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(result);
  TORCH_CHECK(last_errno != EADDRINUSE || fd >= 0, "ddp: rank 0 cannot listen on ", host, ":",
              port, ": the address is already in use (another job or program holds port ", port,
              "). Pick another MASTER_PORT, or launch with 'ddprun --standalone' to get a free one.");
  TORCH_CHECK(fd >= 0, "ddp: rank 0 cannot listen on ", host, ":", port, ": ",
              std::strerror(last_errno),
              ". MASTER_ADDR must be an address of rank 0's own host.");
  return fd;
}

// Waits until rank 0 accepts connections, polling every 10 ms. The store's
// client retries on its own too, but only once a second: ranks started a
// moment before rank 0 listens would each lose up to a second.
bool wait_for_master(const World& world, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(world.master_port);
  if (getaddrinfo(world.master_addr.c_str(), port_text.c_str(), &hints, &result) != 0 || result == nullptr) {
    return true;  // the store reports unresolvable addresses itself
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool connected = false;
  while (!connected && std::chrono::steady_clock::now() < deadline) {
    for (addrinfo* ai = result; ai != nullptr && !connected; ai = ai->ai_next) {
      int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      connected = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0;
      close(fd);
    }
    if (!connected) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  freeaddrinfo(result);
  return connected;
}

c10::intrusive_ptr<c10d::Store> rendezvous(const World& world, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(world.master_port);
  store_options.isServer = world.rank == 0;
  store_options.numWorkers = world.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  int listen_fd = -1;
  if (world.rank == 0) {
    listen_fd = listen_on(world.master_addr, world.master_port);
    store_options.masterListenFd = listen_fd;
  } else {
    TORCH_CHECK(wait_for_master(world, timeout), "ddp: rank ", world.rank, " cannot reach the master at ",
                world.master_addr, ":", world.master_port, " within ", seconds_text(timeout),
                ". Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point at it, and that no ",
                "firewall blocks the port.");
  }
  try {
    return c10::make_intrusive<c10d::TCPStore>(world.master_addr, store_options);
  } catch (const c10::Error& e) {
    std::string cause = e.what_without_backtrace();
    bool timed_out = cause.find("imed out") != std::string::npos || cause.find("imeout") != std::string::npos;
    TORCH_CHECK(timed_out, "ddp: rank ", world.rank, " could not set up the rendezvous store at ", world.master_addr,
                ":", world.master_port, ": ", cause);
    if (world.rank == 0) {
      TORCH_CHECK(false, "ddp: rank 0 waited ", seconds_text(timeout), " at ", world.master_addr,
                  ":", world.master_port, " for the other ", world.world_size - 1,
                  " rank(s), but not all of them joined. Check that every rank was started with ",
                  "the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE=", world.world_size,
                  ". (", e.what_without_backtrace(), ")");
    }
    TORCH_CHECK(false, "ddp: rank ", world.rank, " cannot reach the master at ", world.master_addr,
                ":", world.master_port, " within ", seconds_text(timeout),
                ". Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point at it, and ",
                "that no firewall blocks the port. (", e.what_without_backtrace(), ")");
  }
}

// Rank 0 publishes the job's run id; every other rank must carry the same
// one. A process of another job that reaches this master (same port, say)
// fails here instead of joining the wrong job.
void check_run_id(c10d::Store& store, const World& world, const std::string& run_id) {
  const std::string key = "ddp/run_id";
  if (world.rank == 0) {
    store.set(key, std::vector<uint8_t>(run_id.begin(), run_id.end()));
    return;
  }
  auto bytes = store.get(key);
  std::string master_run_id(bytes.begin(), bytes.end());
  TORCH_CHECK(master_run_id == run_id, "ddp: rank ", world.rank, " belongs to run '", run_id,
              "' but the master at ", world.master_addr, ":", world.master_port, " runs '", master_run_id,
              "'. Another job is using this MASTER_PORT; give each job its own port and run id ",
              "(ddprun --rdzv-id, or DDP_RUN_ID).");
}

// The GPU an NCCL rank uses: the one the caller chose, else its local
// rank's. Checked before rendezvous, so a missing GPU fails with its cause.
c10::Device nccl_device(const World& world, const c10::Device& requested) {
  TORCH_CHECK(detail::nccl_available(), "ddp: this build of ddp has no NCCL support (no CUDA headers or nccl.h ",
              "were found when it was configured); use the gloo backend or rebuild with CUDA");
  int devices = visible_cuda_devices();
  TORCH_CHECK(devices > 0, "ddp: the NCCL backend needs a CUDA device, but none is visible ",
              "(check CUDA_VISIBLE_DEVICES); use the gloo backend for CPU training");
  if (requested.is_cuda() && requested.has_index()) {
    TORCH_CHECK(requested.index() < devices, "ddp: NCCL was asked to use ", requested.str(), " but only ", devices,
                " CUDA device(s) are visible");
    return requested;
  }
  return device_for_local_rank(world.local_rank, devices, DeviceOptions().kind(DeviceKind::kCuda));
}

}  // namespace

BackendKind resolve_backend(BackendKind backend, const c10::Device& device) {
  if (backend != BackendKind::kAuto) return backend;
  return device.is_cuda() ? BackendKind::kNccl : BackendKind::kGloo;
}

std::string default_run_id() {
  for (const char* name : {"DDP_RUN_ID", "TORCHELASTIC_RUN_ID"}) {
    if (const char* id = std::getenv(name)) {
      if (*id) return id;
    }
  }
  return "none";
}

BackendKind parse_backend(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "nccl") return BackendKind::kNccl;
  TORCH_CHECK(false, "ddp: unknown backend '", name, "'; use auto, gloo or nccl");
}

std::string to_string(BackendKind backend) {
  switch (backend) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
  }
  return "?";
}

std::chrono::milliseconds default_timeout() {
  if (const char* text = std::getenv("DDP_TIMEOUT_SECONDS")) {
    char* end = nullptr;
    double seconds = std::strtod(text, &end);
    TORCH_CHECK(end != text && *end == '\0' && seconds >= 0.001 && seconds <= 1e9, "ddp: environment variable ",
                "DDP_TIMEOUT_SECONDS='", text, "' must be a number of seconds between 0.001 and 1e9");
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return std::chrono::minutes(30);
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const World& world, ProcessGroupOptions options) {
  TORCH_CHECK(options.timeout().count() > 0, "ddp: the process group timeout must be positive");
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

  if (world.world_size == 1) {
    // One process: a private in-memory store; collectives are still real
    // (the backend runs them over a group of one), so code paths match.
    group->store_ = c10::make_intrusive<c10d::HashStore>();
  } else {
    auto shared = rendezvous(world, options.timeout());
    check_run_id(*shared, world, options.run_id());
    // Every key of this job lives under its run id, so even a foreign
    // process that got past the check could not touch them.
    group->store_ = c10::make_intrusive<c10d::PrefixStore>("run/" + options.run_id(), shared);
  }
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("ddp/backend", group->store_);
  group->backend_ = kind == BackendKind::kNccl
                        ? detail::make_nccl_backend(backend_store, world, device, options.timeout())
                        : detail::make_gloo_backend(backend_store, world, options.timeout());
  return group;
}

ProcessGroup::~ProcessGroup() {
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
    TORCH_CHECK(false, "ddp: ", operation, " failed on rank ", world_.rank, " of ",
                world_.world_size, " (timeout ", seconds_text(options_.timeout()),
                "); a peer may have died or stopped calling collectives. Cause: ",
                e.what_without_backtrace());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_reduce_async(at::Tensor& tensor, c10d::ReduceOp op) {
  TORCH_CHECK(backend_, "ddp: all_reduce on a process group that was shut down");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.timeout = options_.timeout();
  return backend_->allreduce(tensors, opts);
}

void ProcessGroup::all_reduce(at::Tensor& tensor, c10d::ReduceOp op) {
  wait(all_reduce_async(tensor, op), "all_reduce");
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  TORCH_CHECK(backend_, "ddp: broadcast on a process group that was shut down");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = options_.timeout();
  wait(backend_->broadcast(tensors, opts), "broadcast");
}

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& tensor) {
  TORCH_CHECK(backend_, "ddp: all_gather on a process group that was shut down");
  std::vector<at::Tensor> inputs{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  wait(backend_->allgather(outputs, inputs, opts), "all_gather");
  return outputs[0];
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_gather_into_async(at::Tensor& output, at::Tensor& input) {
  TORCH_CHECK(backend_, "ddp: all_gather on a process group that was shut down");
  TORCH_CHECK(output.numel() == input.numel() * size(), "ddp: all_gather_into needs an output of ", size(),
              " x ", input.numel(), " elements, got ", output.numel());
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  return backend_->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::reduce_scatter_async(at::Tensor& output, at::Tensor& input,
                                                                  c10d::ReduceOp op) {
  TORCH_CHECK(backend_, "ddp: reduce_scatter on a process group that was shut down");
  TORCH_CHECK(input.numel() == output.numel() * size(), "ddp: reduce_scatter needs an input of ", size(),
              " x ", output.numel(), " elements, got ", input.numel());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  opts.timeout = options_.timeout();
  return backend_->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::send_async(at::Tensor& tensor, int to, int tag) {
  TORCH_CHECK(backend_, "ddp: send on a process group that was shut down");
  std::vector<at::Tensor> tensors{tensor};
  return backend_->send(tensors, to, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::recv_async(at::Tensor& tensor, int from, int tag) {
  TORCH_CHECK(backend_, "ddp: recv on a process group that was shut down");
  std::vector<at::Tensor> tensors{tensor};
  return backend_->recv(tensors, from, tag);
}

void ProcessGroup::barrier() {
  TORCH_CHECK(backend_, "ddp: barrier on a process group that was shut down");
  c10d::BarrierOptions opts;
  opts.timeout = options_.timeout();
  wait(backend_->barrier(opts), "barrier");
}

std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options) {
  return ProcessGroup::create(world_from_env(), options);
}

}  // namespace ddp
