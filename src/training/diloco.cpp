// DiLoCo, Streaming DiLoCo and post-local SGD (include/ddp/diloco.h).
//
// The state is a step count and, per fragment, at most one sync in flight;
// every decision is a function of the step count, so all ranks issue the
// same collectives in the same order without talking about it.

#include <ddp/diloco.h>

#include <ddp/collective_trace.h>
#include <ddp/error.h>
#include <ddp/fault_tolerance.h>
#include <ddp/snapshot.h>

#include "checkpoint/optimizer_state.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <unordered_map>

namespace ddp {
namespace {

constexpr int64_t kStateVersion = 1;
constexpr int64_t kInt8Block = 256;

// One fragment's pseudo-gradient between issue and completion.
struct PendingSync {
  int64_t due = 0;                      // the inner step at whose end it is applied
  c10::intrusive_ptr<c10d::Work> work;  // null once waited for
  at::Tensor buffer;                    // what travels (fp32, bf16 or the int8 payload)
  at::Tensor gathered;                  // int8 only: every rank's payload
  int64_t numel = 0;                    // values in the fragment
  at::Tensor sum;                       // fp32, over the ranks, once waited for
};

std::string dtype_name(OuterGradientDtype dtype) {
  switch (dtype) {
    case OuterGradientDtype::kFloat32:
      return "fp32";
    case OuterGradientDtype::kBFloat16:
      return "bf16";
    case OuterGradientDtype::kInt8:
      return "int8";
  }
  return "?";
}

// 8-bit values with one fp32 scale per block, packed into bytes so that the
// ranks exchange one tensor: [int8 values, padded to whole blocks][scales].
at::Tensor quantize_int8(const at::Tensor& values) {
  const int64_t numel = values.numel();
  const int64_t blocks = (numel + kInt8Block - 1) / kInt8Block;
  at::Tensor padded = at::zeros({blocks * kInt8Block}, values.options().dtype(at::kFloat));
  padded.narrow(0, 0, numel).copy_(values);
  at::Tensor rows = padded.view({blocks, kInt8Block});
  at::Tensor absmax = rows.abs().amax(1);
  // An all-zero block keeps scale 1 rather than dividing by zero.
  at::Tensor scales = at::where(absmax > 0, absmax / 127.0, at::ones_like(absmax));
  at::Tensor q = (rows / scales.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  at::Tensor payload = at::empty({blocks * kInt8Block + blocks * 4}, values.options().dtype(at::kByte));
  payload.narrow(0, 0, blocks * kInt8Block).copy_(q.view({-1}).view(at::kByte));
  payload.narrow(0, blocks * kInt8Block, blocks * 4).copy_(scales.contiguous().view(at::kByte));
  return payload;
}

at::Tensor dequantize_int8(const at::Tensor& payload, int64_t numel) {
  const int64_t blocks = (numel + kInt8Block - 1) / kInt8Block;
  at::Tensor q = payload.narrow(0, 0, blocks * kInt8Block).view(at::kChar).to(at::kFloat).view({blocks, kInt8Block});
  at::Tensor scales = payload.narrow(0, blocks * kInt8Block, blocks * 4).clone().view(at::kFloat);
  return (q * scales.unsqueeze(1)).view({-1}).narrow(0, 0, numel);
}

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.detach().reshape({-1}));
  return at::cat(parts);
}

// Views of `flat` shaped as `like`, in order.
std::vector<at::Tensor> unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> views;
  int64_t at = 0;
  for (const auto& t : like) {
    views.push_back(flat.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
  return views;
}

}  // namespace

std::vector<std::vector<size_t>> split_into_fragments(const std::vector<int64_t>& numels, int64_t count) {
  DDP_CHECK(count >= 1, "ddp: DiLoCo needs at least 1 fragment, got ", count);
  DDP_CHECK(static_cast<size_t>(count) <= numels.size(), "ddp: DiLoCo cannot split ", numels.size(),
            " parameters into ", count, " fragments (each needs at least one); use at most ", numels.size());
  const int64_t n = static_cast<int64_t>(numels.size());
  const int64_t total = std::max<int64_t>(1, std::accumulate(numels.begin(), numels.end(), int64_t{0}));
  std::vector<std::vector<size_t>> fragments(static_cast<size_t>(count));
  int64_t seen = 0;
  int64_t current = 0;
  for (int64_t i = 0; i < n; ++i) {
    // The fragment in whose share this parameter's middle falls, but never
    // skipping one, and leaving a parameter for every later fragment.
    const int64_t wanted = (seen + numels[i] / 2) * count / total;
    const int64_t least = (count - 1) - std::min(count - 1, n - 1 - i);
    const int64_t f = i == 0 ? 0 : std::clamp(std::max(wanted, least), current, std::min(current + 1, count - 1));
    fragments[f].push_back(static_cast<size_t>(i));
    current = f;
    seen += numels[i];
  }
  return fragments;
}

struct DiLoCo::Impl {
  std::vector<at::Tensor> params;
  torch::optim::Optimizer* inner = nullptr;
  torch::nn::Module* module = nullptr;  // when built over one: checkpoints name its tensors
  std::shared_ptr<ProcessGroup> group;      // null under fault tolerance
  FaultTolerance* ft = nullptr;             // the replicas' membership instead of a group
  int64_t skipped_syncs = 0;                // under fault tolerance: syncs whose quorum did not commit
  DiLoCoOptions options;
  std::vector<std::vector<size_t>> fragments;
  std::vector<at::Tensor> global;
  std::unique_ptr<torch::optim::Optimizer> outer;
  int64_t step = 0;
  int64_t syncs_started = 0;
  std::map<size_t, PendingSync> pending;  // by fragment

