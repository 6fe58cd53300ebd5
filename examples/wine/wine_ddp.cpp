// Trains the Wine classifier with DistributedDataParallel: one process per
// rank, each on its own shard of every epoch, gradients averaged by all-reduce.
//
//   ddprun --standalone --nproc-per-node 2 wine_ddp 100 50
//
// It also runs alone (a world of one) and under torchrun, srun or mpirun:
// ddp::init_process_group() reads whichever launcher's variables are set.
// The data arrives as in the reference tutorials' Python: a Dataset, a
// DistributedSampler and a DataLoader (torch::data::make_data_loader).
// wine_sharded.cpp is the same program with ZeRO-1 and FSDP to choose from.

#include "simple_nn.h"
#include "wine_cli.h"
#include "wine_data.h"
#include "wine_dataset.h"
#include "wine_fault_tolerant.h"

#include <ddp/ddp.h>

#include <torch/data/dataloader.h>
#include <torch/data/transforms/stack.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

int main(int argc, char** argv) {
  wine::Args args;
  try {
    args = wine::parse_args(argc, argv);
    if (args.strategy_given) throw examples::UsageError("--strategy is wine_sharded's; wine_ddp is DDP only");
  } catch (const examples::UsageError& e) {
    std::cerr << "error: " << e.what() << "\n";
    wine::print_usage(argv[0]);
    return 2;
  }
  try {
    // Fail now rather than after the first epoch's training.
    DDP_CHECK(std::filesystem::is_directory(args.checkpoint_dir), "checkpoint directory '",
              args.checkpoint_dir, "' does not exist; create it or pass --checkpoint-dir");
    // Under ddprun --fault-tolerance the workers are replicas that survive
    // each other's loss: the loop of wine_fault_tolerant.h (docs/fault_tolerance.md).
    if (ddp::fault_tolerance_requested()) {
      return wine::train_fault_tolerant(args, wine::load_split(args.train_csv, args.test_csv));
    }
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
    const int64_t train_size = data.train.size();
    data.test.features = data.test.features.to(device);
    data.test.labels = data.test.labels.to(device);

    torch::manual_seed(42);
    wine::SimpleNN model;
    if (!args.init_state.empty()) {
      ddp::load(model, args.init_state);
    }
    model->to(device);
    // carry_loss: the non-finite check and the logged loss ride on the
    // gradient all-reduce instead of costing two collectives of their own.
    ddp::DistributedDataParallel<wine::SimpleNN> ddp_model(model, group, ddp::DDPOptions().carry_loss(true));
    torch::optim::Adam optimizer(ddp_model.parameters(), torch::optim::AdamOptions(1e-3));

    // Each rank sees its own 1/world_size of every epoch.
    ddp::DistributedSampler sampler(
        train_size, ddp::SamplerOptions(group->size(), group->rank()).seed(args.seed));
    auto loader = torch::data::make_data_loader(
        wine::WineDataset(data.train).map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(args.batch_size).workers(args.workers));

    // After a crash or a restart by ddprun, carry on from the newest valid
    // snapshot: weights, Adam's moments and step counts, epoch.
    int64_t first_epoch = 0;
    int64_t step = 0;
    // Rank 0 writes snapshots off the training thread.
    ddp::SnapshotSaver snapshots(args.checkpoint_dir, ddp::SnapshotOptions().async_write(true));
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

    // Rank 0 shows progress on long runs and records one line per epoch.
    const int64_t steps_per_epoch = (sampler.num_samples() + args.batch_size - 1) / args.batch_size;
    ddp::ProgressLine progress(args.total_epochs, steps_per_epoch, ddp::ProgressOptions().enabled(is_master));
    ddp::MetricsWriter metrics(is_master ? args.metrics : "", /*append=*/first_epoch > 0);
    auto test_accuracy = [&] {
      torch::NoGradGuard no_grad;
      at::Tensor predicted = model->forward(data.test.features).argmax(1);
      return predicted.eq(data.test.labels).to(at::kDouble).mean().item<double>();
    };

    for (int64_t epoch = first_epoch; epoch < args.total_epochs; ++epoch) {
      sampler.set_epoch(epoch);  // a new shuffle each epoch, the same on all ranks
      progress.start_epoch(epoch);
      double total_loss = 0;
      int64_t batches = 0;
      for (auto& batch : *loader) {
        at::Tensor features = batch.data.to(device);
        at::Tensor labels = batch.target.to(device);
        optimizer.zero_grad();
        at::Tensor loss = torch::nn::functional::cross_entropy(ddp_model(features), labels);
        ddp_model.note_loss(loss);
        loss.backward();  // returns with gradients averaged across ranks, and the loss too
        // All ranks agree on a NaN anywhere, so they skip or stop together.
        if (!ddp::check_loss_is_finite(ddp_model.reduced_loss(), nonfinite_policy,
                                       "epoch " + std::to_string(epoch) + ", step " + std::to_string(step))) {
          continue;
        }
        optimizer.step();
        ++step;
        total_loss += ddp_model.reduced_loss().average;
        ++batches;
        progress.step(loss.item<double>(), features.size(0) * group->size());
      }
      progress.end_epoch();
      // The epoch's loss averaged over all ranks, not just rank 0's shard:
      // each step's loss already is (every rank has as many steps).
      const double epoch_loss = total_loss / static_cast<double>(batches);

      // Only the master node's rank 0 logs and saves.
      if (is_master) {
        std::printf("Epoch %lld, Loss: %.4f\n", static_cast<long long>(epoch), epoch_loss);
        if (!args.metrics.empty()) {
          metrics.write({epoch, epoch_loss, test_accuracy(), progress.epoch_samples_per_second(),
                         progress.elapsed_seconds()});
        }
      }
      const bool save_model = epoch % args.save_every == 0;
      if (save_model) {
        std::string path = args.checkpoint_dir + "/model_" + std::to_string(epoch) + ".pt";
        ddp::save(ddp_model, path);  // writes on rank 0 only
        if (is_master) std::printf("Epoch %lld | Model saved to %s\n", static_cast<long long>(epoch), path.c_str());
      }
      if (is_master && (save_model || epoch + 1 == args.total_epochs)) {
        // Copied now, written by a background thread while training goes
        // on; a crash mid-write leaves the previous snapshot the newest.
        snapshots.save(ddp::capture_snapshot(*model, optimizer, epoch, step));
      }
      std::fflush(stdout);
    }

    snapshots.wait();  // the last snapshot is on disk, or its error is thrown
    ddp::save(ddp_model, args.checkpoint_dir + "/model_final.pt");
    if (is_master) std::printf("Test accuracy: %.4f\n", test_accuracy());
    group->barrier();  // no rank leaves while rank 0 may still need it
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
  return 0;
}
