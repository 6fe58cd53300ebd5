#include <ddp/distributed_data_parallel.h>

#include <ddp/error.h>

#include "engine/bucket_reducer.h"
#include "engine/ddp_hooks.h"
#include "engine/hierarchical_choice.h"
#include "engine/hierarchical_hook.h"
#include "comm/backends.h"
#include "comm/fnv1a.h"
#include "common/error_text.h"

#include <ATen/Functions.h>
#include <torch/optim/lbfgs.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

namespace ddp {
namespace detail {
namespace {

int64_t host_hash() {
  const std::string identity = shm_host_identity();
  Fnv1a hash;
  hash.add(identity.data(), identity.size());
  int64_t value = 0;
  const uint64_t bits = hash.value();
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// DDP's own comm hook when the user set none (issue 37, defaults that fit
// the link): the hierarchical all-reduce when DDP's Gloo group spans hosts
// and some host runs several ranks, since then one copy of each bucket per
// host crosses the network instead of one per rank, and the host's part is
// shared memory. Null: the plain all-reduce. Every rank votes through one
// all-gather of its host, its wish and its parameters' device, and decides
// from all the votes, so all take the same path.
std::shared_ptr<CommHook> default_comm_hook(const std::shared_ptr<ProcessGroup>& group, const DDPOptions& options,
                                            const std::vector<at::Tensor>& params) {
  const bool insists = options.hierarchical_allreduce().value_or(false);
  if (group->size() == 1 || group->backend() != BackendKind::kGloo) {
    // Shared memory holds one host's ranks only; NCCL and MPI place their
    // own collectives. Program-wide facts, so every rank returns alike.
    DDP_CHECK(!insists, "ddp: DDPOptions::hierarchical_allreduce(true) reduces over a Gloo group spanning hosts, ",
              "but DDP's group is ", group->size() == 1 ? "one rank" : to_string(group->backend()) + " (" +
              std::to_string(group->size()) + " ranks)", "; drop the option (ddp then chooses)");
    return nullptr;
  }
  bool cpu = true;
  for (const auto& p : params) cpu = cpu && p.is_cpu();
  const HierarchicalWish wish = hierarchical_wish(options.hierarchical_allreduce(), std::getenv("DDP_HIERARCHICAL"));
  at::Tensor mine = at::tensor({host_hash(), static_cast<int64_t>(wish), int64_t{cpu ? 1 : 0}}, at::kLong);
  std::vector<at::Tensor> all;
  {
    CollectiveTag tag("ddp all-reduce choice: hosts");
    all = group->all_gather(group->to_control(mine));
  }
  std::vector<HierarchicalVote> votes;
  for (const at::Tensor& vote : all) {
    at::Tensor v = vote.cpu();
    votes.push_back(
        {v[0].item<int64_t>(), static_cast<HierarchicalWish>(v[1].item<int64_t>()), v[2].item<int64_t>() != 0});
  }
  const HierarchicalChoice choice = choose_hierarchical_allreduce(votes);
  DDP_CHECK(choice.error.empty(), choice.error);
  const int rank = group->rank();
  if (!choice.hierarchical) {
    if (choice.layout_fits && rank == 0) {
      std::fprintf(stderr, "ddp: all-reduce flat: gloo over %d ranks on %d hosts (%s)\n", group->size(),
                   choice.hosts, choice.why_flat.c_str());
    }
    return nullptr;
  }
  // The ranks of this host, led by the lowest; the leaders, one per host.
  // Splits of DDP's group: a host's group gets shared memory where ddp
  // chose the transport (ProcessGroup::split), the leaders' group Gloo.
  std::shared_ptr<ProcessGroup> node = group->split(choice.host_of_rank[rank], rank);
  std::shared_ptr<ProcessGroup> leaders = group->split(node->rank() == 0 ? 0 : ProcessGroup::kNoColour, rank);
  if (rank == 0) {
    // Every host's group gets the same transport; rank 0 alone on its host sees none.
    const std::string within = node->size() > 1 ? to_string(node->backend()) : "reduced";
    std::fprintf(stderr, "ddp: all-reduce hierarchical: %s within each host, %s between %d hosts (%d ranks; "
                 "DDP_HIERARCHICAL=0 for flat)\n", within.c_str(), to_string(leaders->backend()).c_str(),
                 choice.hosts, group->size());
  }
  return hierarchical_allreduce_hook(std::move(node), leaders->is_member() ? leaders : nullptr, group->size());
}

}  // namespace

void collect_tensors(const c10::IValue& value, std::vector<at::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& item : value.toTupleRef().elements()) collect_tensors(item, out);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) collect_tensors(item, out);
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) collect_tensors(item.value(), out);
  }
}