  void validate_options() const {
    DDP_CHECK(options.sync_every() >= 1, "ddp: DiLoCo's sync_every (H) is ", options.sync_every(),
              "; it must be at least 1 inner step between two syncs");
    DDP_CHECK(options.overlap_steps() >= 0 && options.overlap_steps() < options.sync_every(),
              "ddp: DiLoCo's overlap_steps (tau) is ", options.overlap_steps(), " with sync_every (H) ",
              options.sync_every(),
              "; it must be in [0, H): a fragment's sync must complete before its next one starts");
    DDP_CHECK(options.mixing() >= 0.0 && options.mixing() <= 1.0, "ddp: DiLoCo's mixing (alpha) is ", options.mixing(),
              "; it must be in [0, 1] (0 takes the global weights, 1 keeps the local ones)");
    DDP_CHECK(options.warmup_steps() >= 0, "ddp: DiLoCo's warmup_steps is ", options.warmup_steps(),
              "; it must be 0 or more");
    DDP_CHECK(!options.global_dtype() || at::isFloatingType(*options.global_dtype()),
              "ddp: DiLoCo's global_dtype must be a floating type, got ", *options.global_dtype());
  }

  // Fragments given as tensors become indices, checked to cover every
  // parameter exactly once.
  void set_fragments(const std::vector<std::vector<at::Tensor>>& given) {
    std::unordered_map<const c10::TensorImpl*, size_t> index;
    for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i].unsafeGetTensorImpl(), i);
    std::vector<int> owner(params.size(), -1);
    DDP_CHECK(!given.empty(), "ddp: DiLoCo was given no fragments; pass at least one list of parameters");
    for (size_t f = 0; f < given.size(); ++f) {
      DDP_CHECK(!given[f].empty(), "ddp: DiLoCo's fragment ", f, " is empty; every fragment needs a parameter");
      std::vector<size_t> indices;
      for (const auto& t : given[f]) {
        auto it = index.find(t.unsafeGetTensorImpl());
        DDP_CHECK(it != index.end(), "ddp: DiLoCo's fragment ", f, " holds a tensor of shape ", t.sizes(),
                  " that is not one of the model's parameters; build fragments from the parameters passed to DiLoCo");
        DDP_CHECK(owner[it->second] == -1, "ddp: DiLoCo's fragments overlap: parameter ", it->second, " (shape ",
                  t.sizes(), ") is in fragment ", owner[it->second], " and in fragment ", f,
                  "; each parameter must be in exactly one");
        owner[it->second] = static_cast<int>(f);
        indices.push_back(it->second);
      }
      fragments.push_back(std::move(indices));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      DDP_CHECK(owner[i] != -1, "ddp: DiLoCo's fragments do not cover the model: parameter ", i, " (shape ",
                params[i].sizes(), ") is in none of the ", given.size(),
                " fragments; every parameter must be in exactly one");
    }
  }

  void make_global_copy() {
    torch::NoGradGuard no_grad;
    // One flat broadcast from rank 0: every replica starts from the same weights.
    at::Tensor flat = flatten(params);
    {
      CollectiveTag tag("diloco initial broadcast");
      group->broadcast(flat, 0);
    }
    auto views = unflatten(flat, params);
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(views[i]);
    for (const auto& p : params) {
      auto dtype = options.global_dtype().value_or(p.scalar_type());
      global.push_back(p.detach().to(options.global_device(), dtype, /*non_blocking=*/false, /*copy=*/true));
    }
  }

  void make_outer_optimizer() {
    if (options.outer_optimizer()) {
      outer = options.outer_optimizer()(global);
      DDP_CHECK(outer != nullptr, "ddp: DiLoCo's outer_optimizer factory returned no optimizer");
    } else {
      outer = std::make_unique<torch::optim::SGD>(global, torch::optim::SGDOptions(options.outer_lr())
                                                              .momentum(options.outer_momentum())
                                                              .nesterov(options.outer_nesterov()));
    }
    std::unordered_map<const c10::TensorImpl*, size_t> index;
    for (size_t i = 0; i < global.size(); ++i) index.emplace(global[i].unsafeGetTensorImpl(), i);
    std::vector<bool> seen(global.size(), false);
    size_t count = 0;
    for (const auto& group_ : outer->param_groups()) {
      for (const auto& p : group_.params()) {
        auto it = index.find(p.unsafeGetTensorImpl());
        DDP_CHECK(it != index.end(), "ddp: DiLoCo's outer optimizer optimises a tensor of shape ", p.sizes(),
                  " that is not in DiLoCo's global copy (the model's own parameters, or other tensors?); make it "
                  "over the global_parameters the outer_optimizer factory is given");
        DDP_CHECK(!seen[it->second], "ddp: DiLoCo's outer optimizer lists global parameter ", it->second,
                  " twice; list each once");
        seen[it->second] = true;
        ++count;
      }
    }
    DDP_CHECK(count == global.size(), "ddp: DiLoCo's outer optimizer optimises ", count, " of the ", global.size(),
              " global parameters; it must optimise every one the outer_optimizer factory is given");
  }

  // The step, counted from the end of the warm-up, at which fragment f
  // starts its syncs: staggered evenly over the period.
  int64_t offset(size_t f) const {
    const int64_t h = options.sync_every();
    const int64_t n = static_cast<int64_t>(fragments.size());
    return ((static_cast<int64_t>(f) + 1) * h / n) % h;
  }

  void average_gradients() {
    std::vector<at::Tensor> grads;
    for (auto& p : params) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      grads.push_back(p.grad());
    }
    at::Tensor flat = flatten(grads);
    {
      CollectiveTag tag("diloco warm-up gradients");
      group->all_reduce(flat);
    }
    flat.div_(group->size());
    auto views = unflatten(flat, grads);
    for (size_t i = 0; i < grads.size(); ++i) grads[i].copy_(views[i]);
  }

  void start_sync(size_t f) {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> deltas;
    for (size_t i : fragments[f]) {
      const auto& p = params[i];
      deltas.push_back((global[i].to(p.device(), at::kFloat) - p.to(at::kFloat)).reshape({-1}));
    }
    PendingSync sync;
    sync.due = step + options.overlap_steps();
    at::Tensor flat = at::cat(deltas);
    sync.numel = flat.numel();
    CollectiveTag tag("diloco fragment " + std::to_string(f) + "/" + std::to_string(fragments.size()) + " step " +
                      std::to_string(step) + " " + dtype_name(options.outer_gradient_dtype()));
    switch (options.outer_gradient_dtype()) {
      case OuterGradientDtype::kFloat32:
        sync.buffer = flat;
        sync.work = group->all_reduce_async(sync.buffer);
        break;
      case OuterGradientDtype::kBFloat16:
        sync.buffer = flat.to(at::kBFloat16);
        sync.work = group->all_reduce_async(sync.buffer);
        break;
      case OuterGradientDtype::kInt8:
        sync.buffer = quantize_int8(flat);
        sync.gathered = at::empty({sync.buffer.numel() * group->size()}, sync.buffer.options());
        sync.work = group->all_gather_into_async(sync.gathered, sync.buffer);
        break;
    }
    ++syncs_started;
    pending[f] = std::move(sync);
  }

  // Waits for a sync's collective and turns what arrived into the fp32 sum
  // over the ranks; the same arithmetic whether it happens at the due step
  // or in state_dict(), so a checkpoint does not change the trajectory.
  void finish_transfer(PendingSync& sync) {
    if (!sync.work) return;
    group->wait(sync.work, "DiLoCo's pseudo-gradient sync");
    sync.work.reset();
    switch (options.outer_gradient_dtype()) {
      case OuterGradientDtype::kFloat32:
        sync.sum = sync.buffer;
        break;
      case OuterGradientDtype::kBFloat16:
        sync.sum = sync.buffer.to(at::kFloat);
        break;
      case OuterGradientDtype::kInt8: {
        const int64_t width = sync.buffer.numel();
        sync.sum = at::zeros({sync.numel}, sync.buffer.options().dtype(at::kFloat));
        for (int r = 0; r < group->size(); ++r) {
          sync.sum.add_(dequantize_int8(sync.gathered.narrow(0, r * width, width), sync.numel));
        }
        break;
      }
    }
    sync.buffer = at::Tensor();
    sync.gathered = at::Tensor();
  }

  // `replicas`: how many summed into the sync (the group's size, or the
  // members of a fault-tolerant step).
  void complete_sync(size_t f, int replicas = 0) {
    PendingSync& sync = pending.at(f);
    finish_transfer(sync);
    torch::NoGradGuard no_grad;
    at::Tensor average = sync.sum / static_cast<double>(replicas > 0 ? replicas : group->size());
    for (auto& g : global) g.mutable_grad().reset();
    int64_t at_ = 0;
    for (size_t i : fragments[f]) {
      const int64_t n = global[i].numel();
      global[i].mutable_grad() = average.narrow(0, at_, n)
                                     .view(global[i].sizes())
                                     .to(global[i].device(), global[i].scalar_type(), false, /*copy=*/true);
      at_ += n;
    }
    // The other fragments' globals have no gradient, so the outer step
    // leaves them (and their momentum) alone.
    outer->step();
    const double alpha = options.mixing();
    for (size_t i : fragments[f]) {
      global[i].mutable_grad().reset();
      at::Tensor incoming = global[i].to(params[i].device(), params[i].scalar_type());
      if (alpha == 0.0) {
        params[i].copy_(incoming);
      } else {
        params[i].mul_(alpha).add_(incoming, 1.0 - alpha);
      }
    }
    pending.erase(f);
  }

  // One sync under fault tolerance (one FaultTolerance step spans a round of
  // H inner steps, from the start_step() after the last sync to this one's
  // vote): the pseudo-gradient summed over the step's members, the outer
  // step only on a committed vote. A skipped sync leaves the global copy and
  // the local weights alone, so the next sync's global − local carries this
  // round's progress too; then the next round starts (a joiner heals there).
  void sync_fault_tolerant() {
    std::vector<at::Tensor> deltas;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        deltas.push_back((global[i].to(params[i].device(), at::kFloat) - params[i].to(at::kFloat)).reshape({-1}));
      }
    }
    PendingSync sync;
    sync.buffer = at::cat(deltas);
    sync.numel = sync.buffer.numel();
    ++syncs_started;
    const int members = ft->size();
    {
      CollectiveTag tag("diloco fault-tolerant sync step " + std::to_string(step));
      ft->all_reduce_sum(sync.buffer);  // a failure makes should_commit() false on every member
    }
    if (ft->should_commit()) {
      sync.sum = sync.buffer;
      sync.buffer = at::Tensor();
      pending[0] = std::move(sync);
      complete_sync(0, members);
    } else {
      ++skipped_syncs;
    }
    ft->start_step();
  }

  // What a joiner takes from a live member at a round's start: the global
  // copy (also its local weights), the outer and inner optimizers' state and
  // the counters.
  void save_for_joiner(torch::serialize::OutputArchive& archive) {
    archive.write("step", at::scalar_tensor(step, at::kLong));
    archive.write("syncs_started", at::scalar_tensor(syncs_started, at::kLong));
    archive.write("skipped_syncs", at::scalar_tensor(skipped_syncs, at::kLong));
    for (size_t i = 0; i < global.size(); ++i) archive.write("global/" + std::to_string(i), global[i].detach());
    torch::serialize::OutputArchive outer_archive, inner_archive;
    outer->save(outer_archive);
    inner->save(inner_archive);
    archive.write("outer", outer_archive);
    archive.write("inner", inner_archive);
  }

  void load_as_joiner(torch::serialize::InputArchive& archive) {
    torch::NoGradGuard no_grad;
    auto read = [&](const std::string& key) {
      at::Tensor value;  // fresh each time: read() re-points it at the saved storage
      archive.read(key, value);
      return value;
    };
    step = read("step").item<int64_t>();
    syncs_started = read("syncs_started").item<int64_t>();
    skipped_syncs = read("skipped_syncs").item<int64_t>();
    for (size_t i = 0; i < global.size(); ++i) {
      at::Tensor value = read("global/" + std::to_string(i));
      DDP_CHECK(value.sizes() == global[i].sizes(), "ddp: the fault-tolerant DiLoCo job's global parameter ", i,
                " has shape ", value.sizes(), ", this replica's ", global[i].sizes(),
                "; every replica must build the same model");
      global[i].copy_(value);
      params[i].copy_(global[i]);
    }
    torch::serialize::InputArchive outer_archive, inner_archive;
    archive.read("outer", outer_archive);
    archive.read("inner", inner_archive);
    outer->load(outer_archive);
    inner->load(inner_archive);
  }

  void refresh_global_from_local() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) global[i].copy_(params[i]);
  }
};

