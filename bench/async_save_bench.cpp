// What a snapshot costs the training loop: the median step time with no save,
// the median step time while a SnapshotSaver with async_write writes one in
// the background (its writer thread at normal and at idle priority), the time
// save() itself blocks (staging: copying the tensors), and the time of one
// synchronous save, all in one process and one run.
//
//   async_save_bench --width 4096 --layers 3 --dir /tmp/async_save_bench
//
// at::set_num_threads(1) by default, so training leaves a core to the writer
// thread; --threads <all cores> shows what the writer's priority changes
// when training leaves none.
// Results: bench/MEMORY.md, "Async save".

#include "bench_stats.h"

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
#include <iostream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct Trainer {
  torch::nn::Sequential net;
  std::unique_ptr<torch::optim::Adam> optimizer;
  at::Tensor x, y;
  int64_t steps = 0;

  Trainer(int64_t width, int64_t layers, int64_t batch) {
    torch::manual_seed(0);
    for (int64_t l = 0; l < layers; ++l) net->push_back(torch::nn::Linear(width, width));
    optimizer = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-4));
    auto generator = at::make_generator<at::CPUGeneratorImpl>(0);
    x = at::randn({batch, width}, generator);
    y = at::randint(0, width, {batch}, generator, at::kLong);
  }

  double step() {
    auto start = Clock::now();
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer->step();
    ++steps;
    return ms_since(start);
  }

  ddp::Snapshot snapshot() { return ddp::capture_snapshot(*net, *optimizer, steps, steps); }
};

struct AsyncResult {
  double save_call_ms = 0;  // what save() blocked the training thread for (staging)
  double write_ms = 0;      // from save() until the file was on disk
  std::vector<double> step_ms;  // steps that ran while the writer was writing
};

AsyncResult time_async_save(Trainer& trainer, const std::string& dir, bool low_priority) {
  AsyncResult result;
  ddp::SnapshotSaver writer(dir, ddp::SnapshotOptions().keep(1).async_write(true).low_priority(low_priority));
  auto start = Clock::now();
  writer.save(trainer.snapshot());
  result.save_call_ms = ms_since(start);
  while (writer.pending() > 0) {
    double ms = trainer.step();
    // A step the write ended during counts: it shared the CPU for part of it.
    result.step_ms.push_back(ms);
  }
  result.write_ms = ms_since(start);
  writer.wait();
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t width = 4096, layers = 3, batch = 8, steps = 10, threads = 1;
  std::string dir = "/tmp/async_save_bench";
  CLI::App app("Step time with no save, during an asynchronous save, and one synchronous save; one JSON line.",
               "async_save_bench");
  app.option_defaults()->always_capture_default();
  app.add_option("--width", width, "features of each Linear layer")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "Linear layers")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "samples per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps without a save")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "at::set_num_threads: 1 leaves a core to the writer; all cores leaves none")
      ->check(CLI::PositiveNumber);
  app.add_option("--dir", dir, "where the snapshots go (emptied first, removed after)");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(static_cast<int>(threads));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    Trainer trainer(width, layers, batch);
    trainer.step();  // allocates Adam's state: not a typical step
    std::vector<double> plain_ms;
    for (int64_t s = 0; s < steps; ++s) plain_ms.push_back(trainer.step());

    auto start = Clock::now();
    ddp::SnapshotSaver(dir, ddp::SnapshotOptions().keep(1)).save(trainer.snapshot());
    const double sync_ms = ms_since(start);
    const auto snapshot_bytes = std::filesystem::file_size(dir + "/snapshot_" + std::to_string(trainer.steps) + ".pt");

    AsyncResult normal = time_async_save(trainer, dir, /*low_priority=*/false);
    AsyncResult idle = time_async_save(trainer, dir, /*low_priority=*/true);
    std::vector<double> after_ms;  // drift check: the machine did not change under us
    for (int64_t s = 0; s < steps; ++s) after_ms.push_back(trainer.step());
    std::filesystem::remove_all(dir);

    int64_t numel = 0;
    for (auto& p : trainer.net->parameters()) numel += p.numel();
    const double plain = bench::median(plain_ms);
    auto ratio = [&](const AsyncResult& r) { return bench::rounded(bench::median(r.step_ms) / plain, 3); };
    bench::print_json_line({{"parameters", numel},
                            {"threads", threads},
                            {"snapshot_bytes", snapshot_bytes},
                            {"step_ms", bench::rounded(plain, 1)},
                            {"step_ms_after", bench::rounded(bench::median(after_ms), 1)},
                            {"sync_save_ms", bench::rounded(sync_ms, 1)},
                            {"sync_save_in_steps", bench::rounded(sync_ms / plain, 2)},
                            {"async_normal_step_ms", bench::rounded(bench::median(normal.step_ms), 1)},
                            {"async_normal_ratio", ratio(normal)},
                            {"async_normal_steps_during_write", normal.step_ms.size()},
                            {"async_normal_save_call_ms", bench::rounded(normal.save_call_ms, 1)},
                            {"async_normal_write_ms", bench::rounded(normal.write_ms, 1)},
                            {"async_idle_step_ms", bench::rounded(bench::median(idle.step_ms), 1)},
                            {"async_idle_ratio", ratio(idle)},
                            {"async_idle_steps_during_write", idle.step_ms.size()},
                            {"async_idle_save_call_ms", bench::rounded(idle.save_call_ms, 1)},
                            {"async_idle_write_ms", bench::rounded(idle.write_ms, 1)},
                            {"async_idle_step_ms_all", bench::significant(idle.step_ms)}});
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "async_save_bench: " << e.what() << "\n";
    return 1;
  }
}
