// Step-time benchmark of ddp's DistributedDataParallel; the Python side is
// bench/python_ddp_bench.py, the driver bench/run_bench.py.
//
//   ddprun --standalone --nproc-per-node 2 ddp_bench --model mlp2m --mode ddp
//   ddp_bench --model mlp2m --mode local          # no process group at all
//   mpirun -np 2 ddp_bench --model wine --mode ddp --backend mpi
//   ddprun ... ddp_bench --mode collective --backend gloo   # raw all-reduce by size
//
// Modes: ddp, bucket-view (gradient_as_bucket_view), no-overlap, no-rebuild,
// local (no communication), manual (no DDP: one synchronous all-reduce of
// all gradients after backward), allreduce (communication only), collective
// (no model: float32 all-reduces of 4 KB, 1 MB, 8 MB and 40 MB).
//
// DDP modes also take --bucket-cap-mb, --comm-hook allreduce|fp16|bf16|
// powersgd|hierarchical (--powersgd-rank r; PowerSGD starts after 2 plain
// steps; hierarchical: hierarchical_allreduce_hook over
// DeviceMesh::from_launcher, the node stage on the node's own group) and
// --step-in-backward (Adam steps each bucket in backward).
//
// Prints one JSON line (rank 0): per-step times in ms after warm-up.

#include "bench_models.h"
#include "bench_stats.h"

#include "engine/bucket_assignment.h"  // internal (ddp_internal): the bucket rule alone
#include <ddp/collective_trace.h>
#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

#include <CLI/CLI.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string model = "mlp2m";
  std::string mode = "ddp";
  int64_t steps = 20;
  int64_t warmup = 5;
  int64_t batch = 0;  // per rank; 0 = the model's default
  std::string backend = "gloo";
  double bucket_cap_mb = 0;          // DDP modes: DDPOptions::bucket_cap_mb; 0: unset (fitted to the link)
  std::string comm_hook = "allreduce";  // DDP modes: allreduce, fp16, bf16 or powersgd
  int64_t powersgd_rank = 4;          // --comm-hook powersgd: matrix_approximation_rank
  bool only_4kb = false;              // collective mode: the 4 KB all-reduce alone
  bool step_in_backward = false;      // DDP modes: the optimizer steps bucket by bucket in backward
};

// The flags, bound to `c`, each with its default on --help.
void add_flags(CLI::App& app, Config& c) {
  app.option_defaults()->always_capture_default();
  app.add_option("--model", c.model, "the model")->check(CLI::IsMember({"wine", "mlp2m", "transformer"}));
  app.add_option("--mode", c.mode, "what is timed (see the top of bench/ddp_bench.cpp)")
      ->check(CLI::IsMember({"ddp", "bucket-view", "no-overlap", "no-rebuild", "local", "manual", "allreduce",
                             "collective", "trace-cost"}));
  app.add_option("--steps", c.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", c.batch, "samples per rank; 0: the model's default (wine 32, mlp2m 64, transformer 8)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--backend", c.backend,
                 "gloo, shm (shared memory, ranks on one host), nccl or mpi (ranks started by mpirun)");
  app.add_flag("--only-4kb", c.only_4kb, "collective mode: only the 4 KB all-reduce, 100000 times (for perf)");
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb,
                 "DDP modes: the bucket size cap in MB; 0: ddp's default, fitted to the link after the first step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--comm-hook", c.comm_hook,
                 "DDP modes: how each bucket is reduced (powersgd: warm-up of 2 steps, then compressed)")
      ->check(CLI::IsMember({"allreduce", "fp16", "bf16", "powersgd", "hierarchical"}));
  app.add_option("--powersgd-rank", c.powersgd_rank, "--comm-hook powersgd: the matrix approximation rank")
      ->check(CLI::PositiveNumber);
  app.add_flag("--step-in-backward", c.step_in_backward,
               "DDP modes: Adam steps each bucket as its all-reduce completes (model.step_in_backward)");
}

