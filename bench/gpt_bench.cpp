// Step time of a GPT-2-style decoder (124M parameters by default) trained
// with ddp's DistributedDataParallel, against the same model without DDP.
// The Python twin is bench/python_gpt_bench.py (same model, names, init,
// data, optimizer and timing); bench/gpu_check.sh runs both side by side.
//
//   ddprun --standalone --nproc-per-node 1 build/bin/gpt_bench --mode ddp
//   build/bin/gpt_bench --mode local
//   build/bin/gpt_bench --device cpu --layers 2 --d-model 64 --heads 2 --seq 32 --vocab 256 --steps 2
//   ddprun --fault-tolerance ... build/bin/gpt_bench --device cpu ...   (bench/churn_bench.py)
//
// Prints one JSON line (rank 0): the median step time over --steps timed
// steps after --warmup, tokens/s, and the model FLOPs utilisation against
// --peak-tflops per GPU (an H200's dense bf16 peak by default), with
// FLOPs per token = 6 * parameters + 12 * layers * d_model * seq.
//
// Under ddprun --fault-tolerance (DDP_FAULT_TOLERANCE=1) the same model and
// optimizer train as replicas of ddp::FaultTolerance (run_fault_tolerant):
// DDP on its local group, a lost replica costs a skipped step, a restarted one
// heals from a live one. It trains until the job has committed --warmup +
// --steps steps and prints a `step` line per commit with the committed
// samples so far, so throughput can be judged over time (bench/CHURN.md).
// --log-steps prints the same lines in the other modes (restart mode's
// comparison: without snapshots a restarted job starts again at step 0).

#include "bench_stats.h"

#include <ddp/autocast.h>
#include <ddp/device.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fault_tolerance.h>
#include <ddp/process_group.h>

#include <CLI/CLI.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string mode = "ddp";      // ddp | local
  std::string device = "auto";   // auto | cpu | cuda
  std::string backend = "auto";  // auto | gloo | nccl
  std::string amp = "auto";      // auto (bf16 on CUDA, off on CPU) | bf16 | off
  bool share_devices = false;
  bool tied = true;
  bool log_steps = false;
  int64_t layers = 12, d_model = 768, heads = 12, vocab = 50257, seq = 1024, batch = 8;
  int64_t steps = 20, warmup = 5, threads = 0;
  uint64_t seed = 1234;
  double lr = 3e-4, peak_tflops = 989.5;
};

