// PowerSGD as a CommHook (include/ddp/comm_hooks.h): one step of power
// iteration per bucket and backward pass, with error feedback and warm start,
// after the algorithm of Vogels et al. (2019) as PyTorch's powerSGD_hook
// applies it to DDP buckets. The engine hands the bucket divided by the world
// size, so the sums below are already averages.
//
// A bucket's three collectives depend on each other (the uncompressed
// gradients and P, then Q from the reduced P), so they run on a thread of
// the hook's own (hook_thread.h) while backward goes on, as PyTorch's hook
// chains futures. They go to a group of the hook's own, a copy of DDP's made
// at the first compressed bucket: on DDP's group, the engine's own
// collectives (the unused-parameter flags) could come between them in
// another order on another rank.

#include <ddp/comm_hooks.h>

#include <ddp/error.h>

#include "engine/hook_thread.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <numeric>

namespace ddp {

struct PowerSGDHook::State {
  explicit State(PowerSGDOptions o) : options(std::move(o)) {}
  PowerSGDOptions options;
  int64_t iteration = 0;  // backward passes seen
  // Per bucket: what compression lost last time, and the last Qs (one flat
  // tensor holding every compressed matrix's Q, for warm start).
  std::map<size_t, at::Tensor> error;
  std::map<size_t, at::Tensor> q_memory;
  std::atomic<int64_t> uncompressed_elements{0};
  std::atomic<int64_t> sent_elements{0};
  // The hook's own copy of DDP's group, and the group it copies.
  std::shared_ptr<ProcessGroup> channel;
  const ProcessGroup* channel_of = nullptr;
  detail::HookThread thread;  // last: its jobs use the members above

  ProcessGroup& channel_for(ProcessGroup& group) {
    if (!channel) {
      std::vector<int> everyone(static_cast<size_t>(group.size()));
      std::iota(everyone.begin(), everyone.end(), 0);
      channel = group.new_group(everyone);
      channel_of = &group;
    }
    DDP_CHECK(channel_of == &group, "ddp: one PowerSGD hook serves one DDP model (it keeps each bucket's error and ",
              "Q); make a powersgd_hook() for each model");
    return *channel;
  }