std::shared_ptr<ddp::CommHook> make_comm_hook(const Config& c, const std::shared_ptr<ddp::ProcessGroup>& group) {
  // Nodes x local ranks, as the launcher placed them: the node groups get
  // shared memory where ddp may choose it (--backend auto).
  if (c.comm_hook == "hierarchical") return ddp::hierarchical_allreduce_hook(ddp::DeviceMesh::from_launcher(group));
  if (c.comm_hook == "fp16") return ddp::fp16_compress_hook();
  if (c.comm_hook == "bf16") return ddp::bf16_compress_hook();
  if (c.comm_hook == "powersgd")
    return ddp::powersgd_hook(
        ddp::PowerSGDOptions().matrix_approximation_rank(c.powersgd_rank).start_powerSGD_iter(2));
  return nullptr;  // allreduce: the engine's own all-reduce
}

using bench::median;
using bench::significant;

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Per measured step, the step's parts: what an overlap of communication
// with backward can hide at most (bench/PROFILE.md's bound).
struct StepParts {
  std::vector<double> forward, backward, optimizer;
};

// Times optimizer steps of `forward_loss` (which runs forward and returns the
// loss) over `parameters`; with `parts`, also forward, backward and the
// optimizer apart (zero_grad counts to the optimizer). With
// `step_in_backward`, backward steps the optimizer that it is handed.
template <typename ForwardLoss>
std::vector<double> time_steps(const Config& c, std::vector<at::Tensor> parameters, ForwardLoss forward_loss,
                               StepParts* parts = nullptr,
                               const std::function<void(torch::optim::Optimizer&)>& step_in_backward = nullptr) {
  torch::optim::Adam optimizer(parameters, torch::optim::AdamOptions(1e-3));
  if (step_in_backward) step_in_backward(optimizer);
  std::vector<double> times;
  for (int64_t s = 0; s < c.warmup + c.steps; ++s) {
    auto start = Clock::now();
    optimizer.zero_grad();
    auto forward_start = Clock::now();
    at::Tensor loss = forward_loss();
    auto backward_start = Clock::now();
    loss.backward();
    auto optimizer_start = Clock::now();
    if (!step_in_backward) optimizer.step();
    auto end = Clock::now();
    if (s < c.warmup) continue;
    auto between = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    times.push_back(between(start, end));
    if (parts) {
      parts->forward.push_back(between(forward_start, backward_start));
      parts->backward.push_back(between(backward_start, optimizer_start));
      parts->optimizer.push_back(between(start, forward_start) + between(optimizer_start, end));
    }
  }
  return times;
}

