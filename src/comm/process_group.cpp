// ProcessGroup: create() (rendezvous.cpp finds the ranks, checked_backend.cpp
// wraps the backend), the collectives, and the environment's defaults for
// its options. The checks around each collective (trace, desync check,
// explain_stall) are in collective_debug.cpp.

#include <ddp/process_group.h>

#include <ddp/error.h>
#include <ddp/launch_env.h>

#include "comm/backends.h"
#include "comm/checked_backend.h"
#include "common/duration_text.h"
#include "launch/env_impl.h"
#include "comm/file_rendezvous.h"
#include "comm/process_group_impl.h"
#include "comm/fnv1a.h"
#include "comm/rendezvous.h"
#include "comm/stall_check.h"

#include <ddp/device.h>
#include <ddp/stack_dump.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <tuple>

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

// "2, 3": global ranks as messages list them.
std::string ranks_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

// Every rank's host identity, by rank, through the store: the shared-memory
// choice must be the same on every rank.
std::vector<std::string> exchange_hosts(c10d::Store& store, const World& world) {
  const std::string mine = detail::shm_host_identity();
  store.set("ddp/host/" + std::to_string(world.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> hosts(world.world_size);
  for (int r = 0; r < world.world_size; ++r) {
    const std::vector<uint8_t> bytes = store.get("ddp/host/" + std::to_string(r));
    hosts[r] = std::string(bytes.begin(), bytes.end());
  }
  return hosts;
}

size_t distinct(std::vector<std::string> values) {
  std::sort(values.begin(), values.end());
  return static_cast<size_t>(std::unique(values.begin(), values.end()) - values.begin());
}

// Gloo for what shared memory leaves to it, then the shared-memory backend.
c10::intrusive_ptr<c10d::Backend> make_shm(const c10::intrusive_ptr<c10d::Store>& group_store, const World& world,
                                           const std::vector<int>& global_ranks, std::chrono::milliseconds timeout) {
  auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("ddp/backend", group_store);
  auto shm_store = c10::make_intrusive<c10d::PrefixStore>("ddp/shm", group_store);
  auto gloo = detail::make_gloo_backend(gloo_store, world, timeout);
  return detail::make_shm_backend(shm_store, world, global_ranks, timeout, std::move(gloo));
}

// Whether kAuto was left to ddp: not pinned by the caller or DDP_BACKEND.
bool backend_left_to_ddp(const ProcessGroupOptions& options) {
  if (options.backend() != BackendKind::kAuto || options.device().is_cuda()) return false;
  const char* chosen = std::getenv("DDP_BACKEND");
  return !chosen || !*chosen || std::string(chosen) == "auto";
}

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
  if (name == "shm") return BackendKind::kShm;
  DDP_CHECK(false, "ddp: unknown backend '", name, "'; use auto, gloo, nccl, mpi or shm");
}

std::string to_string(BackendKind backend) {
  switch (backend) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
    case BackendKind::kMpi: return "mpi";
    case BackendKind::kShm: return "shm";
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

std::shared_ptr<ProcessGroup> ProcessGroup::create(const World& launched, ProcessGroupOptions options) {
  DDP_CHECK(options.timeout().count() > 0, "ddp: the process group timeout must be positive");
  // Checked for every backend, so a mistyped DDP_INIT_METHOD never passes
  // unnoticed. tcp:// names the store's address instead of MASTER_*; under
  // file:// there is no master (SLURM's first host may not even resolve),
  // and Gloo picks its interface without one.
  const InitMethod init = parse_init_method(options.init_method());
  const World world = [&] {
    World w = launched;
    if (init.kind != InitMethod::Kind::kEnv) {
      w.master_addr = init.host;
      w.master_port = init.port;
    }
    return w;
  }();
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->impl_->world_ = world;
  group->impl_->global_rank_ = world.rank;
  group->impl_->global_ranks_.resize(world.world_size);
  std::iota(group->impl_->global_ranks_.begin(), group->impl_->global_ranks_.end(), 0);
  group->impl_->options_ = options;
  BackendKind kind = resolve_backend(options.backend(), options.device());
  group->impl_->backend_kind_ = kind;
  // NCCL only moves tensors on its GPU, so small bookkeeping tensors live
  // there too; Gloo's live on the CPU.
  c10::Device device(c10::kCPU);
  if (kind == BackendKind::kNccl) device = nccl_device(world, options.device());
  group->impl_->control_options_ = at::TensorOptions().device(device);

  const std::chrono::milliseconds timeout = options.timeout();
  if (kind == BackendKind::kMpi) {
    // MPI's launcher already wired the ranks together: no TCPStore and no
    // store file, whatever the init method says. The store is this
    // process's own; ddp's collectives never need a shared one.
    DDP_CHECK(device.is_cpu() && !options.device().is_cuda(), "ddp: the mpi backend moves CPU tensors; ",
              "use nccl for ", options.device().str());
    group->impl_->store_ = c10::make_intrusive<c10d::HashStore>();
    group->impl_->backend_ = detail::make_mpi_backend(group->impl_->world_, timeout);
    return group;
  }
  if (init.kind != InitMethod::Kind::kFile) require_master(world);
  // Cuts the store's connection when a wait of c10d's outlives the
  // rendezvous deadline (see StoreDeadline); unused for one process.
  std::optional<detail::StoreDeadline> store_deadline;
  try {
    if (world.world_size == 1) {
      // One process: a private in-memory store; collectives are still real
      // (the backend runs them over a group of one), so code paths match.
      group->impl_->store_ = c10::make_intrusive<c10d::HashStore>();
    } else if (init.kind == InitMethod::Kind::kFile) {
      group->impl_->store_ = detail::file_rendezvous(world, init.path, options.run_id(), timeout);
    } else {
      store_deadline.emplace(world.master_port);
      group->impl_->store_ = detail::rendezvous(world, options.run_id(), timeout, *store_deadline);
    }
    if (kind == BackendKind::kGloo || kind == BackendKind::kShm) {
      // Shared memory when every rank is on this host and ddp may choose.
      group->impl_->hosts_ = world.world_size == 1 ? std::vector<std::string>{detail::shm_host_identity()}
                                                   : exchange_hosts(*group->impl_->store_, world);
      group->impl_->shm_allowed_ = backend_left_to_ddp(options) && detail::shm_enabled_by_env();
      const size_t hosts = distinct(group->impl_->hosts_);
      if (group->impl_->shm_allowed_ && hosts == 1 && world.world_size > 1) kind = BackendKind::kShm;
      DDP_CHECK(kind != BackendKind::kShm || hosts == 1, "ddp: the shm backend needs every rank on one host, but ",
                "the ranks are on ", hosts, " hosts; use gloo (or auto, which takes shared memory inside each ",
                "host for subgroups such as a DeviceMesh's node dimension)");
      group->impl_->backend_kind_ = kind;
      if (world.rank == 0 && world.world_size > 1) {
        std::fprintf(stderr, "ddp: transport %s (%d ranks on %s)\n", to_string(kind).c_str(), world.world_size,
                     hosts == 1 ? "one host" : (std::to_string(hosts) + " hosts").c_str());
      }
    }
    auto backend_store = c10::make_intrusive<c10d::PrefixStore>("ddp/backend", group->impl_->store_);
    group->impl_->backend_ = detail::make_checked_backend(
        kind == BackendKind::kNccl  ? detail::make_nccl_backend(backend_store, world, device, timeout)
        : kind == BackendKind::kShm ? make_shm(group->impl_->store_, world, group->impl_->global_ranks_, timeout)
                                    : detail::make_gloo_backend(backend_store, world, timeout),
        world, timeout);
  } catch (const c10::Error& e) {
    if (!store_deadline || !store_deadline->expired() || dynamic_cast<const Error*>(&e) != nullptr) throw;
    detail::throw_store_did_not_answer(world, timeout, *store_deadline, e);
  }
  if (store_deadline) store_deadline->disarm();
  if (world.world_size > 1) group->start_progress_responder();
  // Process-wide handlers only when asked (ddprun's workers are, through
  // DDP_DIAGNOSTIC_HANDLERS): a program's signals and std::terminate are its own.
  if (options.install_stack_dump_handler()) ddp::install_stack_dump_handler(SIGUSR1);
  if (options.install_terminate_handler()) detail::install_transport_failure_handler();
  detail::register_trace_for_dumps(group.get(), group->impl_->trace_.get(), world.rank);
  return group;
}

ProcessGroup::ProcessGroup() : impl_(std::make_unique<Impl>()) {
  impl_->trace_ = std::make_shared<CollectiveTrace>();
  // DDP_TRACE=off exists to measure what the trace costs (bench/RESULTS.md).
  const char* trace = std::getenv("DDP_TRACE");
  impl_->tracing_ = !(trace && std::string(trace) == "off");
}

int ProcessGroup::rank() const { return impl_->member_ ? impl_->world_.rank : -1; }
int ProcessGroup::size() const { return impl_->world_.world_size; }
const World& ProcessGroup::world() const { return impl_->world_; }
BackendKind ProcessGroup::backend() const { return impl_->backend_kind_; }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->options_.timeout(); }
at::TensorOptions ProcessGroup::control_options() const { return impl_->control_options_; }
at::Tensor ProcessGroup::to_control(const at::Tensor& tensor) const {
  return tensor.to(impl_->control_options_.device());
}
const c10::intrusive_ptr<c10d::Backend>& ProcessGroup::c10d_backend() const { return impl_->backend_; }
c10d::Store& ProcessGroup::store() { return *impl_->store_; }
bool ProcessGroup::is_member() const { return impl_->member_; }
int ProcessGroup::global_rank() const { return impl_->global_rank_; }
const std::vector<int>& ProcessGroup::global_ranks() const { return impl_->global_ranks_; }
const std::string& ProcessGroup::name() const { return impl_->name_; }
const CollectiveTrace& ProcessGroup::trace() const { return *impl_->trace_; }

ProcessGroup::~ProcessGroup() {
  detail::unregister_trace_for_dumps(this);
  try {
    shutdown();
  } catch (...) {
    // A destructor must not throw; shutdown errors were already reported.
  }
}

std::string ProcessGroup::unique_store_prefix(const std::string& purpose) {
  return "ddp/" + purpose + "/" + std::to_string(impl_->store_prefixes_issued_++) + "/";
}

void ProcessGroup::shutdown() {
  impl_->responder_.reset();  // joins its thread before the store goes
  {
    // The rings talk through backend_: stop them first.
    std::lock_guard<std::mutex> lock(impl_->rings_mutex_);
    impl_->reduce_scatter_ring_.reset();
    impl_->all_gather_ring_.reset();
  }
  impl_->backend_.reset();
  impl_->store_.reset();
}

int ProcessGroup::global_rank_of(int group_rank) const {
  DDP_CHECK(group_rank >= 0 && group_rank < static_cast<int>(impl_->global_ranks_.size()), "ddp: ", group_rank,
            " is not a rank of process group ", impl_->name_, ", whose ranks are 0 to ", size() - 1);
  return impl_->global_ranks_[group_rank];
}

int ProcessGroup::group_rank_of(int global_rank) const {
  auto found = std::find(impl_->global_ranks_.begin(), impl_->global_ranks_.end(), global_rank);
  return found == impl_->global_ranks_.end() ? -1 : static_cast<int>(found - impl_->global_ranks_.begin());
}

std::string ProcessGroup::rank_label(int group_rank) const {
  const bool known = group_rank >= 0 && group_rank < static_cast<int>(impl_->global_ranks_.size());
  return "rank " + std::to_string(known ? impl_->global_ranks_[group_rank] : group_rank);
}

std::string ProcessGroup::where_am_i() const {
  const World& w = impl_->world_;
  if (impl_->name_ == "world") return "rank " + std::to_string(w.rank) + " of " + std::to_string(w.world_size);
  return "rank " + std::to_string(impl_->global_rank_) + " (rank " + std::to_string(rank()) + " of " +
         std::to_string(size()) + " in process group " + impl_->name_ + ", global ranks " +
         ranks_text(impl_->global_ranks_) + ")";
}

void ProcessGroup::require_usable(const char* op) const {
  DDP_CHECK(impl_->member_, "ddp: ", op, " on process group ", impl_->name_, " from global rank ", impl_->global_rank_,
            ", which is not one of its members (",
            impl_->global_ranks_.empty() ? std::string("this rank split off with kNoColour")
                                  : "its global ranks are " + ranks_text(impl_->global_ranks_),
            "). Only a group's members may call its collectives: check is_member() before using it, as Python "
            "code checks for GroupMember.NON_GROUP_MEMBER.");
  DDP_CHECK(impl_->backend_, "ddp: ", op, " on a process group that was shut down");
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks) {
  require_usable("new_group");
  std::sort(ranks.begin(), ranks.end());
  DDP_CHECK(!ranks.empty(), "ddp: new_group needs at least one rank");
  for (int r : ranks) {
    DDP_CHECK(r >= 0 && r < size(), "ddp: new_group was given rank ", r, ", but process group ", impl_->name_,
              " has ranks 0 to ", size() - 1, " (ranks of the group new_group is called on, not global ones)");
  }
  auto twice = std::adjacent_find(ranks.begin(), ranks.end());
  DDP_CHECK(twice == ranks.end(), "ddp: new_group was given rank ", twice == ranks.end() ? 0 : *twice, " twice");
  detail::Fnv1a hash;
  hash.add(ranks.data(), ranks.size() * sizeof(int));
  int64_t fingerprint = 0;
  const uint64_t hash_value = hash.value();
  std::memcpy(&fingerprint, &hash_value, sizeof(fingerprint));
  const bool inside = std::binary_search(ranks.begin(), ranks.end(), rank());
  const int colour = inside ? 0 : kNoColour;
  at::Tensor mine = at::tensor({int64_t{colour}, int64_t{rank()}, fingerprint}, at::kLong);
  // Every rank gets the same answers, so a mismatch fails every rank alike.
  std::vector<at::Tensor> all = all_gather_as("new_group", to_control(mine));
  for (int r = 1; r < size(); ++r) {
    DDP_CHECK(all[r].cpu()[2].item<int64_t>() == all[0].cpu()[2].item<int64_t>(), "ddp: ", rank_label(r),
              " passed other ranks to new_group than ", rank_label(0), " (this rank, ", rank_label(rank()),
              ", passed ", ranks_text(ranks), "). Every rank of process group ", impl_->name_,
              " must call new_group with the same ranks, as with torch.distributed.new_group.");
  }
  return make_subgroup("new_group", ranks, colour, rank());
}

std::shared_ptr<ProcessGroup> ProcessGroup::split(int colour, std::optional<int> key) {
  require_usable("split");
  DDP_CHECK(colour >= 0 || colour == kNoColour, "ddp: split's colour must be 0 or more, or kNoColour (-1) for a ",
            "rank that joins no group; got ", colour);
  const int my_key = key.value_or(rank());
  at::Tensor mine = at::tensor({int64_t{colour}, int64_t{my_key}}, at::kLong);
  std::vector<at::Tensor> all = all_gather_as("split", to_control(mine));
  // The ranks of this colour, ordered by key, then by rank (MPI_Comm_split's order).
  std::vector<std::pair<int64_t, int>> same;
  for (int r = 0; r < size(); ++r) {
    at::Tensor theirs = all[r].cpu();
    if (colour != kNoColour && theirs[0].item<int64_t>() == colour) same.emplace_back(theirs[1].item<int64_t>(), r);
  }
  std::sort(same.begin(), same.end());
  std::vector<int> members;
  for (const auto& entry : same) members.push_back(entry.second);
  return make_subgroup("split", members, colour, my_key);
}

std::shared_ptr<ProcessGroup> ProcessGroup::make_subgroup(const char* op, const std::vector<int>& members, int colour,
                                                          int key) {
  // The same number and store prefix on every rank of this group, members
  // or not: all of them make the same calls in the same order.
  const std::string number =
      (impl_->name_ == "world" ? "" : impl_->name_ + ".") + std::to_string(impl_->subgroups_made_++);
  const std::string prefix =
      unique_store_prefix("group") + (colour == kNoColour ? std::string("none") : std::to_string(colour));
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->impl_->name_ = number;
  group->impl_->options_ = impl_->options_;
  group->impl_->backend_kind_ = impl_->backend_kind_;
  group->impl_->control_options_ = impl_->control_options_;
  group->impl_->global_rank_ = impl_->global_rank_;
  for (int m : members) group->impl_->global_ranks_.push_back(impl_->global_ranks_[m]);
  auto mine = std::find(members.begin(), members.end(), rank());
  group->impl_->member_ = colour != kNoColour && mine != members.end();
  group->impl_->world_ = impl_->world_;
  group->impl_->world_.rank = group->impl_->member_ ? static_cast<int>(mine - members.begin()) : -1;
  group->impl_->world_.world_size = static_cast<int>(members.size());
  group->impl_->shm_allowed_ = impl_->shm_allowed_;
  if (impl_->hosts_.size() == impl_->global_ranks_.size()) {
    for (int m : members) group->impl_->hosts_.push_back(impl_->hosts_[m]);
  }
  // A subgroup whose ranks share a host talks through shared memory when
  // ddp chose the transport (a multi-host job's node-local groups), or when
  // its parent already does.
  if (impl_->backend_kind_ == BackendKind::kGloo && group->impl_->shm_allowed_ && members.size() > 1 &&
      group->impl_->hosts_.size() == members.size() && distinct(group->impl_->hosts_) == 1) {
    group->impl_->backend_kind_ = BackendKind::kShm;
  }

  const std::chrono::milliseconds timeout = impl_->options_.timeout();
  if (impl_->backend_kind_ == BackendKind::kMpi) {
    // MPI_Comm_split is collective over this group's communicator: a rank
    // outside the new group takes part too (with MPI_UNDEFINED).
    auto backend = detail::split_mpi_backend(impl_->backend_, group->impl_->member_ ? colour : kNoColour, key, timeout);
    if (!group->impl_->member_) return group;
    DDP_CHECK(backend && backend->getRank() == group->impl_->world_.rank &&
                  backend->getSize() == group->impl_->world_.world_size,
              "ddp: MPI_Comm_split made ", where_am_i(), " rank ", backend ? backend->getRank() : -1, " of ",
              backend ? backend->getSize() : 0, " but ", op, " expected rank ", group->impl_->world_.rank, " of ",
              group->impl_->world_.world_size, "; this is a bug in ddp");
    group->impl_->store_ = c10::make_intrusive<c10d::HashStore>();
    group->impl_->backend_ = backend;
  } else {
    if (!group->impl_->member_) return group;
    // Its own prefix of the job's store: its backend's keys and its stall
    // reports never meet another group's.
    group->impl_->store_ = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store_);
    auto backend_store = c10::make_intrusive<c10d::PrefixStore>("ddp/backend", group->impl_->store_);
    const BackendKind kind = group->impl_->backend_kind_;
    group->impl_->backend_ = detail::make_checked_backend(
        kind == BackendKind::kNccl
            ? detail::make_nccl_backend(backend_store, group->impl_->world_, impl_->control_options_.device(), timeout)
        : kind == BackendKind::kShm
            ? make_shm(group->impl_->store_, group->impl_->world_, group->impl_->global_ranks_, timeout)
            : detail::make_gloo_backend(backend_store, group->impl_->world_, timeout),
        group->impl_->world_, timeout);
    if (group->size() > 1) group->start_progress_responder();
  }
  detail::register_trace_for_dumps(group.get(), group->impl_->trace_.get(), impl_->global_rank_);
  return group;
}