namespace {
// The fragments options.fragments() asks for, as tensors.
std::vector<std::vector<at::Tensor>> default_fragments(const std::vector<at::Tensor>& parameters,
                                                       const DiLoCoOptions& options) {
  DDP_CHECK(!parameters.empty(), "ddp: DiLoCo was given no parameters; pass the model's parameters()");
  DDP_CHECK(options.sync_every() >= 1, "ddp: DiLoCo's sync_every (H) is ", options.sync_every(),
            "; it must be at least 1 inner step between two syncs");
  DDP_CHECK(options.fragments() <= options.sync_every(), "ddp: DiLoCo has ", options.fragments(),
            " fragments but sync_every (H) is ", options.sync_every(),
            "; the fragments' syncs are staggered over H steps, so use at most H fragments");
  std::vector<int64_t> numels;
  for (const auto& p : parameters) numels.push_back(p.numel());
  std::vector<std::vector<at::Tensor>> fragments;
  for (const auto& indices : split_into_fragments(numels, options.fragments())) {
    fragments.emplace_back();
    for (size_t i : indices) fragments.back().push_back(parameters[i]);
  }
  return fragments;
}
}  // namespace

DiLoCo::DiLoCo(std::vector<at::Tensor> parameters, torch::optim::Optimizer& inner, std::shared_ptr<ProcessGroup> group,
               DiLoCoOptions options)
    : DiLoCo(parameters, default_fragments(parameters, options), inner, std::move(group), options) {}

