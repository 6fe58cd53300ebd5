// What checkpoints of an FSDP (FULL_SHARD) job with Adam cost at N ranks, in
// one run: a distributed checkpoint (every rank writes and reads its own
// part, include/ddp/distributed_checkpoint.h) against the full state gathered
// on rank 0 (full_state_dict + full_optim_state_dict, written by rank 0, read
// by every rank); and the step time while rank 0's asynchronous SnapshotSaver
// writes a full snapshot, against plain steps. Run it under ddprun:
//
//   ddprun --standalone --nproc-per-node 2 checkpoint_bench --width 2048 --layers 4 --dir /tmp/checkpoint_bench
//
// Rank 0 prints one JSON line. Results: bench/MEMORY.md, "Checkpoints at N ranks".

#include "bench_stats.h"

#include <ddp/checkpoint.h>
#include <ddp/distributed_checkpoint.h>
#include <ddp/error_file.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/snapshot_saver.h>

#include <CLI/CLI.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Model = ddp::FullyShardedDataParallel<torch::nn::Sequential>;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The slowest rank's time for `action`, which every rank runs: what the job
// waits for.
double timed(ddp::ProcessGroup& group, const std::function<void()>& action) {
  group.barrier();
  auto start = Clock::now();
  action();
  group.barrier();
  at::Tensor ms = at::full({1}, ms_since(start), at::kDouble);
  group.all_reduce(ms, c10d::ReduceOp::MAX);
  return ms.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t width = 2048, layers = 4, batch = 16, repeats = 3, steps = 8;
  std::string dir = "/tmp/checkpoint_bench";
  CLI::App app("Distributed against gathered checkpoints of an FSDP job, and step time during an async save; "
               "rank 0 prints one JSON line.",
               "checkpoint_bench");
  app.option_defaults()->always_capture_default();
  app.add_option("--width", width, "features of each Linear layer (one FSDP unit each)")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "Linear layers")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "samples per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "saves and loads of each kind, and async saves (medians are reported)")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps without a save before each async save")->check(CLI::PositiveNumber);
  app.add_option("--dir", dir, "a directory every rank sees (emptied first, removed after)");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = ddp::init_process_group();
    const bool root = group->rank() == 0;
    if (root) {
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir + "/async");
    }
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int64_t l = 0; l < layers; ++l) net->push_back(torch::nn::Linear(width, width));
    Model model(net, group, ddp::FSDPOptions().min_num_params(width * width));
    torch::optim::Adam adam(model.parameters(), torch::optim::AdamOptions(1e-4));
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1 + group->rank());
    const at::Tensor x = at::randn({batch, width}, generator);
    const at::Tensor y = at::randint(0, width, {batch}, generator, at::kLong);
    auto step = [&] {
      auto start = Clock::now();
      adam.zero_grad();
      torch::nn::functional::cross_entropy(model.forward(x), y).backward();
      adam.step();
      return ms_since(start);
    };
    step();  // Adam's state exists from here on

    std::vector<double> dcp_save, dcp_load, full_save, full_load;
    int64_t checkpoint_bytes = 0, bytes_read = 0;
    for (int64_t r = 0; r < repeats; ++r) {
      dcp_save.push_back(timed(*group, [&] { ddp::save_distributed_checkpoint(dir + "/dcp", model, &adam); }));
      dcp_load.push_back(timed(*group, [&] {
        auto report = ddp::load_distributed_checkpoint(dir + "/dcp", model, &adam);
        checkpoint_bytes = report.checkpoint_bytes;
        bytes_read = report.bytes_read;
      }));
      full_save.push_back(timed(*group, [&] {
        auto state = model.full_state_dict();
        auto optim = model.full_optim_state_dict(adam);
        if (root) {
          ddp::save_state_dict(state, dir + "/full.model.pt");
          ddp::save_value(optim, dir + "/full.optim.pt");
        }
      }));
      full_load.push_back(timed(*group, [&] {
        model.load_full_state_dict(ddp::load_state_dict(dir + "/full.model.pt"));
        model.load_full_optim_state_dict(adam, ddp::load_value(dir + "/full.optim.pt"));
      }));
    }

    // Step time: plain steps, then steps while rank 0's writer writes a
    // full snapshot (gathered on the training thread: that part is
    // "staging"), `repeats` times in turn, so that drift in the machine's
    // speed falls on both alike.
    std::vector<double> plain_ms, during_ms, staging_ms, write_ms;
    ddp::SnapshotSaver writer(dir + "/async", ddp::SnapshotOptions().keep(1).async_write(true));
    for (int64_t r = 0; r < repeats; ++r) {
      for (int64_t s = 0; s < steps; ++s) plain_ms.push_back(step());
      auto start = Clock::now();
      auto state = model.full_state_dict();
      auto optim = model.full_optim_state_dict(adam);
      if (root) writer.save(ddp::capture_snapshot(state, optim, r, r));
      staging_ms.push_back(ms_since(start));
      // Ranks step together, so rank 0's view of the writer decides for all.
      for (int64_t s = 0; s < 256; ++s) {
        at::Tensor busy = at::full({1}, root && writer.pending() > 0 ? 1.0 : 0.0, at::kDouble);
        group->broadcast(busy, 0);
        if (busy.item<double>() == 0.0) break;
        during_ms.push_back(step());
      }
      if (root) writer.wait();
      write_ms.push_back(ms_since(start));
    }
    group->barrier();
    if (root) std::filesystem::remove_all(dir);

    int64_t numel = 0;
    for (const auto& p : net->parameters()) numel += p.numel();
    const double gb = static_cast<double>(checkpoint_bytes) / 1e9;
    auto per_gb = [&](const std::vector<double>& ms) { return bench::rounded(bench::median(ms) / 1000.0 / gb, 3); };
    const double plain = bench::median(plain_ms);
    if (root) {
      bench::print_json_line({{"world_size", group->size()},
                              {"parameters", numel},
                              {"checkpoint_bytes", checkpoint_bytes},
                              {"bytes_read_per_rank", bytes_read},
                              {"dcp_save_ms", bench::rounded(bench::median(dcp_save), 1)},
                              {"dcp_load_ms", bench::rounded(bench::median(dcp_load), 1)},
                              {"full_save_ms", bench::rounded(bench::median(full_save), 1)},
                              {"full_load_ms", bench::rounded(bench::median(full_load), 1)},
                              {"dcp_save_s_per_gb", per_gb(dcp_save)},
                              {"dcp_load_s_per_gb", per_gb(dcp_load)},
                              {"full_save_s_per_gb", per_gb(full_save)},
                              {"full_load_s_per_gb", per_gb(full_load)},
                              {"step_ms", bench::rounded(plain, 1)},
                              {"async_staging_ms", bench::rounded(bench::median(staging_ms), 1)},
                              {"async_write_ms", bench::rounded(bench::median(write_ms), 1)},
                              {"steps_during_async", static_cast<int64_t>(during_ms.size())},
                              {"step_ms_during_async", bench::rounded(bench::median(during_ms), 1)},
                              {"async_ratio", bench::rounded(bench::median(during_ms) / plain, 3)}});
    }
    group->shutdown();
  } catch (const std::exception& e) {
    return ddp::report_failure(e);
  }
  return 0;
}
