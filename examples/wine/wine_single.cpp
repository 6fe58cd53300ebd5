// Trains the Wine classifier in one process, with plain LibTorch. This is the
// baseline: compare it with wine_ddp.cpp to see what data parallelism changes.
// One ddp call remains: ddp::load reads the --init state dict that Python's
// torch.save wrote, which LibTorch's own torch::load cannot (it reads only
// torch::save's TorchScript archives, and fails on "constants.pkl").
//
//   wine_single 100 50            # 100 epochs, checkpoint every 50

#include "simple_nn.h"
#include "wine_cli.h"
#include "wine_data.h"

#include <ddp/checkpoint.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>
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
  if (!args.metrics.empty() || !args.resume || args.on_nonfinite != "abort") {
    std::cerr << "error: --metrics, --no-resume and --on-nonfinite belong to wine_ddp\n";
    wine::print_usage(argv[0]);
    return 2;
  }
  try {
    // Fail now rather than after the first epoch's training.
    TORCH_CHECK(std::filesystem::is_directory(args.checkpoint_dir), "checkpoint directory '",
                args.checkpoint_dir, "' does not exist; create it or pass --checkpoint-dir");
    wine::Split data;
    if (args.train_csv.empty()) {
      data = wine::train_test_split(wine::read_csv(wine::default_csv_path()), 0.2, 42);
    } else {
      data = {wine::read_csv(args.train_csv), wine::read_csv(args.test_csv)};
    }
    wine::standardize(data.train, data.test);
    const bool use_cuda = args.device == "cuda" || (args.device == "auto" && torch::cuda::is_available());
    TORCH_CHECK(!use_cuda || torch::cuda::is_available(), "--device cuda: no CUDA device is available");
    const torch::Device device(use_cuda ? torch::kCUDA : torch::kCPU);
    for (auto* set : {&data.train, &data.test}) {
      set->features = set->features.to(device);
      set->labels = set->labels.to(device);
    }

    torch::manual_seed(42);
    wine::SimpleNN model;
    if (!args.init_state.empty()) {
      ddp::load(model, args.init_state);
    }
    model->to(device);
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));

    for (int64_t epoch = 0; epoch < args.total_epochs; ++epoch) {
      // A fresh seeded shuffle each epoch, as DataLoader(shuffle=True) does.
      auto generator = at::make_generator<at::CPUGeneratorImpl>(args.seed + epoch);
      at::Tensor order = at::randperm(data.train.size(), generator, at::TensorOptions().dtype(at::kLong));
      double total_loss = 0;
      int64_t batches = 0;
      for (int64_t start = 0; start < data.train.size(); start += args.batch_size) {
        at::Tensor idx = order.narrow(0, start, std::min(args.batch_size, data.train.size() - start)).to(device);
        optimizer.zero_grad();
        at::Tensor loss = torch::nn::functional::cross_entropy(model->forward(data.train.features.index_select(0, idx)),
                                                               data.train.labels.index_select(0, idx));
        loss.backward();
        optimizer.step();
        total_loss += loss.item<double>();
        ++batches;
      }
      std::printf("Epoch %lld, Loss: %.4f\n", static_cast<long long>(epoch), total_loss / batches);
      if (epoch % args.save_every == 0) {
        std::string path = args.checkpoint_dir + "/model_" + std::to_string(epoch) + ".pt";
        torch::save(model, path);  // LibTorch's own format; wine_ddp writes torch.load-able files
        std::printf("Epoch %lld | Model saved to %s\n", static_cast<long long>(epoch), path.c_str());
      }
    }
    torch::save(model, args.checkpoint_dir + "/model_final.pt");

    torch::NoGradGuard no_grad;
    model->eval();
    at::Tensor predicted = model->forward(data.test.features).argmax(1);
    double accuracy = predicted.eq(data.test.labels).to(at::kDouble).mean().item<double>();
    std::printf("Test accuracy: %.4f\n", accuracy);
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