DiLoCo::DiLoCo(std::vector<at::Tensor> parameters, std::vector<std::vector<at::Tensor>> fragments,
               torch::optim::Optimizer& inner, std::shared_ptr<ProcessGroup> group, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>()) {
  DDP_CHECK(group != nullptr, "ddp: DiLoCo was given no process group");
  DDP_CHECK(!parameters.empty(), "ddp: DiLoCo was given no parameters; pass the model's parameters()");
  auto& s = *impl_;
  s.params = std::move(parameters);
  s.inner = &inner;
  s.group = std::move(group);
  s.options = std::move(options);
  s.validate_options();
  s.set_fragments(fragments);
  DDP_CHECK(static_cast<int64_t>(s.fragments.size()) <= s.options.sync_every(), "ddp: DiLoCo has ", s.fragments.size(),
            " fragments but sync_every (H) is ", s.options.sync_every(),
            "; the fragments' syncs are staggered over H steps, so use at most H fragments");
  s.make_global_copy();
  s.make_outer_optimizer();
}

DiLoCo::DiLoCo(torch::nn::Module& model, torch::optim::Optimizer& inner, std::shared_ptr<ProcessGroup> group,
               DiLoCoOptions options)
    : DiLoCo(model.parameters(), inner, std::move(group), std::move(options)) {
  impl_->module = &model;
}

