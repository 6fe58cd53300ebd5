// Trains a model that Python scripted (torch.jit.script, then .save) with
// DistributedDataParallel, on the Wine data through a torch::data loader:
//
//   python examples/torchscript/script_wine_mlp.py script wine_mlp.pt
//   ddprun --standalone --nproc-per-node 2 train_scripted wine_mlp.pt --out trained
//
// Rank 0 writes trained.pt (the TorchScript module, for torch.jit.load) and
// trained_state.pt (its state dict, for torch.load and load_state_dict).

#include "../common/command_line.h"
#include "../wine/wine_data.h"
#include "../wine/wine_dataset.h"

#include <ddp/ddp.h>

#include <torch/data/dataloader.h>
#include <torch/data/transforms/stack.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/script.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

namespace {

struct Args {
  std::string scripted;
  std::string out = "trained";
  int64_t epochs = 3;
  int64_t batch_size = 32;
};

void add_flags(CLI::App& app, Args& args) {
  app.add_option("SCRIPTED.pt", args.scripted, "a module saved by torch.jit.script(...).save()")->required();
  app.add_option("--out", args.out, "write PREFIX.pt and PREFIX_state.pt")->type_name("PREFIX");
  app.add_option("--epochs", args.epochs, "epochs to train")
      ->type_name("N")
      ->transform(examples::positive_integer("--epochs"));
  app.add_option("--batch-size", args.batch_size, "samples per batch on each rank")
      ->type_name("N")
      ->transform(examples::positive_integer("--batch-size"));
}

const char* const kDescription = "Trains a TorchScript module with DistributedDataParallel on the Wine data.";

}  // namespace

int main(int argc, char** argv) {
  Args args;
  examples::CommandLine command_line(kDescription, argv[0]);
  add_flags(command_line, args);
  try {
    command_line.read(argc, argv);
  } catch (const examples::UsageError& e) {
    std::cerr << "error: " << e.what() << "\n" << command_line.help();
    return 2;
  }
  try {
    auto group = ddp::init_process_group();
    // Parameters are the jit::Module's own tensors; DDP checks every rank
    // loaded the same model and copies rank 0's weights to all.
    ddp::DistributedDataParallel<torch::jit::Module> model(torch::jit::load(args.scripted), group);
    model->train();
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-3));

    wine::Split data = wine::load_split();
    ddp::DistributedSampler sampler(data.train.size(), ddp::SamplerOptions(group->size(), group->rank()));
    auto loader = torch::data::make_data_loader(wine::WineDataset(data.train).map(torch::data::transforms::Stack<>()),
                                                sampler, torch::data::DataLoaderOptions().batch_size(args.batch_size));
    for (int64_t epoch = 0; epoch < args.epochs; ++epoch) {
      sampler.set_epoch(epoch);
      double total = 0;
      int64_t batches = 0;
      for (auto& batch : *loader) {
        optimizer.zero_grad();
        at::Tensor logits = model.forward(batch.data).toTensor();
        at::Tensor loss = torch::nn::functional::cross_entropy(logits, batch.target);
        loss.backward();
        optimizer.step();
        total += loss.item<double>();
        ++batches;
      }
      if (group->rank() == 0) std::printf("Epoch %lld, rank 0 loss: %.6f\n", static_cast<long long>(epoch), total / batches);
    }
    ddp::save(model, args.out + "_state.pt");
    if (group->rank() == 0) {
      model.module().save(args.out + ".pt");
      std::printf("wrote %s.pt and %s_state.pt\n", args.out.c_str(), args.out.c_str());
    }
    group->barrier();
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
  return 0;
}
