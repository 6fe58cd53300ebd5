// Trains a small convnet on the UCI 8x8 handwritten digits with
// DistributedDataParallel: one process per rank, each on its own shard of
// every epoch, gradients averaged by all-reduce.
//
//   ddprun --standalone --nproc-per-node 2 digits_ddp 20 10
//
// It also runs alone (a world of one) and under torchrun, srun or mpirun.

#include "conv_net.h"
#include "digits_cli.h"
#include "digits_data.h"
#include "digits_dataset.h"

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/error.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/process_group.h>
#include <ddp/progress.h>
#include <ddp/snapshot.h>
#include <ddp/snapshot_saver.h>

#include <torch/data/dataloader.h>
#include <torch/data/transforms/stack.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>

namespace {

// Share of `data` that `model` classifies correctly.
double accuracy_on(digits::ConvNet& model, const digits::Dataset& data) {
  torch::NoGradGuard no_grad;
  model->eval();
  at::Tensor predicted = model->forward(data.images).argmax(1);
  model->train();
  return predicted.eq(data.labels).to(at::kDouble).mean().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  digits::Args args;
  try {
    args = digits::parse_args(argc, argv);
  } catch (const examples::UsageError& e) {
    std::cerr << "error: " << e.what() << "\n";
    digits::print_usage(argv[0]);
    return 2;
  }
  try {
    // Fail now rather than after the first epoch's training.
    DDP_CHECK(std::filesystem::is_directory(args.checkpoint_dir), "checkpoint directory '",
                args.checkpoint_dir, "' does not exist; create it or pass --checkpoint-dir");
    // Every rank loads the same data and makes the same seeded split, before
    // joining the job, so a bad file fails each rank on its own at once.
    digits::Split data = digits::train_test_split(digits::read_csv_gz(args.data), 0.2, 42);
    digits::scale_pixels(data.train);
    digits::scale_pixels(data.test);

    // Join the job: rendezvous with the other ranks through MASTER_ADDR:PORT.
    auto group = ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::parse_backend(args.backend)));
    const bool is_master = group->rank() == 0;

    torch::manual_seed(42);
    digits::ConvNet model;
    // Checks the replicas match and copies rank 0's weights to every rank.
    std::shared_ptr<ddp::PowerSGDHook> powersgd;
    std::shared_ptr<ddp::CommHook> hook = ddp::allreduce_hook();
    if (args.comm_hook == "fp16") hook = ddp::fp16_compress_hook();
    if (args.comm_hook == "bf16") hook = ddp::bf16_compress_hook();
    if (args.comm_hook == "powersgd") {
      hook = powersgd = ddp::powersgd_hook(ddp::PowerSGDOptions()
                                               .matrix_approximation_rank(args.powersgd_rank)
                                               .start_powerSGD_iter(std::max<int64_t>(2, args.powersgd_start)));
    }
    ddp::DistributedDataParallel<digits::ConvNet> ddp_model(model, group, ddp::DDPOptions().comm_hook(hook));
    torch::optim::Adam optimizer(ddp_model.parameters(), torch::optim::AdamOptions(1e-3));

    // Each rank sees its own 1/world_size of every epoch.
    ddp::DistributedSampler sampler(
        data.train.size(), ddp::SamplerOptions(group->size(), group->rank()).seed(args.seed));
    auto loader = torch::data::make_data_loader(
        digits::DigitsDataset(data.train).map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(args.batch_size));

    // After a crash or a restart by ddprun, carry on from the newest valid
    // snapshot: weights, Adam's moments and step counts, epoch.
    int64_t first_epoch = 0;
    int64_t step = 0;
    ddp::SnapshotSaver snapshots(args.checkpoint_dir);  // rank 0 saves
    if (args.resume) {
      std::vector<std::string> skipped;
      auto snapshot = ddp::load_newest_snapshot(args.checkpoint_dir, *group, &skipped);
      for (const auto& why : skipped) {
        if (is_master) std::fprintf(stderr, "warning: skipping a snapshot: %s\n", why.c_str());
      }
      if (snapshot) {
        ddp::restore_snapshot(*snapshot, *model, optimizer);
        first_epoch = snapshot->sampler_epoch;
        step = snapshot->step;
        if (is_master) std::printf("Resuming after epoch %lld from %s\n", static_cast<long long>(snapshot->epoch),
                                   args.checkpoint_dir.c_str());
      }
    }

    // Rank 0 alone shows progress and records metrics (continuing the file
    // when resuming).
    const int64_t steps_per_epoch = (sampler.num_samples() + args.batch_size - 1) / args.batch_size;
    ddp::ProgressLine progress(args.total_epochs, steps_per_epoch, ddp::ProgressOptions().enabled(is_master));
    ddp::MetricsWriter metrics(is_master ? args.metrics : "", /*append=*/first_epoch > 0);

    for (int64_t epoch = first_epoch; epoch < args.total_epochs; ++epoch) {
      sampler.set_epoch(epoch);  // a new shuffle each epoch, the same on all ranks
      progress.start_epoch(epoch);
      double total_loss = 0;
      int64_t batches = 0;
      for (auto& batch : *loader) {
        optimizer.zero_grad();
        at::Tensor loss = torch::nn::functional::cross_entropy(ddp_model(batch.data), batch.target);
        loss.backward();  // returns with gradients averaged across ranks
        optimizer.step();
        ++step;
        double value = loss.item<double>();
        total_loss += value;
        ++batches;
        // Every rank's batch has the same size: the sampler pads the shards.
        progress.step(value, batch.data.size(0) * group->size());
      }
      progress.end_epoch();
      // The epoch's loss averaged over all ranks, not just rank 0's shard.
      at::Tensor mean_loss = at::full({1}, total_loss / batches, at::kDouble);
      group->all_reduce(mean_loss);
      double epoch_loss = mean_loss.item<double>() / group->size();

      if (is_master) {
        double accuracy = accuracy_on(model, data.test);
        std::printf("Epoch %lld, Loss: %.4f, Test accuracy: %.4f\n", static_cast<long long>(epoch), epoch_loss,
                    accuracy);
        metrics.write({epoch, epoch_loss, accuracy, progress.epoch_samples_per_second(), progress.elapsed_seconds()});
        bool last = epoch + 1 == args.total_epochs;
        if (epoch % args.save_every == 0) {
          std::string path = args.checkpoint_dir + "/model_" + std::to_string(epoch) + ".pt";
          ddp::save(model, path);
          std::printf("Epoch %lld | Model saved to %s\n", static_cast<long long>(epoch), path.c_str());
        }
        if (epoch % args.save_every == 0 || last) {
          snapshots.save(ddp::capture_snapshot(*model, optimizer, epoch, step));
        }
        std::fflush(stdout);
      }
    }

    if (is_master) {
      ddp::save(model, args.checkpoint_dir + "/model_final.pt");
      std::printf("Test accuracy: %.4f\n", accuracy_on(model, data.test));
      if (powersgd) {
        const auto [uncompressed, sent] = powersgd->compression_stats();
        std::printf("PowerSGD compression ratio %.4f (%lld of %lld gradient elements sent after the warm-up)\n",
                    sent > 0 ? static_cast<double>(uncompressed) / static_cast<double>(sent) : 1.0,
                    static_cast<long long>(sent), static_cast<long long>(uncompressed));
      }
    }
    group->barrier();  // no rank leaves while rank 0 may still need it
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
  return 0;
}