DiLoCo::DiLoCo(torch::nn::Module& model, torch::optim::Optimizer& inner, FaultTolerance& ft, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.params = model.parameters();
  DDP_CHECK(!s.params.empty(), "ddp: DiLoCo was given a model without parameters");
  s.inner = &inner;
  s.module = &model;
  s.ft = &ft;
  s.options = std::move(options);
  s.validate_options();
  DDP_CHECK(s.options.fragments() == 1 && s.options.overlap_steps() == 0 && s.options.warmup_steps() == 0 &&
                s.options.mixing() == 0.0 && s.options.outer_gradient_dtype() == OuterGradientDtype::kFloat32,
            "ddp: DiLoCo under FaultTolerance is plain DiLoCo (one fragment, no overlap, no warm-up, mixing 0, fp32 "
            "pseudo-gradients); got fragments ",
            s.options.fragments(), ", overlap_steps ", s.options.overlap_steps(), ", warmup_steps ",
            s.options.warmup_steps(), ", mixing ", s.options.mixing(), ", dtype ",
            dtype_name(s.options.outer_gradient_dtype()), ". Use those defaults, or DiLoCo over a ProcessGroup");
  s.fragments.emplace_back();
  for (size_t i = 0; i < s.params.size(); ++i) s.fragments[0].push_back(i);
  for (const auto& p : s.params) {
    auto dtype = s.options.global_dtype().value_or(p.scalar_type());
    s.global.push_back(p.detach().to(s.options.global_device(), dtype, /*non_blocking=*/false, /*copy=*/true));
  }
  s.make_outer_optimizer();
  Impl* impl = impl_.get();
  ft.manage_state([impl](torch::serialize::OutputArchive& a) { impl->save_for_joiner(a); },
                  [impl](torch::serialize::InputArchive& a) { impl->load_as_joiner(a); });
  // The first round: joins the first quorum (every replica takes rank 0's
  // state, as the broadcast over a group does) or heals from a live member.
  ft.start_step();
}

