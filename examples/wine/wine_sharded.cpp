// wine_ddp with a choice of how the model and Adam are spread over the ranks
// (--strategy ddp, zero1, fsdp-full or fsdp-grad-op; see strategies.h). The
// training loop is the same for every strategy, and so are the checkpoints,
// so a run can resume under another strategy or world size.
//
//   ddprun --standalone --nproc-per-node 2 wine_sharded 100 50 --strategy fsdp-full

#include "simple_nn.h"
#include "strategies.h"
#include "wine_cli.h"
#include "wine_data.h"
#include "wine_dataset.h"

#include <ddp/checkpoint.h>
#include <ddp/error.h>
#include <ddp/error_file.h>
#include <ddp/device.h>
#include <ddp/distributed_sampler.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>
#include <ddp/progress.h>
#include <ddp/snapshot.h>

#include <torch/data/dataloader.h>
#include <torch/data/transforms/stack.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

int main(int argc, char** argv) {
  wine::Args args;
  try {
    args = wine::parse_args(argc, argv);
  } catch (const examples::UsageError& e) {
    std::cerr << "error: " << e.what() << "\n";
    wine::print_usage(argv[0]);
    return 2;
  }
  try {
    // Fail now rather than after the first epoch's training.
    DDP_CHECK(std::filesystem::is_directory(args.checkpoint_dir), "checkpoint directory '",
                args.checkpoint_dir, "' does not exist; create it or pass --checkpoint-dir");
    // This rank's device: the CPU, or with --device cuda the GPU of its local
    // rank (and then NCCL).
    const c10::Device device =
        ddp::init_device(ddp::world_from_env(), ddp::DeviceOptions().kind(ddp::parse_device_kind(args.device)));
    // Join the job: rendezvous with the other ranks through MASTER_ADDR:PORT.
    auto group = ddp::init_process_group(
        ddp::ProcessGroupOptions().device(device).backend(ddp::parse_backend(args.backend)));
    const bool is_master = group->rank() == 0;
    const auto nonfinite_policy = ddp::parse_nonfinite_policy(args.on_nonfinite);

    // Every rank loads the same data and makes the same seeded split.
    wine::Split data = wine::load_split(args.train_csv, args.test_csv);
    data.test.features = data.test.features.to(device);
    data.test.labels = data.test.labels.to(device);

    torch::manual_seed(42);
    wine::SimpleNN model;
    if (!args.init_state.empty()) {
      ddp::load_state_dict(*model, ddp::load_state_dict(args.init_state));
    }
    model->to(device);
    // Checks the replicas match, copies rank 0's weights to every rank and
    // builds Adam: see strategies.h for what each --strategy holds where.
    auto strategy = wine::make_strategy(args.strategy, model, group);
    // Every rank evaluates (36 samples cost nothing): FSDP needs all ranks to
    // gather the full model.
    auto test_accuracy = [&] {
      return strategy->with_full_model([&] {
        torch::NoGradGuard no_grad;
        at::Tensor predicted = model->forward(data.test.features).argmax(1);
        return predicted.eq(data.test.labels).to(at::kDouble).mean().item<double>();
      });
    };

    // Each rank sees its own 1/world_size of every epoch.
    ddp::DistributedSampler sampler(
        data.train.size(), ddp::SamplerOptions(group->size(), group->rank()).seed(args.seed));
    auto loader = torch::data::make_data_loader(
        wine::WineDataset(data.train).map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(args.batch_size).workers(args.workers));

    // After a crash or a restart by ddprun, carry on from the newest valid
    // snapshot: weights, Adam's moments and step counts, epoch.
    int64_t first_epoch = 0;
    int64_t step = 0;
    if (args.resume) {
      std::vector<std::string> skipped;
      auto snapshot = ddp::load_newest_snapshot(args.checkpoint_dir, *group, &skipped);
      for (const auto& why : skipped) {
        if (is_master) std::fprintf(stderr, "warning: skipping a snapshot: %s\n", why.c_str());
      }
      if (snapshot) {
        strategy->restore(*snapshot);
        first_epoch = snapshot->sampler_epoch;
        step = snapshot->step;
        if (is_master) std::printf("Resuming after epoch %lld from %s\n", static_cast<long long>(snapshot->epoch),
                                   args.checkpoint_dir.c_str());
      }
    }

    // Rank 0 shows progress on long runs and records one line per epoch.
    const int64_t steps_per_epoch = (sampler.num_samples() + args.batch_size - 1) / args.batch_size;
    ddp::ProgressLine progress(args.total_epochs, steps_per_epoch, ddp::ProgressOptions().enabled(is_master));
    ddp::MetricsWriter metrics(is_master ? args.metrics : "", /*append=*/first_epoch > 0);

    for (int64_t epoch = first_epoch; epoch < args.total_epochs; ++epoch) {
      sampler.set_epoch(epoch);  // a new shuffle each epoch, the same on all ranks
      progress.start_epoch(epoch);
      double total_loss = 0;
      int64_t batches = 0;
      for (auto& batch : *loader) {
        at::Tensor features = batch.data.to(device);
        strategy->zero_grad();
        at::Tensor loss = torch::nn::functional::cross_entropy(strategy->forward(features), batch.target.to(device));
        // All ranks agree on a NaN anywhere, so they skip or stop together.
        if (!ddp::check_loss_is_finite(loss, *group, nonfinite_policy,
                                       "epoch " + std::to_string(epoch) + ", step " + std::to_string(step))) {
          continue;
        }
        loss.backward();  // returns with gradients averaged across ranks
        strategy->step();
        ++step;
        total_loss += loss.item<double>();
        ++batches;
        progress.step(loss.item<double>(), features.size(0) * group->size());
      }
      progress.end_epoch();
      // The epoch's loss averaged over all ranks, not just rank 0's shard.
      at::Tensor mean_loss = at::full({1}, total_loss / batches, at::kDouble);
      group->all_reduce(mean_loss);
      double epoch_loss = mean_loss.item<double>() / group->size();

      // 36 test samples: measuring them every epoch costs next to nothing.
      const double accuracy = args.metrics.empty() ? 0.0 : test_accuracy();
      // Gathering the model and Adam's state takes every rank (FSDP, ZeRO);
      // rank 0 writes them.
      const bool save_model = epoch % args.save_every == 0;
      const bool save_snapshot = save_model || epoch + 1 == args.total_epochs;
      ddp::StateDict model_state = save_snapshot ? strategy->model_state() : ddp::StateDict{};
      c10::IValue optimizer_state = save_snapshot ? strategy->optimizer_state() : c10::IValue();
      if (is_master) {
        std::printf("Epoch %lld, Loss: %.4f\n", static_cast<long long>(epoch), epoch_loss);
        if (!args.metrics.empty()) {
          metrics.write({epoch, epoch_loss, accuracy, progress.epoch_samples_per_second(), progress.elapsed_seconds()});
        }
        if (save_model) {
          std::string path = args.checkpoint_dir + "/model_" + std::to_string(epoch) + ".pt";
          ddp::save_state_dict(model_state, path);
          std::printf("Epoch %lld | Model saved to %s\n", static_cast<long long>(epoch), path.c_str());
        }
        if (save_snapshot) {
          ddp::save_snapshot_in(args.checkpoint_dir, ddp::capture_snapshot(model_state, optimizer_state, epoch, step));
        }
        std::fflush(stdout);
      }
    }

    ddp::StateDict final_state = strategy->model_state();
    const double accuracy = test_accuracy();
    if (is_master) {
      ddp::save_state_dict(final_state, args.checkpoint_dir + "/model_final.pt");
      std::printf("Test accuracy: %.4f\n", accuracy);
    }
    group->barrier();  // no rank leaves while rank 0 may still need it
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
  return 0;
}