DdpRuntime::DdpRuntime(std::shared_ptr<ModuleTensors> module, std::shared_ptr<ProcessGroup> group,
                       DDPOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  DDP_CHECK(module_, "ddp: DistributedDataParallel got a null module");
  DDP_CHECK(group_, "ddp: DistributedDataParallel got a null process group");
  // Refused on every rank alike before any collective, so none waits.
  auto sparse = module_->sparse_gradient_parameters();
  DDP_CHECK(sparse.empty(), "ddp: parameter '", sparse.empty() ? "" : sparse.front(),
            "' would get sparse gradients (an Embedding or EmbeddingBag built with sparse(true)), but ",
            "DistributedDataParallel averages dense gradients only. Build it with sparse(false).");
  DDP_CHECK(!(options_.carry_loss() && options_.comm_hook()), "ddp: DDPOptions::carry_loss rides on the default "
            "all-reduce, which a comm hook replaces; drop one of them (with a hook, check the loss with "
            "ddp::check_loss_is_finite(loss, group, ...), one small all-reduce)");
  DDP_CHECK(!(options_.comm_hook() && options_.hierarchical_allreduce().value_or(false)),
            "ddp: DDPOptions::hierarchical_allreduce(true) chooses DDP's own all-reduce, which a comm hook replaces; "
            "drop one of them (or pass hierarchical_allreduce_hook(mesh) as the hook)");
  verify_replicas_match(*module_, *group_);
  broadcast_module_state(*module_, *group_, /*parameters=*/true, /*buffers=*/true);
  has_buffers_ = !module_->named_buffers().empty();

  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& [name, p] : module_->named_parameters()) {
    if (!p.requires_grad()) continue;
    params.push_back(p);
    names.push_back(name);
  }
  comm_hook_ = options_.comm_hook() ? options_.comm_hook() : default_comm_hook(group_, options_, params);
  DDPOptions reducer_options = options_;
  reducer_options.comm_hook(comm_hook_);
  if (options_.carry_loss()) {
    // The rider appends its elements to the last bucket, which ddp's own
    // all-reduce (flat or hierarchical) sums as any other.
    rider_ = std::make_shared<LossRiderHook>(comm_hook_ ? comm_hook_ : allreduce_hook());
    reducer_options.comm_hook(rider_);
  }
  reducer_ = std::make_unique<BucketReducer>(std::move(params), std::move(names), group_, reducer_options);
  // Also in a world of one, so the mistake shows before the job scales out.
  if (options_.broadcast_buffers() && has_buffers_) {
    reducer_->warn_on_backward_without_forward(
        "ddp: warning: a backward pass ran without DistributedDataParallel's forward, so this step's buffers "
        "(BatchNorm statistics, say) were not synchronised across ranks. Call model.forward(x) or model(x), "
        "not model->forward(x). (Shown once.)");
  }
}

void load_on_root_and_broadcast(const ModuleTensors& module, ProcessGroup& group, const std::string& path) {
  // Every rank learns whether rank 0's load worked, so a bad file fails
  // everywhere with its cause instead of leaving the others in a broadcast.
  std::string error;
  if (group.rank() == 0) {
    try {
      load_file_into(module.state_dict(), path);
    } catch (const std::exception& e) {
      error = detail::message_of(e);  // sent to every rank: no backtrace
    }
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, group.control_options().dtype(at::kInt));
  group.broadcast(failed, 0);
  if (failed.item<int>() != 0) {
    DDP_CHECK(group.rank() != 0, error);
    DDP_CHECK(false, "ddp: rank 0 could not load '", path, "'; see rank 0's error");
  }
  broadcast_module_state(module, group, /*parameters=*/true, /*buffers=*/true, 0);
}

void DdpRuntime::before_forward() {
  reducer_->prepare_for_forward();
  if (options_.broadcast_buffers() && has_buffers_) {
    broadcast_module_state(*module_, *group_, /*parameters=*/false, /*buffers=*/true);
  }
}

void DdpRuntime::after_forward(const std::vector<at::Tensor>& outputs) {
  reducer_->prepare_for_backward(outputs);
}

DdpRuntime::~DdpRuntime() = default;