DiLoCo::~DiLoCo() {
  if (!impl_) return;
  // A sync still in flight holds a buffer the backend writes into; wait so
  // that it never writes freed memory. Errors here are the peers' and are
  // reported by whatever collective comes next, not by a destructor.
  for (auto& [f, sync] : impl_->pending) {
    if (!sync.work) continue;
    try {
      sync.work->wait();
    } catch (...) {
    }
  }
}

void DiLoCo::step() {
  auto& s = *impl_;
  if (s.ft != nullptr) {
    s.inner->step();
    ++s.step;
    if (s.step % s.options.sync_every() == 0) s.sync_fault_tolerant();
    return;
  }
  const bool warming_up = s.step < s.options.warmup_steps();
  if (warming_up && s.group->size() > 1) s.average_gradients();
  s.inner->step();
  ++s.step;
  if (warming_up) {
    // The replicas stayed identical while gradients were averaged; the
    // outer loop starts from where they are.
    if (s.step == s.options.warmup_steps()) s.refresh_global_from_local();
    return;
  }
  const int64_t t = s.step - s.options.warmup_steps();
  std::vector<size_t> due;
  for (const auto& [f, sync] : s.pending) {
    if (sync.due <= s.step) due.push_back(f);
  }
  for (size_t f : due) s.complete_sync(f);
  for (size_t f = 0; f < s.fragments.size(); ++f) {
    if (t % s.options.sync_every() != s.offset(f)) continue;
    DDP_CHECK(s.pending.count(f) == 0, "ddp: DiLoCo's fragment ", f, " is due to sync again at step ", s.step,
              " while its previous sync is still in flight");
    s.start_sync(f);
    if (s.options.overlap_steps() == 0) s.complete_sync(f);
  }
}

int64_t DiLoCo::inner_step() const { return impl_->step; }
const std::vector<at::Tensor>& DiLoCo::global_parameters() const { return impl_->global; }
torch::optim::Optimizer& DiLoCo::outer_optimizer() { return *impl_->outer; }
const std::vector<std::vector<size_t>>& DiLoCo::fragments() const { return impl_->fragments; }
int64_t DiLoCo::syncs_started() const { return impl_->syncs_started; }
int64_t DiLoCo::skipped_syncs() const { return impl_->skipped_syncs; }
FaultTolerance* DiLoCo::fault_tolerance() const { return impl_->ft; }
const DiLoCoOptions& DiLoCo::options() const { return impl_->options; }
std::shared_ptr<ProcessGroup> DiLoCo::process_group() const { return impl_->group; }
torch::nn::Module* DiLoCo::module() const { return impl_->module; }
const std::vector<at::Tensor>& DiLoCo::local_parameters() const { return impl_->params; }
torch::optim::Optimizer& DiLoCo::inner_optimizer() { return *impl_->inner; }