// The flags, bound to `c`, each with its default on --help.
void add_flags(CLI::App& app, Config& c) {
  app.option_defaults()->always_capture_default();
  app.add_option("--mode", c.mode, "ddp (DistributedDataParallel) or local (the bare model)")
      ->check(CLI::IsMember({"ddp", "local"}));
  // ddp::parse_device_kind and ddp::parse_backend check these two.
  app.add_option("--device", c.device, "auto (cuda:<local rank> when CUDA is available), cpu or cuda");
  app.add_option("--backend", c.backend, "auto (nccl on CUDA, gloo on CPU), gloo or nccl");
  app.add_flag("--share-devices", c.share_devices, "let ranks share GPUs (rank r on GPU r % count; gloo only)");
  app.add_option("--amp", c.amp, "bf16 autocast; auto: on for CUDA, off for CPU")
      ->check(CLI::IsMember({"auto", "bf16", "off"}));
  app.add_option("--layers", c.layers, "decoder blocks")->check(CLI::PositiveNumber);
  app.add_option("--d-model", c.d_model, "width (a multiple of --heads)")->check(CLI::PositiveNumber);
  app.add_option("--heads", c.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--vocab", c.vocab, "vocabulary (GPT-2's by default)")->check(CLI::PositiveNumber);
  app.add_option("--seq", c.seq, "context length")->check(CLI::PositiveNumber);
  app.add_option("--batch", c.batch, "sequences per rank per step")->check(CLI::PositiveNumber);
  app.add_flag_callback("--untied", [&c] { c.tied = false; }, "own LM head instead of sharing the token embedding");
  app.add_option("--steps", c.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", c.lr, "AdamW learning rate");
  app.add_option("--seed", c.seed, "init and data seed");
  app.add_option("--threads", c.threads, "CPU intra-op threads; 0: torch's default")->check(CLI::NonNegativeNumber);
  app.add_flag("--log-steps", c.log_steps,
               "print a `step` line per step (always on under --fault-tolerance), with the wall time");
  app.add_option("--peak-tflops", c.peak_tflops, "per-GPU peak for MFU (an H200's dense bf16 by default)")
      ->check(CLI::PositiveNumber);
}

// What the flags' checks cannot see alone.
void check(const Config& c) {
  if (c.d_model % c.heads != 0) throw std::invalid_argument("--d-model must be divisible by --heads");
}

// The model. Names and registration order are GPT-2's (and the Python
// twin's), so both sides draw the same initial weights from the same seed.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t d, int64_t heads) : heads(heads) {
    c_attn = register_module("c_attn", torch::nn::Linear(d, 3 * d));
    c_proj = register_module("c_proj", torch::nn::Linear(d, d));
  }
  at::Tensor forward(const at::Tensor& x) {
    int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto qkv = c_attn(x).split(d, 2);
    auto heads_of = [&](const at::Tensor& y) { return y.view({b, t, heads, d / heads}).transpose(1, 2); };
    // Flash or memory-efficient attention where the device has one.
    at::Tensor y = at::scaled_dot_product_attention(heads_of(qkv[0]), heads_of(qkv[1]), heads_of(qkv[2]),
                                                    /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    return c_proj(y.transpose(1, 2).contiguous().view({b, t, d}));
  }
  int64_t heads;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d) {
    c_fc = register_module("c_fc", torch::nn::Linear(d, 4 * d));
    c_proj = register_module("c_proj", torch::nn::Linear(4 * d, d));
  }
  at::Tensor forward(const at::Tensor& x) { return c_proj(at::gelu(c_fc(x), "tanh")); }
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    attn = register_module("attn", Attention(d, heads));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    mlp = register_module("mlp", Mlp(d));
  }
  at::Tensor forward(at::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Config& c) : tied(c.tied) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab, c.d_model));
    wpe = register_module("wpe", torch::nn::Embedding(c.seq, c.d_model));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) h->push_back(Block(c.d_model, c.heads));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    if (!tied) lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.vocab).bias(false)));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor positions = at::arange(idx.size(1), idx.options());
    at::Tensor x = wte(idx) + wpe(positions);
    for (auto& block : *h) x = block->as<Block>()->forward(x);
    x = ln_f(x);
    return tied ? at::linear(x, wte->weight) : lm_head(x);
  }
  bool tied;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(Gpt);

// GPT-2's init, drawn in registration order from one seeded generator on
// the CPU: matrices N(0, 0.02), the residual projections scaled down by
// sqrt(2 * layers), biases 0, LayerNorms 1 and 0.
void init_weights(Gpt& model, const Config& c) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(c.seed);
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (name.find("ln_") != std::string::npos) {
      is_bias ? p.zero_() : p.fill_(1.0);
    } else if (is_bias) {
      p.zero_();
    } else {
      bool residual = name.find("c_proj.weight") != std::string::npos;
      p.normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02, generator);
    }
  }
}

using bench::median;

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One line per step, parsed by bench/churn_bench.py: the job's committed
// steps, the members that trained it, the samples committed so far and the
// wall time (ddprun also reads `step N` as a failed worker's last step).
void print_step(int64_t step, int members, int64_t samples) {
  std::printf("gpt_bench: step %lld members %d samples %lld time %.3f\n", static_cast<long long>(step), members,
              static_cast<long long>(samples), unix_seconds());
  std::fflush(stdout);
}

// This process's open fds, threads and resident memory: a survivor of many
// membership changes must not grow them.
void print_process(const std::string& extra) {
  int fds = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++fds;
    closedir(dir);
    fds -= 3;  // ".", ".." and the directory's own fd
  }
  long threads = 0, rss_kb = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) threads = std::stol(line.substr(8));
    if (line.rfind("VmRSS:", 0) == 0) rss_kb = std::stol(line.substr(6));
  }
  std::printf("gpt_bench: process fds %d threads %ld rss_kb %ld time %.3f %s\n", fds, threads, rss_kb, unix_seconds(),
              extra.c_str());
  std::fflush(stdout);
}

