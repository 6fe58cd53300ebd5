// wine_ddp with a choice of how the model and Adam are spread over the ranks
// (--strategy ddp, zero1, fsdp-full, fsdp-grad-op, hsdp or hsdp-grad-op; see
// strategies.h). The training loop is the same for every strategy, and so
// are the checkpoints.
// Snapshots are sharded (every rank writes its part, no gather) and resume
// under another strategy or world size, mid-epoch too: the rest of the
// epoch is split over the ranks there are now (--snapshot-every-steps).
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
#include <ddp/sharded_snapshot.h>
#include <ddp/snapshot.h>
#include <ddp/snapshot_saver.h>

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
    // --sample-log records the indices the loader reads; with worker
    // threads it would read ahead of the step.
    DDP_CHECK(args.sample_log.empty() || args.workers == 0, "--sample-log needs --workers 0");
    auto fetched = args.sample_log.empty() ? nullptr : std::make_shared<std::vector<int64_t>>();
    auto loader = torch::data::make_data_loader(
        wine::WineDataset(data.train, fetched).map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(args.batch_size).workers(args.workers));

    // After a crash or a restart by ddprun, carry on from the newest valid
    // snapshot: weights, Adam's moments and step counts, and the place in
    // the data, even mid-epoch and at another world size (a node lost or
    // gained under ddprun --nnodes MIN:MAX).
    int64_t first_epoch = 0;
    int64_t step = 0;
    int64_t resume_seen = 0;  // of first_epoch's samples, job-wide
    if (args.resume) {
      std::vector<std::string> skipped;
      auto progress = strategy->load_newest_sharded(args.checkpoint_dir, &skipped);
      std::optional<ddp::Snapshot> snapshot;  // the full snapshots of earlier versions
      if (!progress) snapshot = ddp::load_newest_snapshot(args.checkpoint_dir, *group, &skipped);
      for (const auto& why : skipped) {
        if (is_master) std::fprintf(stderr, "warning: skipping a snapshot: %s\n", why.c_str());
      }
      if (snapshot) {
        strategy->restore(*snapshot);
        progress = ddp::TrainingProgress{snapshot->sampler_epoch, snapshot->step, 0};
      }
      if (progress) {
        first_epoch = progress->epoch;
        step = progress->step;
        resume_seen = progress->samples_seen;
        if (is_master && resume_seen == 0) {
          std::printf("Resuming after epoch %lld from %s\n", static_cast<long long>(first_epoch - 1),
                      args.checkpoint_dir.c_str());
        } else if (is_master) {
          std::printf("Resuming in epoch %lld at step %lld, %lld of its samples seen, on %d ranks, from %s\n",
                      static_cast<long long>(first_epoch), static_cast<long long>(step),
                      static_cast<long long>(resume_seen), group->size(), args.checkpoint_dir.c_str());
        }
      }
    }
    // Keeps the newest --keep-snapshots that validate; never one it cannot
    // judge, nor the one resumed from.
    ddp::SnapshotSaver snapshots(args.checkpoint_dir,
                                 ddp::SnapshotOptions().keep(static_cast<int>(args.keep_snapshots)));
    int64_t last_snapshot_step = -1;
    auto write_snapshot = [&](int64_t epoch, int64_t samples_seen) {
      if (step == last_snapshot_step) return;  // the step-count one fell on the epoch's end
      last_snapshot_step = step;
      // An epoch fully seen resumes at the next one.
      if (samples_seen >= static_cast<int64_t>(data.train.size())) {
        ++epoch;
        samples_seen = 0;
      }
      strategy->save_sharded(snapshots, ddp::TrainingProgress{epoch, step, samples_seen});
    };
    std::FILE* sample_log = nullptr;
    if (!args.sample_log.empty()) {
      const std::string path = args.sample_log + ".rank" + std::to_string(group->rank());
      sample_log = std::fopen(path.c_str(), "a");
      DDP_CHECK(sample_log, "cannot open the sample log '", path, "'");
    }

    // Rank 0 shows progress on long runs and records one line per epoch.
    const int64_t steps_per_epoch = (sampler.num_samples() + args.batch_size - 1) / args.batch_size;
    ddp::ProgressLine progress(args.total_epochs, steps_per_epoch, ddp::ProgressOptions().enabled(is_master));
    ddp::MetricsWriter metrics(is_master ? args.metrics : "", /*append=*/first_epoch > 0);

    for (int64_t epoch = first_epoch; epoch < args.total_epochs; ++epoch) {
      sampler.set_epoch(epoch);  // a new shuffle each epoch, the same on all ranks
      // The rest of an interrupted epoch, split over this run's ranks.
      const int64_t seen_before = epoch == first_epoch ? resume_seen : 0;
      if (seen_before > 0) sampler.resume_epoch(seen_before);
      progress.start_epoch(epoch);
      double total_loss = 0;
      int64_t batches = 0;
      int64_t consumed = 0;  // this rank's samples of the epoch (the loader's workers read ahead)
      for (auto& batch : *loader) {
        if (sample_log) {
          std::fprintf(sample_log, "%lld %lld %d", static_cast<long long>(epoch), static_cast<long long>(step),
                       group->size());
          for (int64_t index : *fetched) std::fprintf(sample_log, " %lld", static_cast<long long>(index));
          std::fprintf(sample_log, "\n");
          std::fflush(sample_log);
          fetched->clear();
        }
        at::Tensor features = batch.data.to(device);
        consumed += features.size(0);
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
        if (args.snapshot_every_steps > 0 && step % args.snapshot_every_steps == 0) {
          // Every rank has consumed as many samples as this one.
          write_snapshot(epoch, seen_before + consumed * group->size());
        }
      }
      progress.end_epoch();
      // The epoch's loss averaged over all ranks, not just rank 0's shard.
      at::Tensor mean_loss = at::full({1}, total_loss / batches, at::kDouble);
      group->all_reduce(mean_loss);
      double epoch_loss = mean_loss.item<double>() / group->size();

      // 36 test samples: measuring them every epoch costs next to nothing.
      const double accuracy = args.metrics.empty() ? 0.0 : test_accuracy();
      // Gathering the full model takes every rank (FSDP, ZeRO); rank 0
      // writes it. A snapshot needs no gather: each rank writes its part.
      const bool save_model = epoch % args.save_every == 0;
      const bool save_snapshot = save_model || epoch + 1 == args.total_epochs;
      ddp::StateDict model_state = save_model ? strategy->model_state() : ddp::StateDict{};
      if (save_snapshot) write_snapshot(epoch + 1, 0);
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
        std::fflush(stdout);
      }
    }

    if (sample_log) std::fclose(sample_log);
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
