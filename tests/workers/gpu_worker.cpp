// A worker for the GPU path's multi-process tests, launched through ddprun.
// The same scenarios run on the CPU (gloo) in the multiprocess tests, so
// they cannot rot on machines without GPUs, and on CUDA in the gpu tests.
//
//   gpu_worker equivalence [--device cpu|cuda] [--backend B] [--share-devices] [--hook allreduce|fp16|bf16]
//   gpu_worker grad_scaler [--device cpu|cuda] [--backend B] [--share-devices] [--inf-rank R] [--inf-step S]
//
// Each prints a marker line and exits 0 only on success.

#include <ddp/autocast.h>
#include <ddp/device.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/grad_scaler.h>
#include <ddp/error_file.h>
#include <ddp/process_group.h>

#include <CLI/CLI.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <string>

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::nn::functional::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// Every scenario's flags; each reads the ones it has.
struct Flags {
  std::string device = "cpu";
  std::string backend = "auto";
  bool share_devices = false;
  std::string hook = "allreduce";
  double tolerance = 1e-5;
  int inf_rank = 1;
  int64_t inf_step = 2;
};

struct Setup {
  c10::Device device{c10::kCPU};
  std::shared_ptr<ddp::ProcessGroup> group;
};

Setup setup(const Flags& flags) {
  Setup s;
  auto options =
      ddp::DeviceOptions().kind(ddp::parse_device_kind(flags.device)).share_devices(flags.share_devices);
  s.device = ddp::init_device(ddp::world_from_env(), options);
  s.group = ddp::init_process_group(
      ddp::ProcessGroupOptions().device(s.device).backend(ddp::parse_backend(flags.backend)));
  return s;
}

at::Tensor flat_parameters(torch::nn::Module& module) {
  std::vector<at::Tensor> flat;
  for (auto& p : module.parameters()) flat.push_back(p.detach().reshape({-1}).to(at::kCPU));
  return at::cat(flat);
}

// N ranks with batch b each against rank 0 training alone on the N batches
// side by side, with SGD (so the comparison does not amplify rounding).
int equivalence(const Flags& flags) {
  Setup s = setup(flags);
  const int world = s.group->size();
  const int64_t steps = 5, batch = 8;
  const double tolerance = flags.tolerance;
  const std::string& hook = flags.hook;
  auto options = ddp::DDPOptions().bucket_cap_mb(0.001).first_bucket_cap_mb(0.001);  // several buckets
  if (hook == "fp16") options.comm_hook(ddp::fp16_compress_hook());
  if (hook == "bf16") options.comm_hook(ddp::bf16_compress_hook());

  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor x = at::randn({steps, world * batch, 10}, generator).to(s.device);
  at::Tensor y = at::randint(0, 4, {steps, world * batch}, generator, at::kLong).to(s.device);

  torch::manual_seed(100 + s.group->rank());  // DDP must replace these with rank 0's
  Mlp model;
  model->to(s.device);
  ddp::DistributedDataParallel<Mlp> ddp_model(model, s.group, options);
  at::Tensor initial = flat_parameters(*model);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int64_t step = 0; step < steps; ++step) {
    at::Tensor mine_x = x[step].narrow(0, s.group->rank() * batch, batch);
    at::Tensor mine_y = y[step].narrow(0, s.group->rank() * batch, batch);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(ddp_model.forward(mine_x), mine_y).backward();
    optimizer.step();
  }
  at::Tensor mine = flat_parameters(*model);
  auto all = s.group->all_gather(mine.to(s.group->control_options().device()));
  for (int r = 1; r < world; ++r) {
    if (!at::equal(all[r].cpu(), all[0].cpu())) {
      std::printf("REPLICAS differ: rank %d vs rank 0\n", r);
      return 3;
    }
  }
  if (s.group->rank() == 0) {
    Mlp reference;
    reference->to(s.device);
    {
      torch::NoGradGuard no_grad;
      int64_t offset = 0;
      for (auto& p : reference->parameters()) {
        p.copy_(initial.narrow(0, offset, p.numel()).view(p.sizes()));
        offset += p.numel();
      }
    }
    torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1));
    for (int64_t step = 0; step < steps; ++step) {
      reference_optimizer.zero_grad();
      torch::nn::functional::cross_entropy(reference->forward(x[step]), y[step]).backward();
      reference_optimizer.step();
    }
    double diff = (flat_parameters(*reference) - mine).abs().max().item<double>();
    double moved = (mine - initial).abs().max().item<double>();
    std::printf("EQUIVALENCE device=%s backend=%s hook=%s world=%d max_abs_diff=%.3g moved=%.3g\n",
                s.device.str().c_str(), ddp::to_string(s.group->backend()).c_str(), hook.c_str(), world, diff, moved);
    if (!(diff <= tolerance) || moved < 1e-4) return 4;
  }
  s.group->barrier();
  return 0;
}