template <typename Model, typename MakeLoss>
int run(const Config& c, Model model, int64_t batch, MakeLoss make_loss) {
  int64_t numel = 0, tensors = 0;
  for (auto& p : model->parameters()) numel += p.numel(), ++tensors;

  std::shared_ptr<ddp::ProcessGroup> group;
  std::vector<double> times;
  auto extra = nlohmann::ordered_json::object();  // the mode's own keys, after the common ones
  if (c.mode == "local") {
    StepParts parts;
    times = time_steps(
        c, model->parameters(), [&] { return make_loss([&](const at::Tensor& x) { return model->forward(x); }); },
        &parts);
    extra["forward_ms_median"] = significant(median(parts.forward));
    extra["backward_ms_median"] = significant(median(parts.backward));
    extra["optimizer_ms_median"] = significant(median(parts.optimizer));
  } else {
    group = ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::parse_backend(c.backend)));
    if (c.mode == "manual") {
      // No DDP: backward, then one hand-written all-reduce of all gradients.
      auto params = model->parameters();
      torch::optim::Adam optimizer(params, torch::optim::AdamOptions(1e-3));
      for (int64_t s = 0; s < c.warmup + c.steps; ++s) {
        auto start = Clock::now();
        optimizer.zero_grad();
        make_loss([&](const at::Tensor& x) { return model->forward(x); }).backward();
        std::vector<at::Tensor> grads;
        for (auto& p : params) grads.push_back(p.grad().reshape({-1}));
        at::Tensor flat = at::cat(grads).div_(group->size());
        group->all_reduce(flat);
        int64_t offset = 0;
        for (auto& p : params) {
          p.mutable_grad().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
          offset += p.numel();
        }
        optimizer.step();
        double ms = ms_since(start);
        if (s >= c.warmup) times.push_back(ms);
      }
    } else if (c.mode == "allreduce") {
      // The bucketed path's communication alone against one all-reduce of
      // the same bytes: what the engine costs over the transport.
      std::vector<ddp::detail::BucketTensorInfo> infos;
      for (auto& p : model->parameters()) infos.push_back({p.numel(), p.scalar_type(), p.device()});
      auto buckets = ddp::detail::compute_bucket_assignment(infos, 1 << 20, 25 << 20);
      std::vector<int64_t> sizes;
      auto params = model->parameters();
      for (auto& b : buckets) {
        int64_t n = 0;
        for (size_t i : b) n += params[i].numel();
        sizes.push_back(n);
      }
      std::vector<double> raw, bucketed;
      at::Tensor flat = at::ones({numel});
      for (int64_t s = 0; s < c.warmup + c.steps; ++s) {
        group->barrier();
        auto start = Clock::now();
        group->all_reduce(flat);
        double raw_ms = ms_since(start);
        std::vector<at::Tensor> bufs;
        for (int64_t n : sizes) bufs.push_back(at::ones({n}));
        group->barrier();
        start = Clock::now();
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        for (auto& b : bufs) {
          b.div_(group->size());
          works.push_back(group->all_reduce_async(b));
        }
        for (auto& w : works) group->wait(w, "all_reduce");
        double bucketed_ms = ms_since(start);
        if (s >= c.warmup) raw.push_back(raw_ms), bucketed.push_back(bucketed_ms);
      }
      times = bucketed;
      extra["raw_allreduce_ms_median"] = significant(median(raw));
      extra["bucketed_ms_median"] = significant(median(bucketed));
      extra["buckets"] = buckets.size();
      extra["raw_ms"] = significant(raw);
    } else {
      auto options = ddp::DDPOptions()
                         .overlap_with_backward(c.mode != "no-overlap")
                         .rebuild_buckets(c.mode != "no-rebuild")
                         .gradient_as_bucket_view(c.mode == "bucket-view")
                         .comm_hook(make_comm_hook(c, group));
      if (c.bucket_cap_mb > 0) options.bucket_cap_mb(c.bucket_cap_mb);
      ddp::DistributedDataParallel<Model> ddp_model(model, group, options);
      std::function<void(torch::optim::Optimizer&)> step_in_backward;
      if (c.step_in_backward) step_in_backward = [&](torch::optim::Optimizer& o) { ddp_model.step_in_backward(o); };
      times = time_steps(
          c, ddp_model->parameters(),
          [&] { return make_loss([&](const at::Tensor& x) { return ddp_model.forward(x); }); }, nullptr,
          step_in_backward);
      ddp_model.stop_stepping_in_backward();
      extra["buckets"] = ddp_model.bucket_assignment().size();
      extra["bucket_cap_mb"] = ddp_model.bucket_cap_mb();  // the fitted one when unset
      extra["comm_hook"] = c.comm_hook;
      extra["step_in_backward"] = c.step_in_backward;
      if (c.comm_hook == "powersgd") extra["powersgd_rank"] = c.powersgd_rank;
    }
  }
  int world = group ? group->size() : 1;
  if (!group || group->rank() == 0) {
    double med = median(times);
    nlohmann::ordered_json line = {{"impl", "cpp"},
                                   {"model", c.model},
                                   {"mode", c.mode},
                                   {"world", world},
                                   {"batch_per_rank", batch},
                                   {"parameters", numel},
                                   {"tensors", tensors},
                                   {"threads", at::get_num_threads()},
                                   {"step_ms_median", bench::rounded(med, 4)},
                                   {"samples_per_s", bench::rounded(1000.0 * world * batch / med, 2)},
                                   {"step_ms", significant(times)}};
    line.update(extra);
    bench::print_json_line(line);
  }
  if (group) group->barrier();
  return 0;
}

}  // namespace