std::vector<size_t> DiLoCo::in_flight() const {
  std::vector<size_t> result;
  for (const auto& [f, sync] : impl_->pending) result.push_back(f);
  return result;
}

void DiLoCo::flush() {
  std::vector<size_t> all = in_flight();
  for (size_t f : all) impl_->complete_sync(f);
}

c10::IValue DiLoCo::state_dict() {
  auto& s = *impl_;
  DDP_CHECK(s.ft == nullptr, "ddp: DiLoCo under FaultTolerance has no state_dict(): a lost replica heals from a live "
                             "one, not from a checkpoint; checkpoint DiLoCo over a ProcessGroup instead");
  auto state = detail::new_generic_dict();
  state.insert("version", kStateVersion);
  state.insert("inner_step", s.step);
  state.insert("syncs_started", s.syncs_started);
  c10::impl::GenericList global(c10::AnyType::get());
  for (const auto& g : s.global) global.push_back(g.detach().clone());
  state.insert("global", global);
  state.insert("outer_optimizer", optimizer_state_dict(*s.outer));
  c10::impl::GenericList flights(c10::AnyType::get());
  for (auto& [f, sync] : s.pending) {
    s.finish_transfer(sync);
    auto entry = detail::new_generic_dict();
    entry.insert("fragment", static_cast<int64_t>(f));
    entry.insert("due", sync.due);
    entry.insert("sum", sync.sum.clone());
    flights.push_back(entry);
  }
  state.insert("in_flight", flights);
  return state;
}

void DiLoCo::load_state_dict(const c10::IValue& value) {
  auto& s = *impl_;
  DDP_CHECK(s.ft == nullptr, "ddp: DiLoCo under FaultTolerance has no load_state_dict(): a restarted replica heals "
                             "from a live one");
  DDP_CHECK(value.isGenericDict(), "ddp: DiLoCo::load_state_dict needs what state_dict() returned, a dict; got ",
            value.tagKind());
  auto state = value.toGenericDict();
  auto field = [&](const char* key) {
    DDP_CHECK(state.contains(key), "ddp: DiLoCo's saved state has no \"", key,
              "\"; it was not written by DiLoCo::state_dict()");
    return state.at(key);
  };
  DDP_CHECK(field("version").toInt() == kStateVersion, "ddp: DiLoCo's saved state has version ",
            field("version").toInt(), "; this build reads version ", kStateVersion);
  auto global = field("global").toList();
  DDP_CHECK(global.size() == s.global.size(), "ddp: DiLoCo's saved state holds ", global.size(),
            " global parameters, this model has ", s.global.size(), "; load it into the model it was saved from");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < s.global.size(); ++i) {
    at::Tensor saved = global.get(i).toTensor();
    DDP_CHECK(saved.sizes() == s.global[i].sizes(), "ddp: DiLoCo's saved global parameter ", i, " has shape ",
              saved.sizes(), ", the model's ", s.global[i].sizes());
    s.global[i].copy_(saved);
  }
  load_optimizer_state_dict(*s.outer, field("outer_optimizer"));
  for (auto& [f, sync] : s.pending) {
    if (sync.work) sync.work->wait();
  }
  s.pending.clear();
  auto flights = field("in_flight").toList();
  for (size_t k = 0; k < flights.size(); ++k) {
    auto entry = flights.get(k).toGenericDict();
    const auto f = static_cast<size_t>(entry.at("fragment").toInt());
    DDP_CHECK(f < s.fragments.size(), "ddp: DiLoCo's saved state has a sync of fragment ", f, "; this DiLoCo has ",
              s.fragments.size(), " fragments");
    PendingSync sync;
    sync.due = entry.at("due").toInt();
    sync.sum = entry.at("sum").toTensor().clone();
    sync.numel = sync.sum.numel();
    s.pending[f] = std::move(sync);
  }
  s.step = field("inner_step").toInt();
  s.syncs_started = field("syncs_started").toInt();
}

}  // namespace ddp
