// One DDP training step in a world of one, through the umbrella header only.
#include <ddp/ddp.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>

int main() {
  auto group = ddp::init_process_group();
  ddp::DistributedDataParallel<torch::nn::Linear> model(torch::nn::Linear(4, 2), group);
  torch::optim::SGD optimizer(model.parameters(), 0.1);
  auto loss = model(at::ones({3, 4})).sum();
  loss.backward();
  optimizer.step();
  std::printf("consumer ok: world %d, %zu tensors\n", group->size(), model.state_dict().size());
  return 0;
}
