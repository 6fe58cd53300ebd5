// ZeroRedundancyOptimizer (ZeRO-1) on real processes (support/ranks.h):
// each rank steps its shard, yet the weights and the consolidated optimizer
// state equal the full optimizer's, bit for bit.
#include <support/launch.h>
#include <support/ddp_models.h>
#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  if (kind == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// ZeRO-1 (each rank steps its shard) against plain DDP with the full
// optimizer: the same weights, bit for bit, state only for this rank's
// shard, and the same optimizer state once consolidated. Returns rank 0's
// consolidated state.
c10::IValue expect_zero_matches_full_optimizer(const Group& group, const std::string& kind) {
  SCOPED_TRACE(kind);
  const int64_t steps = 6;
  auto make = [&](std::vector<at::Tensor> params) { return make_optimizer(kind, std::move(params)); };
  torch::manual_seed(8);
  Mlp sharded_model;
  torch::manual_seed(8);
  Mlp full_model;
  ddp::DistributedDataParallel<Mlp> sharded(sharded_model, group);
  ddp::DistributedDataParallel<Mlp> full(full_model, group);
  ddp::ZeroRedundancyOptimizer zero_optimizer(sharded->parameters(), group, make);
  auto full_optimizer = make(full->parameters());
  for (int64_t s = 0; s < steps; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(100 * s + group->rank());
    at::Tensor x = at::randn({6, 10}, generator);
    at::Tensor y = at::randint(0, 4, {6}, generator, at::kLong);
    zero_optimizer.zero_grad();
    torch::nn::functional::cross_entropy(sharded.forward(x), y).backward();
    zero_optimizer.step();
    full_optimizer->zero_grad();
    torch::nn::functional::cross_entropy(full.forward(x), y).backward();
    full_optimizer->step();
  }
  EXPECT_TRUE(at::equal(flatten_parameters(*sharded_model), flatten_parameters(*full_model)));
  expect_replicas_identical(group, flatten_parameters(*sharded_model));
  const size_t owned = zero_optimizer.local_indices().size();
  const size_t all = sharded->parameters().size();
  EXPECT_EQ(all, 6u);
  EXPECT_LT(owned, all) << "rank " << group->rank() << " owns every parameter";
  EXPECT_EQ(zero_optimizer.local_optimizer().state().size(), owned);
  at::Tensor total = at::full({1}, static_cast<int64_t>(owned), at::kLong);
  group->all_reduce(total);
  EXPECT_EQ(total.item<int64_t>(), 6) << "every parameter has exactly one owner";

  auto consolidated = zero_optimizer.consolidate_state_dict(0);
  if (group->rank() == 0) {
    auto reference = ddp::optimizer_state_dict(*full_optimizer).toGenericDict().at("state").toGenericDict();
    auto merged = consolidated.toGenericDict().at("state").toGenericDict();
    EXPECT_EQ(merged.size(), 6u);
    EXPECT_EQ(reference.size(), merged.size());
    for (const auto& item : reference) {
      auto mine = merged.at(item.key()).toGenericDict();
      for (const auto& field : item.value().toGenericDict()) {
        EXPECT_TRUE(at::equal(field.value().toTensor(), mine.at(field.key()).toTensor()))
            << "state " << item.key().toInt() << " " << field.key().toStringRef();
      }
    }
  }
  group->barrier();
  return consolidated;
}

TEST(ZeroRedundancyOptimizer, MatchesTheFullOptimizerBitForBit) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (const std::string kind : {"adam", "adamw", "sgd"}) expect_zero_matches_full_optimizer(group, kind);
  }));
}

TEST(ZeroRedundancyOptimizer, MatchesTheFullOptimizerBitForBitAtThreeRanks) {
  expect_all_succeeded(
      run_on_ranks(3, [](const Group& group) { expect_zero_matches_full_optimizer(group, "adam"); }));
}

TEST(ZeroRedundancyOptimizer, ConsolidatedStateLoadsIntoPythonAdam) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&](const Group& group) {
    auto consolidated = expect_zero_matches_full_optimizer(group, "adam");
    if (group->rank() == 0) ddp::save_value(consolidated, dir / "optimizer.pt");
  });
  expect_all_succeeded(ranks);
  auto py = run_process({DDP_PYTHON, "-c",
                         "import sys, torch\n"
                         "s = torch.load(sys.argv[1])\n"
                         "m = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))\n"
                         "opt = torch.optim.Adam(m.parameters(), lr=0.5)\n"
                         "opt.load_state_dict(s)\n"
                         "print('loaded', len(opt.state), 'states, step', float(opt.state[m[0].weight]['step']),"
                         " 'lr', opt.param_groups[0]['lr'])\n",
                         dir / "optimizer.pt"});
  ASSERT_EQ(py.exit_code, 0) << py.describe();
  EXPECT_NE(py.out.find("loaded 6 states, step 6.0 lr 0.01"), std::string::npos) << py.out;
}

}  // namespace