// Raw all-reduce time by message size, medians over many iterations.
int collectives(const Config& c) {
  auto group = ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::parse_backend(c.backend)));
  struct Size {
    int64_t bytes;
    int iterations;
  };
  std::vector<int64_t> sizes;
  std::vector<double> medians;
  std::vector<Size> sweep = {Size{4 << 10, 1000}, Size{1 << 20, 100}, Size{8 << 20, 30}, Size{40 << 20, 10}};
  if (c.only_4kb) sweep = {Size{4 << 10, 100000}};
  for (Size size : sweep) {
    at::Tensor t = at::ones({size.bytes / 4});
    std::vector<double> times;
    for (int i = 0; i < size.iterations + 3; ++i) {
      group->barrier();
      auto start = Clock::now();
      group->all_reduce(t);
      double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      if (i >= 3) times.push_back(ms);
    }
    // The slowest rank's median decides the step.
    at::Tensor m = at::full({1}, median(times), at::kDouble);
    group->all_reduce(m, c10d::ReduceOp::MAX);
    sizes.push_back(size.bytes);
    medians.push_back(m.item<double>());
  }
  // Back to back: 1000 4 KB all-reduces timed together, so no barrier's
  // exit skew sits in the figure; per call, median of 7 batches.
  std::vector<double> batches;
  at::Tensor small = at::ones({1024});
  for (int batch = 0; batch < 8; ++batch) {
    group->barrier();
    auto start = Clock::now();
    for (int i = 0; i < 1000; ++i) group->all_reduce(small);
    if (batch > 0) batches.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count() / 1000);
  }
  at::Tensor back_to_back = at::full({1}, median(batches), at::kDouble);
  group->all_reduce(back_to_back, c10d::ReduceOp::MAX);
  if (group->rank() == 0) {
    bench::print_json_line({{"impl", "cpp"},
                            {"mode", "collective"},
                            {"backend", c.backend},
                            {"bytes", sizes},
                            {"median_ms", significant(medians)},
                            {"back_to_back_4kb_ms", significant(back_to_back.item<double>())}});
  }
  group->barrier();
  return 0;
}

// What the collective trace adds to one collective, measured alone: a
// record begun and ended, and the completion callback on a future, as
// ProcessGroup::enter and track do. No process group, no noise from peers.
int trace_cost() {
  ddp::CollectiveTrace trace;
  at::Tensor t = at::zeros({1091});
  ddp::CollectiveTag tag("ddp bucket 1/1");
  const int n = 200000;
  std::vector<double> per_call;
  for (int round = 0; round < 5; ++round) {
    auto start = Clock::now();
    for (int i = 0; i < n; ++i) {
      const uint64_t seq = trace.begin("all_reduce", t);
      auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
      future->addCallback([&trace, seq](c10::ivalue::Future& done) { trace.end(seq, !done.hasError()); });
      future->markCompleted(c10::IValue(t));
    }
    const double total_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    // The same loop without the trace: the future alone.
    start = Clock::now();
    for (int i = 0; i < n; ++i) {
      auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
      future->markCompleted(c10::IValue(t));
    }
    const double bare_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    per_call.push_back((total_us - bare_us) / n);
  }
  bench::print_json_line(
      {{"impl", "cpp"}, {"mode", "trace-cost"}, {"us_per_collective", bench::rounded(median(per_call), 4)}});
  return 0;
}

int main(int argc, char** argv) {
  Config c;
  CLI::App app("Step time of ddp's DistributedDataParallel; prints one JSON line (rank 0).", "ddp_bench");
  add_flags(app, c);
  CLI11_PARSE(app, argc, argv);
  try {
    if (c.mode == "trace-cost") return trace_cost();
    at::set_num_threads(1);  // one intra-op thread per rank, as on the Python side
    if (c.mode == "collective") return collectives(c);
    torch::manual_seed(0);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1);
    if (c.model == "wine" || c.model == "mlp2m") {
      bool wine = c.model == "wine";
      int64_t batch = c.batch ? c.batch : (wine ? 32 : 64);
      std::vector<int64_t> widths = wine ? std::vector<int64_t>{13, 64, 3} : std::vector<int64_t>{512, 1024, 1024, 512, 10};
      at::Tensor x = at::randn({batch, widths.front()}, generator);
      at::Tensor y = at::randint(0, widths.back(), {batch}, generator, at::kLong);
      return run(c, bench::Mlp(widths), batch, [&](auto forward) {
        return torch::nn::functional::cross_entropy(forward(x), y);
      });
    }
    if (c.model == "transformer") {
      int64_t batch = c.batch ? c.batch : 8;
      const int64_t vocab = 2048, context = 32;
      at::Tensor tokens = at::randint(0, vocab, {batch, context}, generator, at::kLong);
      at::Tensor targets = at::randint(0, vocab, {batch * context}, generator, at::kLong);
      return run(c, bench::Transformer(vocab, context, 256, 4, 12), batch, [&](auto forward) {
        return torch::nn::functional::cross_entropy(forward(tokens).view({-1, vocab}), targets);
      });
    }
    throw std::logic_error("--model " + c.model + " passed its check but has no code");
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