// The fault-tolerant twin of run()'s ddp mode (CPU, Gloo). Each step's batch
// is drawn from (seed, committed step, rank), so a skipped step is redone on
// the same data by whoever the members are then.
int run_fault_tolerant(const Config& c) {
  DDP_CHECK(c.mode == "ddp", "ddp: gpt_bench --mode ", c.mode,
            " under --fault-tolerance: only ddp mode has replicas; drop --fault-tolerance or use --mode ddp");
  DDP_CHECK(c.device == "cpu" || c.device == "auto", "ddp: gpt_bench --device ", c.device,
            " under --fault-tolerance: fault tolerance runs on the CPU over Gloo; use --device cpu");
  if (c.threads > 0) at::set_num_threads(static_cast<int>(c.threads));
  ddp::FaultTolerance ft;
  Gpt model(c);
  init_weights(model, c);
  ddp::DistributedDataParallel<Gpt> ddp_model(model, ft.local_group(), ft.ddp_options());
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(0.1));
  int64_t samples = 0;  // committed sequences of the job, sent to joiners with the rest
  ft.manage(model.ptr(), &optimizer);
  ft.manage_state([&](torch::serialize::OutputArchive& a) { a.write("samples", at::tensor(samples)); },
                  [&](torch::serialize::InputArchive& a) {
                    at::Tensor t;
                    a.read("samples", t);
                    samples = t.item<int64_t>();
                  });
  std::vector<double> times;
  at::Tensor loss;
  using Clock = std::chrono::steady_clock;
  bool first = true;
  while (first || ft.step() < c.warmup + c.steps) {
    auto start = Clock::now();
    ft.start_step();
    if (first) print_process("at_start");
    first = false;
    if (ft.step() >= c.warmup + c.steps) break;  // a joiner that came at the end
    auto generator = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1 + 1000003 * ft.step() + ft.rank());
    at::Tensor tokens = at::randint(0, c.vocab, {c.batch, c.seq + 1}, generator, at::kLong);
    optimizer.zero_grad();
    loss = torch::nn::functional::cross_entropy(
        ddp_model.forward(tokens.narrow(1, 0, c.seq).contiguous()).view({-1, c.vocab}),
        tokens.narrow(1, 1, c.seq).reshape({-1}));
    loss.backward();  // averaged over this step's members by ft's hook
    if (!ft.should_commit()) continue;  // every member drops it and redoes it
    optimizer.step();
    samples += ft.size() * c.batch;
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    print_step(ft.step(), ft.size(), samples);
    if (ft.step() % 50 == 0) print_process("stats " + ft.stats_json());
  }
  print_process("at_end stats " + ft.stats_json());
  if (ft.rank() == 0) {
    double step_ms = times.empty() ? 0.0 : median(times);
    bench::print_json_line({{"impl", "cpp"},
                            {"bench", "gpt"},
                            {"mode", "ddp-fault-tolerant"},
                            {"world", ft.size()},
                            {"layers", c.layers},
                            {"d_model", c.d_model},
                            {"seq", c.seq},
                            {"batch_per_rank", c.batch},
                            {"steps", ft.step()},
                            {"samples", samples},
                            {"step_ms_median", bench::rounded(step_ms, 4)},
                            {"loss_last", loss.defined() ? bench::rounded(loss.item<double>(), 6) : 0.0}});
  }
  return 0;
}