void DdpRuntime::set_require_sync(bool require_sync) { reducer_->set_require_sync(require_sync); }

bool DdpRuntime::require_sync() const { return reducer_->require_sync(); }

const std::vector<std::vector<size_t>>& DdpRuntime::bucket_assignment() const { return reducer_->bucket_assignment(); }

bool DdpRuntime::buckets_rebuilt() const { return reducer_->buckets_rebuilt(); }

double DdpRuntime::bucket_cap_mb() const {
  return static_cast<double>(reducer_->bucket_cap_bytes()) / (1024.0 * 1024.0);
}

const at::Tensor& DdpRuntime::bucket_buffer(size_t index) const { return reducer_->bucket_buffer(index); }

void DdpRuntime::note_loss(const at::Tensor& loss) {
  DDP_CHECK(rider_, "ddp: note_loss needs DDPOptions().carry_loss(true)");
  rider_->note_loss(loss);
}

const ReducedLoss& DdpRuntime::reduced_loss() const {
  static const ReducedLoss none;
  return rider_ ? rider_->reduced_loss() : none;
}

void DdpRuntime::step_in_backward(torch::optim::Optimizer* optimizer) {
  std::shared_ptr<CommHook> hook = rider_ ? rider_ : comm_hook_;
  if (optimizer) {
    DDP_CHECK(!rider_, "ddp: step_in_backward steps the optimizer before backward returns, so a non-finite loss "
              "carried by carry_loss could no longer skip the step; drop carry_loss, or step the optimizer "
              "yourself after backward");
    DDP_CHECK(dynamic_cast<torch::optim::LBFGS*>(optimizer) == nullptr, "ddp: LBFGS evaluates a closure over "
              "every parameter in each step, so it cannot step bucket by bucket in backward; call "
              "optimizer.step(closure) yourself");
    std::unordered_set<const c10::TensorImpl*> mine;
    for (const auto& p : reducer_->params()) mine.insert(p.unsafeGetTensorImpl());
    size_t foreign = 0;
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) foreign += mine.count(p.unsafeGetTensorImpl()) ? 0 : 1;
    }
    DDP_CHECK(foreign == 0, "ddp: step_in_backward: ", foreign, " of the optimizer's parameters are not this "
              "model's, and no bucket would ever step them; build the optimizer from model->parameters(), or "
              "step a second optimizer for the others yourself");
    hook = std::make_shared<OptimizerStepHook>(hook ? hook : allreduce_hook(), *optimizer, reducer_->params());
  }
  reducer_->set_comm_hook(std::move(hook));
  optimizer_in_backward_ = optimizer;
}

void DdpRuntime::shadow_step() {
  before_forward();
  reducer_->shadow_backward();
}

}  // namespace detail

NoSyncGuard::NoSyncGuard(detail::DdpRuntime& runtime) : runtime_(&runtime), previous_(runtime.require_sync()) {
  runtime_->set_require_sync(false);
}

NoSyncGuard::~NoSyncGuard() {
  if (runtime_) runtime_->set_require_sync(previous_);
}

int Join::step() {
  DDP_CHECK(!finished_, "ddp: Join::step() after finish()");
  at::Tensor active = at::ones({1}, group_.control_options().dtype(at::kInt));
  CollectiveTag tag("join flag");
  group_.all_reduce(active);
  ++steps_;
  return active.item<int>();
}

void Join::finish() {
  DDP_CHECK(!finished_, "ddp: Join::finish() called twice");
  finished_ = true;
  while (true) {
    at::Tensor active = at::zeros({1}, group_.control_options().dtype(at::kInt));
    {
      CollectiveTag tag("join flag");
      group_.all_reduce(active);
    }
    if (active.item<int>() == 0) break;
    runtime_.shadow_step();
    ++shadowed_;
  }
  // The rank that trained longest holds the weights every step touched;
  // the highest such rank is the source for all.
  at::Tensor longest = at::full({1}, steps_, group_.control_options().dtype(at::kLong));
  group_.all_reduce(longest, c10d::ReduceOp::MAX);
  at::Tensor source = at::full({1}, steps_ == longest.item<int64_t>() ? group_.rank() : -1,
                               group_.control_options().dtype(at::kLong));
  group_.all_reduce(source, c10d::ReduceOp::MAX);
  detail::broadcast_module_state(runtime_.tensors(), group_, /*parameters=*/true, /*buffers=*/true,
                                 static_cast<int>(source.item<int64_t>()));
}
}  // namespace ddp