// One rank's local gradients overflow at one step (after DDP's average, so
// only the GradScaler's own all-reduce can tell the others): every rank
// must skip that step, back off the same, and keep identical weights.
int grad_scaler(const Flags& flags) {
  Setup s = setup(flags);
  const int inf_rank = flags.inf_rank;
  const int64_t inf_step = flags.inf_step;
  const int64_t steps = 5;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(11 + s.group->rank());
  at::Tensor x = at::randn({16, 10}, generator).to(s.device);
  at::Tensor y = at::randint(0, 4, {16}, generator, at::kLong).to(s.device);

  Mlp model;
  model->to(s.device);
  ddp::DistributedDataParallel<Mlp> ddp_model(model, s.group);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  ddp::GradScaler scaler(ddp::GradScalerOptions().growth_interval(2), s.group);
  // float16 autocast where it matters (CUDA); float32 on the CPU.
  const bool fp16 = s.device.is_cuda();
  std::string pattern;
  for (int64_t step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    at::Tensor loss;
    {
      ddp::AutocastGuard autocast(s.device.type(), at::kHalf, fp16);
      loss = torch::nn::functional::cross_entropy(ddp_model.forward(x), y);
    }
    scaler.scale(loss).backward();
    if (s.group->rank() == inf_rank && step == inf_step) {
      torch::NoGradGuard no_grad;
      model->fc1->weight.mutable_grad().view({-1})[0].fill_(std::numeric_limits<float>::infinity());
    }
    at::Tensor before = flat_parameters(*model);
    bool stepped = scaler.step(optimizer);
    bool moved = !at::equal(before, flat_parameters(*model));
    if (stepped != moved) {
      std::printf("SCALER step %lld: step() returned %d but the weights %s\n", static_cast<long long>(step), stepped,
                  moved ? "moved" : "did not move");
      return 5;
    }
    scaler.update();
    pattern += stepped ? '1' : '0';
  }
  // Expected: every step but inf_step; the scale backed off once (x0.5)
  // and grew once per 2 clean steps after it (growth_interval 2).
  std::string expected(steps, '1');
  expected[inf_step] = '0';
  int64_t clean_after = steps - inf_step - 1;
  int64_t clean_before = inf_step;
  double expected_scale = 65536.0 * std::pow(2.0, clean_before / 2) * 0.5 * std::pow(2.0, clean_after / 2);
  std::printf("SCALER rank=%d stepped=%s scale=%g expected_stepped=%s expected_scale=%g\n", s.group->rank(),
              pattern.c_str(), scaler.get_scale(), expected.c_str(), expected_scale);
  std::fflush(stdout);

  at::Tensor mine = flat_parameters(*model);
  auto all = s.group->all_gather(mine.to(s.group->control_options().device()));
  at::Tensor scale = at::full({1}, scaler.get_scale(), s.group->control_options().dtype(at::kDouble));
  auto scales = s.group->all_gather(scale);
  for (int r = 1; r < s.group->size(); ++r) {
    if (!at::equal(all[r].cpu(), all[0].cpu()) || !at::equal(scales[r].cpu(), scales[0].cpu())) {
      std::printf("SCALER replicas differ: rank %d vs rank 0\n", r);
      return 3;
    }
  }
  if (pattern != expected || scaler.get_scale() != expected_scale) return 4;
  std::printf("SCALER identical on %d ranks\n", s.group->size());
  s.group->barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"GPU-path scenarios for ddprun; each prints a marker line and exits 0 only on success."};
  app.require_subcommand(1);
  auto* equivalence_command = app.add_subcommand("equivalence", "N ranks against rank 0 alone on the N batches");
  auto* scaler_command = app.add_subcommand("grad_scaler", "one rank's gradients overflow at one step");
  for (CLI::App* command : {equivalence_command, scaler_command}) {
    command->add_option("--device", flags.device, "cpu or cuda")->capture_default_str();
    command->add_option("--backend", flags.backend, "auto, gloo or nccl")->capture_default_str();
    command->add_flag("--share-devices", flags.share_devices, "several ranks may share one GPU");
  }
  equivalence_command->add_option("--hook", flags.hook, "allreduce, fp16 or bf16")->capture_default_str();
  equivalence_command->add_option("--tolerance", flags.tolerance, "largest weight difference")->capture_default_str();
  scaler_command->add_option("--inf-rank", flags.inf_rank, "the rank whose gradient overflows")->capture_default_str();
  scaler_command->add_option("--inf-step", flags.inf_step, "the step it overflows at")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return equivalence_command->parsed() ? equivalence(flags) : grad_scaler(flags);
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
}