std::vector<at::Tensor> ProcessGroup::all_gather_as(const char* op, const at::Tensor& tensor) {
  std::vector<at::Tensor> inputs{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = impl_->options_.timeout();
  const uint64_t seq = enter(op, inputs[0]);
  wait(track(seq, impl_->backend_->allgather(outputs, inputs, opts)), op);
  return outputs[0];
}

namespace {

// Waits for `work` up to `timeout`. A collective that several ranks issue
// differently (one rank saves a checkpoint, the other logs its loss) would
// otherwise wait out the whole timeout, 30 minutes by default: every
// desync_check_interval the ranks compare their newest collectives through
// the store, and a difference ends the wait at once. Throws as
// Work::wait does.
void wait_watching_for_desync(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
                              c10d::Store* store, const CollectiveTrace* trace, int rank, int world_size) {
  const auto interval = detail::desync_check_interval(timeout);
  if (!store || !trace || world_size == 1 || interval.count() == 0) {
    work->wait(timeout);
    return;
  }
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left <= interval) {
      work->wait(std::max(left, std::chrono::milliseconds(1)));
      return;
    }
    try {
      work->wait(interval);
      return;
    } catch (const c10::Error& e) {
      // Only Work::wait's own timeout: the collective itself still runs.
      if (work->isCompleted() || std::string(e.what_without_backtrace()).find("timed out") == std::string::npos) {
        throw;
      }
    }
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(timeout - left + interval);
    DDP_CHECK(!detail::issued_other_collectives(*store, *trace, rank, world_size),
              "the ranks issued different collectives, found after ", waited.count(),
              " s of waiting, before the timeout");
  }
}

}  // namespace

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* operation) const {
  try {
    if (impl_->backend_kind_ == BackendKind::kNccl) {
      // NCCL's wait() with a timeout spins the host until the GPU is done;
      // without one it only makes the current stream wait on the
      // collective's event. The communicator's watchdog already enforces
      // options_.timeout() (set in make_nccl_backend).
      work->wait();
    } else {
      const bool compare = impl_->tracing_ && impl_->backend_kind_ != BackendKind::kMpi;
      wait_watching_for_desync(work, impl_->options_.timeout(), compare ? impl_->store_.get() : nullptr,
                               impl_->trace_.get(), impl_->world_.rank, impl_->world_.world_size);
    }
  } catch (const c10::Error& e) {
    const std::string stall = explain_stall(e.what_without_backtrace());
    DDP_PEER_CHECK(false, "ddp: ", operation, " failed on ", where_am_i(),
                   " (timeout ", seconds_text(impl_->options_.timeout()), "); a peer may have died or stopped calling ",
                   "collectives. ", stall, stall.empty() ? "" : " ", "Cause: ", e.what_without_backtrace());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_reduce_async(at::Tensor& tensor, c10d::ReduceOp op) {
  require_usable("all_reduce");
  const uint64_t seq = enter("all_reduce", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.timeout = impl_->options_.timeout();
  return track(seq, impl_->backend_->allreduce(tensors, opts));
}

void ProcessGroup::all_reduce(at::Tensor& tensor, c10d::ReduceOp op) {
  require_usable("all_reduce");
  const uint64_t seq = enter("all_reduce", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.timeout = impl_->options_.timeout();
  opts.asyncOp = impl_->async_op_when_waited();
  wait(track(seq, impl_->backend_->allreduce(tensors, opts)), "all_reduce");
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  require_usable("broadcast");
  const uint64_t seq = enter("broadcast", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = impl_->options_.timeout();
  opts.asyncOp = impl_->async_op_when_waited();
  wait(track(seq, impl_->backend_->broadcast(tensors, opts)), "broadcast");
}

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& tensor) {
  require_usable("all_gather");
  return all_gather_as("all_gather", tensor);
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_gather_into_async(at::Tensor& output, at::Tensor& input) {
  require_usable("all_gather");
  DDP_CHECK(output.numel() == input.numel() * size(), "ddp: all_gather_into needs an output of ", size(),
              " x ", input.numel(), " elements, got ", output.numel());
  const uint64_t seq = enter("all_gather_into", input);
  if (uses_rings(output) && output.is_contiguous() && input.is_contiguous()) {
    return track(seq, ring_all_gather(output, input));
  }
  c10d::AllgatherOptions opts;
  opts.timeout = impl_->options_.timeout();
  return track(seq, impl_->backend_->_allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::reduce_scatter_async(at::Tensor& output, at::Tensor& input,
                                                                  c10d::ReduceOp op) {
  require_usable("reduce_scatter");
  DDP_CHECK(input.numel() == output.numel() * size(), "ddp: reduce_scatter needs an input of ", size(),
              " x ", output.numel(), " elements, got ", input.numel());
  const uint64_t seq = enter("reduce_scatter", input);
  if (uses_rings(input) && op == c10d::ReduceOp::SUM && output.is_contiguous() && input.is_contiguous()) {
    return track(seq, ring_reduce_scatter(output, input));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  opts.timeout = impl_->options_.timeout();
  return track(seq, impl_->backend_->_reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::send_async(at::Tensor& tensor, int to, int tag) {
  require_usable("send");
  const uint64_t seq = enter("send", tensor);
  std::vector<at::Tensor> tensors{tensor};
  return track(seq, impl_->backend_->send(tensors, to, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::recv_async(at::Tensor& tensor, int from, int tag) {
  require_usable("recv");
  const uint64_t seq = enter("recv", tensor);
  std::vector<at::Tensor> tensors{tensor};
  return track(seq, impl_->backend_->recv(tensors, from, tag));
}

void ProcessGroup::barrier() {
  require_usable("barrier");
  const uint64_t seq = enter("barrier", at::Tensor());
  c10d::BarrierOptions opts;
  opts.timeout = impl_->options_.timeout();
  opts.asyncOp = impl_->async_op_when_waited();
  wait(track(seq, impl_->backend_->barrier(opts)), "barrier");
}

bool ProcessGroup::uses_rings(const at::Tensor& tensor) const {
  // Gloo sends only CPU tensors; NCCL's own collectives are rings already.
  return impl_->backend_kind_ == BackendKind::kGloo && size() > 1 && tensor.is_cpu();
}

// Tag spaces of the two rings (send/recv tags; Gloo's collectives use slots
// of their own).
constexpr uint32_t kReduceScatterTags = 1u << 24, kAllGatherTags = 2u << 24;

// A ring is made at its first use: most groups never reduce-scatter on CPU.
static detail::RingCollectives& ring_in(std::unique_ptr<detail::RingCollectives>& ring, ProcessGroup& group,
                                        uint32_t tags) {
  if (!ring) ring = std::make_unique<detail::RingCollectives>(std::make_unique<GroupTransport>(group), tags);
  return *ring;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::ring_reduce_scatter(at::Tensor& output, at::Tensor& input) {
  std::lock_guard<std::mutex> lock(impl_->rings_mutex_);
  return ring_in(impl_->reduce_scatter_ring_, *this, kReduceScatterTags).reduce_scatter(output, input);
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::ring_all_gather(at::Tensor& output, at::Tensor& input) {
  std::lock_guard<std::mutex> lock(impl_->rings_mutex_);
  return ring_in(impl_->all_gather_ring_, *this, kAllGatherTags).all_gather(output, input);
}

std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options) {
  return ProcessGroup::create(world_from_env(), options);
}

}  // namespace ddp
