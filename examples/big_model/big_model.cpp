// A model trained as if it did not fit on one rank (docs/big_models.md): built
// one FSDP unit at a time so no rank ever holds it whole, clipped by the whole
// model's gradient norm, and snapshotted as a distributed checkpoint that
// every rank writes its own part of, which resumes at any world size and
// which PyTorch's DCP reads.
//
//   ddprun --standalone --nproc-per-node 2 big_model --steps 20 --checkpoint-dir /tmp/big-model
//   ddprun --standalone --nproc-per-node 3 big_model --steps 40 --checkpoint-dir /tmp/big-model   # resumes

#include "../common/command_line.h"

#include <ddp/ddp.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

namespace {

// One unit: a residual block, so that a deep stack still trains.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : linear(register_module("linear", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + at::tanh(linear(x)); }
  torch::nn::Linear linear;
};
TORCH_MODULE(Block);

struct Args {
  int64_t width = 256;
  int64_t layers = 8;
  int64_t steps = 20;
  int64_t batch = 48;  // the job's, split over the ranks (48 divides by 1, 2, 3, 4, 6, 8)
  int64_t snapshot_every = 10;
  double max_norm = 1.0;
  std::string checkpoint_dir = ".";
};

Args parse_args(int argc, char** argv) {
  Args args;
  examples::CommandLine command_line("Trains a deep residual MLP with FSDP, built one unit at a time.", argv[0]);
  command_line.add_option("--width", args.width, "features of each block")
      ->type_name("N")
      ->transform(examples::positive_integer("--width"));
  command_line.add_option("--layers", args.layers, "blocks, each an FSDP unit")
      ->type_name("N")
      ->transform(examples::positive_integer("--layers"));
  command_line.add_option("--steps", args.steps, "train until this many optimizer steps in all")
      ->type_name("N")
      ->transform(examples::positive_integer("--steps"));
  command_line.add_option("--batch-size", args.batch, "samples per step for the whole job")
      ->type_name("N")
      ->transform(examples::positive_integer("--batch-size"));
  command_line.add_option("--snapshot-every", args.snapshot_every, "steps between sharded snapshots")
      ->type_name("N")
      ->transform(examples::positive_integer("--snapshot-every"));
  command_line.add_option("--max-norm", args.max_norm, "clip the whole model's gradient norm to this")
      ->type_name("X");
  command_line.add_option("--checkpoint-dir", args.checkpoint_dir, "where the sharded snapshots go")->type_name("DIR");
  command_line.read(argc, argv);
  if (args.max_norm <= 0) throw examples::UsageError("--max-norm must be positive");
  return args;
}

// Step s's batch, the same at every world size: rank r takes rows r, r + N, ...
std::pair<at::Tensor, at::Tensor> batch_of(int64_t step, int64_t batch, int64_t width, const ddp::ProcessGroup& group) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({batch, width}, generator);
  at::Tensor y = at::sin(x.roll(1, 1));
  at::Tensor rows = at::arange(group.rank(), batch, group.size(), at::kLong);
  return {x.index_select(0, rows), y.index_select(0, rows)};
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const examples::UsageError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  try {
    auto group = ddp::init_process_group();
    const bool is_master = group->rank() == 0;
    DDP_CHECK(args.batch % group->size() == 0, "--batch-size ", args.batch, " must divide by the world size ",
              group->size());
    std::filesystem::create_directories(args.checkpoint_dir);

    // Deferred construction: each block is built, given rank 0's values,
    // sharded and freed before the next one is built.
    torch::manual_seed(0);
    ddp::DeferredSequential blocks;
    for (int64_t l = 0; l < args.layers; ++l) blocks.add([&] { return Block(args.width); });
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(blocks, group);
    torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-3));

    // Resume from the newest sharded snapshot, whatever world size wrote it;
    // the saver keeps the newest two.
    ddp::SnapshotSaver snapshots(args.checkpoint_dir);
    int64_t step = 0;
    if (auto progress = ddp::load_newest_sharded_snapshot(args.checkpoint_dir, model, &optimizer)) {
      step = progress->step;
      if (is_master) std::printf("Resuming at step %lld on %d ranks\n", static_cast<long long>(step), group->size());
    }

    for (; step < args.steps;) {
      auto [x, y] = batch_of(step, args.batch, args.width, *group);
      optimizer.zero_grad();
      at::Tensor loss = torch::nn::functional::mse_loss(model.forward(x), y);
      loss.backward();
      // The norm of the whole model's gradient, not of this rank's shards.
      const double norm = ddp::clip_grad_norm_(model, args.max_norm);
      optimizer.step();
      ++step;
      if (is_master) {
        std::printf("step %lld, loss %.5f, gradient norm %.4f\n", static_cast<long long>(step), loss.item<double>(),
                    norm);
      }
      if (step % args.snapshot_every == 0 || step == args.steps) {
        snapshots.save(model, &optimizer, ddp::TrainingProgress{0, step, 0});
      }
    }
    const auto memory = model.memory();
    if (is_master) {
      const int64_t full = args.layers * (args.width * args.width + args.width) * 4;
      std::printf("Done: parameters held per rank %lld bytes (peak %lld), the whole model %lld bytes\n",
                  static_cast<long long>(memory.parameter_bytes), static_cast<long long>(memory.peak_parameter_bytes),
                  static_cast<long long>(full));
    }
    group->barrier();
  } catch (const std::exception& e) {
    return ddp::report_failure(e);
  }
  return 0;
}