int run(const Config& c) {
  if (c.threads > 0) at::set_num_threads(static_cast<int>(c.threads));
  ddp::World world = ddp::world_from_env();
  auto device_options = ddp::DeviceOptions().kind(ddp::parse_device_kind(c.device)).share_devices(c.share_devices);
  c10::Device device = ddp::init_device(world, device_options);
  bool amp = c.amp == "bf16" || (c.amp == "auto" && device.is_cuda());

  std::shared_ptr<ddp::ProcessGroup> group;
  if (c.mode == "ddp") {
    group = ddp::init_process_group(
        ddp::ProcessGroupOptions().device(device).backend(ddp::parse_backend(c.backend)));
  }

  // The same weights on every rank and on both sides of the comparison.
  Gpt model(c);
  init_weights(model, c);
  model->to(device);
  int64_t parameters = 0;
  for (auto& p : model->parameters()) parameters += p.numel();
  int64_t logged_world = group ? group->size() : 1;

  // Synthetic tokens, fixed for the run and different per rank; inputs and
  // targets are the same rows shifted by one token.
  auto data_generator = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1 + world.rank);
  at::Tensor tokens = at::randint(0, c.vocab, {c.batch, c.seq + 1}, data_generator, at::kLong).to(device);
  at::Tensor inputs = tokens.narrow(1, 0, c.seq).contiguous();
  at::Tensor targets = tokens.narrow(1, 1, c.seq).reshape({-1});

  std::optional<ddp::DistributedDataParallel<Gpt>> ddp_model;
  if (group) ddp_model.emplace(model, group);
  auto forward = [&](const at::Tensor& x) { return ddp_model ? ddp_model->forward(x) : model->forward(x); };

  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(0.1));
  std::vector<double> times;
  // The first and the last loss only, left on the device until the end (item()
  // would wait for the GPU every step); a tensor kept per step grew the run by
  // hundreds of KB per step, without bound on --steps 100000000.
  at::Tensor first_loss, last_loss;
  using Clock = std::chrono::steady_clock;
  for (int64_t step = 0; step < c.warmup + c.steps; ++step) {
    auto start = Clock::now();
    optimizer.zero_grad();
    at::Tensor loss;
    {
      ddp::AutocastGuard autocast(device.type(), at::kBFloat16, amp);
      loss = torch::nn::functional::cross_entropy(forward(inputs).view({-1, c.vocab}), targets);
    }
    loss.backward();
    optimizer.step();
    // The GPU runs behind the host: a step ends when its kernels have.
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (step >= c.warmup) times.push_back(ms);
    if (!first_loss.defined()) first_loss = loss.detach();
    last_loss = loss.detach();
    if (c.log_steps) print_step(step + 1, static_cast<int>(logged_world), (step + 1) * logged_world * c.batch);
  }

  // In local mode under a launcher, every process trains alone: all of
  // them count, as they share the machine (and, with --share-devices, a GPU).
  int world_size = group ? group->size() : world.world_size;
  if (world.rank == 0) {
    double step_ms = median(times);
    double tokens_per_s = 1000.0 * world_size * c.batch * c.seq / step_ms;
    double flops_per_token = 6.0 * parameters + 12.0 * c.layers * c.d_model * c.seq;
    // Ranks sharing a GPU share its peak.
    int gpus = device.is_cuda() ? std::min(world_size, ddp::visible_cuda_devices()) : 0;
    nlohmann::ordered_json mfu = nullptr;  // no GPU, no MFU
    if (gpus > 0) mfu = bench::significant(flops_per_token * tokens_per_s / (gpus * c.peak_tflops * 1e12));
    bench::print_json_line({{"impl", "cpp"},
                            {"bench", "gpt"},
                            {"mode", c.mode},
                            {"world", world_size},
                            {"device", device.str()},
                            {"backend", group ? ddp::to_string(group->backend()) : "none"},
                            {"amp", amp ? "bf16" : "off"},
                            {"layers", c.layers},
                            {"d_model", c.d_model},
                            {"heads", c.heads},
                            {"vocab", c.vocab},
                            {"seq", c.seq},
                            {"batch_per_rank", c.batch},
                            {"tied", c.tied},
                            {"parameters", parameters},
                            {"steps", c.steps},
                            {"warmup", c.warmup},
                            {"step_ms_median", bench::rounded(step_ms, 4)},
                            {"tokens_per_s", bench::rounded(tokens_per_s, 1)},
                            {"flops_per_token", bench::significant(flops_per_token)},
                            {"flops_formula", "6*parameters + 12*layers*d_model*seq"},
                            {"gpus", gpus},
                            {"peak_tflops_per_gpu", bench::significant(c.peak_tflops)},
                            {"mfu", mfu},
                            {"loss_first", bench::rounded(first_loss.item<double>(), 6)},
                            {"loss_last", bench::rounded(last_loss.item<double>(), 6)},
                            {"step_ms", bench::significant(times)}});
  }
  if (group) group->barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app("Step time of a GPT-2-style decoder under ddp's DDP or bare; prints one JSON line (rank 0).",
               "gpt_bench");
  add_flags(app, c);
  CLI11_PARSE(app, argc, argv);
  try {
    check(c);
    // The one branch for ddprun --fault-tolerance (as wine_ddp's).
    return ddp::fault_tolerance_requested() ? run_fault_tolerant(c) : run(c);
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
