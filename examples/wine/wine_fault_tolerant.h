#pragma once

// wine_ddp's training loop under ddprun --fault-tolerance (DDP_FAULT_TOLERANCE=1;
// docs/fault_tolerance.md): the same model, optimizer and flags, but each
// worker is a replica that keeps training when others die, and a restarted
// worker copies the state from a live one instead of reading a snapshot.
// What differs from wine_ddp.cpp's loop, line for line:
//  - ddp::FaultTolerance instead of init_process_group(); DDP is built on its
//    local group with its options (the gradient all-reduce is its hook);
//  - FaultTolerantSampler instead of DistributedSampler: its cursor moves
//    only on committed steps, so a lost replica's samples are redone;
//  - ft.start_step() before each step and optimizer.step() only if
//    ft.should_commit();
//  - no snapshots: state lives on the surviving replicas. The replica that is
//    rank 0 prints, writes the metrics (with the fault-tolerance counters as
//    a last line) and saves model_final.pt.

#include "simple_nn.h"
#include "wine_cli.h"
#include "wine_data.h"

#include <ddp/ddp.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <cstdio>
#include <fstream>
#include <memory>

namespace wine {

inline int train_fault_tolerant(const Args& args, const Split& data) {
  DDP_CHECK(args.device == "cpu" || args.device == "auto", "--device ", args.device,
            " is not supported under --fault-tolerance, which runs on the CPU over Gloo");
  ddp::FaultTolerance ft;
  torch::manual_seed(42);
  SimpleNN model;
  if (!args.init_state.empty()) ddp::load(model, args.init_state);
  ddp::DistributedDataParallel<SimpleNN> ddp_model(model, ft.local_group(), ft.ddp_options());
  torch::optim::Adam optimizer(ddp_model.parameters(), torch::optim::AdamOptions(1e-3));
  ddp::FaultTolerantSampler sampler(data.train.size(), args.batch_size, args.seed);
  ft.manage(model.ptr(), &optimizer, &sampler);
  auto test_accuracy = [&] {
    torch::NoGradGuard no_grad;
    at::Tensor predicted = model->forward(data.test.features).argmax(1);
    return predicted.eq(data.test.labels).to(at::kDouble).mean().item<double>();
  };

  {
    std::unique_ptr<ddp::MetricsWriter> metrics;  // opened by whoever is rank 0 at an epoch's end
    double epoch_loss = 0;
    int64_t batches = 0;
    while (sampler.epoch() < args.total_epochs) {
      ft.start_step();
      const int64_t epoch = sampler.epoch();
      at::Tensor index = torch::tensor(sampler.batch(ft.rank(), ft.size()), at::kLong);
      optimizer.zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(ddp_model(data.train.features.index_select(0, index)),
                                                             data.train.labels.index_select(0, index));
      loss.backward();  // averaged over the replicas of this step
      if (!ft.should_commit()) continue;  // every replica drops it; its samples come again
      optimizer.step();
      epoch_loss += loss.item<double>();
      ++batches;
      if (sampler.epoch() != epoch && ft.rank() == 0) {
        // This replica's loss over the epoch's steps it committed.
        std::printf("Epoch %lld, Loss: %.4f\n", static_cast<long long>(epoch), epoch_loss / batches);
        std::fflush(stdout);
        if (!args.metrics.empty()) {
          if (!metrics) metrics = std::make_unique<ddp::MetricsWriter>(args.metrics, /*append=*/true);
          metrics->write({epoch, epoch_loss / batches, test_accuracy(), 0.0, 0.0});
        }
      }
      if (sampler.epoch() != epoch) epoch_loss = 0, batches = 0;
    }
  }
  if (ft.rank() == 0) {
    ddp::save(ddp_model, args.checkpoint_dir + "/model_final.pt");
    std::printf("Test accuracy: %.4f\n", test_accuracy());
    std::printf("Fault tolerance: %s\n", ft.stats_json().c_str());
    if (!args.metrics.empty()) std::ofstream(args.metrics, std::ios::app) << ft.stats_json() << "\n";
  }
  return 0;
}

}  // namespace wine