  // One bucket's compression and its collectives on `channel`, on the hook's
  // thread; `input` ends holding the average's approximation.
  void compress(ProcessGroup& channel, at::Tensor input, const std::vector<at::Tensor>& gradients, size_t index);
};

namespace {

// The columns of each matrix made orthonormal (in place).
void orthogonalize(at::Tensor& matrix, double epsilon) {
  if (epsilon == 0.0) {
    matrix.copy_(std::get<0>(at::linalg_qr(matrix)));
    return;
  }
  // Gram-Schmidt, as PyTorch does when an epsilon is given.
  const int64_t columns = matrix.size(-1);
  for (int64_t i = 0; i < columns; ++i) {
    at::Tensor column = matrix.narrow(-1, i, 1);
    column.div_(column.norm(2, {-2}, /*keepdim=*/true).add_(epsilon));
    if (i + 1 < columns) {
      at::Tensor rest = matrix.narrow(-1, i + 1, columns - i - 1);
      rest.sub_((column * rest).sum({-2}, /*keepdim=*/true) * column);
    }
  }
}

void all_reduce(ProcessGroup& group, at::Tensor& tensor, const char* what) {
  group.wait(group.all_reduce_async(tensor), what);
}

}  // namespace

void PowerSGDHook::State::compress(ProcessGroup& channel, at::Tensor input, const std::vector<at::Tensor>& gradients,
                                   size_t index) {
  const auto& o = options;
  uncompressed_elements += input.numel();
  at::NoGradGuard no_grad;
  if (o.use_error_feedback()) {
    auto it = error.find(index);
    // A bucket of another size (buckets rebuilt) starts without feedback.
    if (it != error.end() && it->second.numel() == input.numel()) input.add_(it->second);
  }
  at::Tensor before = o.use_error_feedback() ? input.clone() : at::Tensor();

  // Which gradients travel as matrices, and which as they are.
  std::vector<at::Tensor> matrices, plain;
  std::vector<int64_t> ranks;
  auto consider = [&](const at::Tensor& tensor) {
    if (tensor.dim() >= 2) {
      const int64_t n = tensor.size(0), m = tensor.numel() / std::max<int64_t>(n, 1);
      const int64_t r = std::min({n, m, o.matrix_approximation_rank()});
      if (r > 0 && static_cast<double>((n + m) * r) * o.min_compression_rate() < static_cast<double>(n * m)) {
        matrices.push_back(tensor.view({n, m}));
        ranks.push_back(r);
        return;
      }
    }
    plain.push_back(tensor);
  };
  at::Tensor square;  // batched: the bucket as one square matrix, zero-padded
  if (o.batched()) {
    const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(input.numel()))));
    square = at::zeros({side * side}, input.options());
    square.narrow(0, 0, input.numel()).copy_(input);
    matrices.push_back(square.view({side, side}));
    ranks.push_back(std::min(side, o.matrix_approximation_rank()));
  } else {
    for (const auto& tensor : gradients) consider(tensor);
  }

  // The gradients not worth compressing: one all-reduce of them all.
  c10::intrusive_ptr<c10d::Work> plain_work;
  at::Tensor plain_flat;
  if (!plain.empty()) {
    std::vector<at::Tensor> flats;
    for (const auto& t : plain) flats.push_back(t.reshape({-1}));
    plain_flat = at::cat(flats);
    sent_elements += plain_flat.numel();
    plain_work = channel.all_reduce_async(plain_flat);
  }

  if (!matrices.empty()) {
    int64_t p_total = 0, q_total = 0;
    for (size_t i = 0; i < matrices.size(); ++i) {
      p_total += matrices[i].size(0) * ranks[i];
      q_total += matrices[i].size(1) * ranks[i];
    }
    at::Tensor p_flat = at::empty({p_total}, input.options());
    at::Tensor& q_flat = q_memory[index];
    const bool reuse_q = o.warm_start() && q_flat.defined() && q_flat.numel() == q_total;
    if (!reuse_q) q_flat = at::empty({q_total}, input.options());
    std::vector<at::Tensor> ps, qs;
    for (size_t i = 0, p_at = 0, q_at = 0; i < matrices.size(); ++i) {
      const int64_t n = matrices[i].size(0), m = matrices[i].size(1), r = ranks[i];
      ps.push_back(p_flat.narrow(0, p_at, n * r).view({n, r}));
      qs.push_back(q_flat.narrow(0, q_at, m * r).view({m, r}));
      p_at += n * r;
      q_at += m * r;
    }
    if (!reuse_q) {
      // The same random start on every rank: a generator seeded alike.
      auto generator = at::make_generator<at::CPUGeneratorImpl>(o.random_seed() + 1000003 * index);
      for (auto& q : qs) {
        q.copy_(at::randn(q.sizes(), generator, at::TensorOptions().dtype(q.scalar_type())));
        orthogonalize(q, o.orthogonalization_epsilon());
      }
    }
    for (size_t i = 0; i < matrices.size(); ++i) at::matmul_out(ps[i], matrices[i], qs[i]);
    sent_elements += p_total + q_total;
    all_reduce(channel, p_flat, "PowerSGD all_reduce of P");
    for (auto& p : ps) orthogonalize(p, o.orthogonalization_epsilon());
    for (size_t i = 0; i < matrices.size(); ++i) at::matmul_out(qs[i], matrices[i].t(), ps[i]);
    all_reduce(channel, q_flat, "PowerSGD all_reduce of Q");
    for (size_t i = 0; i < matrices.size(); ++i) at::matmul_out(matrices[i], ps[i], qs[i].t());
    if (o.batched()) input.copy_(square.narrow(0, 0, input.numel()));
  }
  if (plain_work) {
    channel.wait(plain_work, "PowerSGD all_reduce of the uncompressed gradients");
    int64_t at = 0;
    for (auto& t : plain) {
      t.copy_(plain_flat.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
  }
  // What this rank's contribution lost: the bucket holds its gradient
  // divided by the world size, and the result is the sum over ranks, so its
  // own share of the result is result / world size (the errors then sum to
  // the average's compression error, as in PyTorch's hook).
  if (o.use_error_feedback()) error[index] = before.sub_(input, 1.0 / channel.size());
}

PowerSGDHook::PowerSGDHook(PowerSGDOptions options) : state_(std::make_unique<State>(std::move(options))) {
  const auto& o = state_->options;
  DDP_CHECK(o.matrix_approximation_rank() >= 1, "ddp: PowerSGD's matrix_approximation_rank must be at least 1, got ",
            o.matrix_approximation_rank());
  DDP_CHECK(o.start_powerSGD_iter() >= 0, "ddp: PowerSGD's start_powerSGD_iter must be >= 0, got ",
            o.start_powerSGD_iter());
  DDP_CHECK(o.start_powerSGD_iter() >= 2 || (!o.use_error_feedback() && !o.warm_start()),
            "ddp: PowerSGD with error feedback or warm start needs start_powerSGD_iter >= 2 (its state must outlive "
            "DDP's bucket rebuild after the first backward); got ",
            o.start_powerSGD_iter());
  DDP_CHECK(o.min_compression_rate() >= 0 && o.orthogonalization_epsilon() >= 0,
            "ddp: PowerSGD's min_compression_rate and orthogonalization_epsilon must be >= 0");
}

PowerSGDHook::~PowerSGDHook() = default;

const PowerSGDOptions& PowerSGDHook::options() const { return state_->options; }

std::pair<int64_t, int64_t> PowerSGDHook::compression_stats() const {
  return {state_->uncompressed_elements, state_->sent_elements};
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::run(ProcessGroup& group, GradBucket& bucket) {
  DDP_CHECK(!bucket.scatters(), "ddp: PowerSGD compresses all-reduced buckets (DDP); FSDP's reduce-scatter needs "
                                "another hook (fp16_compress_hook, bf16_compress_hook)");
  State& s = *state_;
  const auto& o = s.options;
  at::Tensor& input = bucket.buffer();
  const bool compress = s.iteration >= o.start_powerSGD_iter();
  if (bucket.is_last()) ++s.iteration;
  if (!compress) return group.all_reduce_async(input)->getFuture();
  ProcessGroup& channel = s.channel_for(group);
  std::vector<at::Tensor> gradients;
  if (!o.batched()) {
    DDP_CHECK(!bucket.gradients().empty(), "ddp: PowerSGD needs the bucket's per-parameter gradients");
    gradients = bucket.gradients();
  }
  return s.thread.submit(input, [&s, &channel, input, gradients = std::move(gradients), index = bucket.index()] {
    s.compress(channel, input, gradients, index);
    return input;
  });
}

std::shared_ptr<PowerSGDHook> powersgd_hook(PowerSGDOptions options) {
  return std::make_shared<PowerSGDHook>(std::move(options));
}

}  // namespace ddp
