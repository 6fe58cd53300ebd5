// HSDP (FSDP on a 2-D mesh: sharded within a row, replicated across rows)
// and ZeRO-1 over a subgroup, on 4 real ranks laid out as 2 x 2
// (support/ranks.h, support/fsdp_trainers.h): the same weights as DDP after
// several optimizer steps under every strategy, model and option, shards
// that are half a unit and alike across replicas, gradient norms as DDP's,
// and distributed checkpoints that move between HSDP and plain FSDP. Also
// DDP's hierarchical all-reduce hook on the same mesh.
#include "support/fsdp_nets.h"
#include "support/fsdp_trainers.h"
#include "support/ranks.h"

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_checkpoint.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using namespace ddp::testing;
using Group = std::shared_ptr<ddp::ProcessGroup>;

const std::vector<int> kMesh = {2, 2};  // {replicate, shard}

TrainSpec hsdp(std::string strategy, std::string model = "seq") {
  TrainSpec s;
  s.strategy = std::move(strategy);
  s.model = std::move(model);
  s.mesh_shape = kMesh;
  return s;
}

void expect_close(const Group& group, const ddp::StateDict& a, const ddp::StateDict& b, double tolerance,
                  const std::string& label) {
  if (group->rank() == 0) EXPECT_LE(max_difference(a, b), tolerance) << label;
}

TEST(Hsdp, EveryStrategyOnATwoByTwoMeshMatchesDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    for (const std::string model : {"seq", "wrapped"}) {
      TrainSpec reference;
      reference.model = model;
      const auto trained = train(group, reference).state;
      TrainSpec initial = reference;
      initial.steps = 0;
      const auto untrained = train(group, initial).state;
      if (group->rank() == 0) EXPECT_GT(max_difference(trained, untrained), 1e-2) << model;
      // hybrid_shard and full_shard mean the same on a 2-D mesh; zero1 is
      // DDP over all four with Adam's state sharded over the row only.
      for (const std::string strategy : {"fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "hybrid_shard",
                                         "hybrid_shard_zero2", "zero1"}) {
        expect_close(group, trained, train(group, hsdp(strategy, model)).state, 1e-5, model + " " + strategy);
      }
    }
  }));
}

TEST(Hsdp, DeferredConstructionGradientAccumulationAndClippingMatchDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    TrainSpec reference;
    reference.micro_batches = 3;
    reference.clip_max_norm = 0.05;  // below the norms, so it clips
    const auto ddp_run = train(group, reference);
    TrainSpec deferred = hsdp("hybrid_shard");
    deferred.deferred = true;
    deferred.micro_batches = 3;
    deferred.clip_max_norm = 0.05;
    const auto hsdp_run = train(group, deferred);
    expect_close(group, ddp_run.state, hsdp_run.state, 1e-5, "deferred, 3 micro-batches, clipped");
    // The norm of the whole gradient, not of the replicas' shards summed.
    ASSERT_EQ(hsdp_run.norms.size(), ddp_run.norms.size());
    for (size_t i = 0; i < ddp_run.norms.size(); ++i) {
      EXPECT_NEAR(hsdp_run.norms[i], ddp_run.norms[i], 1e-5 * ddp_run.norms[i]) << "step " << i;
      EXPECT_GT(ddp_run.norms[i], 0.05) << "step " << i;
    }
  }));
}

// SGD: Adam would turn a rounding difference in a near-zero gradient into a
// full step of difference.
TEST(Hsdp, MixedPrecisionAndCompressedReductionsStayCloseToDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    TrainSpec reference;
    reference.optimizer = "sgd";
    const auto trained = train(group, reference).state;
    // param_dtype: HSDP against plain FSDP at the same world size, which
    // computes in the same dtype.
    TrainSpec flat = reference;
    flat.strategy = "fsdp-full";
    flat.param_dtype = at::kBFloat16;
    TrainSpec hybrid = hsdp("hybrid_shard");
    hybrid.optimizer = "sgd";
    hybrid.param_dtype = at::kBFloat16;
    expect_close(group, train(group, flat).state, train(group, hybrid).state, 1e-3, "param_dtype bf16");
    // reduce_dtype: gradients summed in half within the row and across it.
    TrainSpec half = hsdp("hybrid_shard");
    half.optimizer = "sgd";
    half.reduce_dtype = at::kHalf;
    const auto compressed = train(group, half).state;
    TrainSpec initial = reference;
    initial.steps = 0;
    const auto untrained = train(group, initial).state;
    if (group->rank() == 0) EXPECT_GT(max_difference(trained, untrained), 1e-2);
    expect_close(group, trained, compressed, 1e-3, "reduce_dtype half");
  }));
}

// Built by hand: shards are half of each unit (the row has two ranks), the
// two replicas of a shard hold the same values, and no_sync() accumulates
// across two backward passes before one reduction, as DDP's does.
TEST(Hsdp, ShardsAreHalfAUnitAlikeAcrossReplicasAndNoSyncMatchesDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    ddp::DeviceMesh mesh(group, kMesh, {"replicate", "shard"});
    auto make = [] {
      torch::manual_seed(3);
      return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
    };
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make(), mesh,
                                                               ddp::FSDPOptions().min_num_params(1));
    EXPECT_EQ(model.sharding_strategy(), ddp::ShardingStrategy::kHybridShard);
    ASSERT_TRUE(model.replicate_group());
    EXPECT_EQ(model.shard_group()->size(), 2);
    EXPECT_EQ(model.replicate_group()->size(), 2);
    EXPECT_EQ(model.process_group()->size(), 4);
    const auto shards = model.parameters();
    ASSERT_EQ(shards.size(), 2u);
    EXPECT_EQ(shards[0].numel(), (6 * 8 + 8) / 2);
    EXPECT_EQ(shards[1].numel(), (8 * 2 + 2) / 2);

    ddp::DistributedDataParallel<torch::nn::Sequential> reference(make(), group);
    torch::optim::Adam hsdp_adam(shards, 1e-2), ddp_adam(reference->parameters(), 1e-2);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
    for (int step = 0; step < 3; ++step) {
      hsdp_adam.zero_grad();
      ddp_adam.zero_grad();
      std::vector<at::Tensor> xs, ys;
      for (int micro = 0; micro < 2; ++micro) {
        at::Tensor x = at::randn({16, 6}, generator), y = at::randn({16, 2}, generator);
        xs.push_back(x.narrow(0, group->rank() * 4, 4));
        ys.push_back(y.narrow(0, group->rank() * 4, 4));
      }
      {
        auto hsdp_guard = model.no_sync();
        auto ddp_guard = reference.no_sync();
        torch::nn::functional::mse_loss(model.forward(xs[0]), ys[0]).backward();
        torch::nn::functional::mse_loss(reference.forward(xs[0]), ys[0]).backward();
      }
      torch::nn::functional::mse_loss(model.forward(xs[1]), ys[1]).backward();
      torch::nn::functional::mse_loss(reference.forward(xs[1]), ys[1]).backward();
      hsdp_adam.step();
      ddp_adam.step();
    }
    // The two replicas of this shard (same row position, other row) agree.
    for (const auto& shard : shards) {
      const auto both = model.replicate_group()->all_gather(shard.detach());
      EXPECT_TRUE(both[0].equal(both[1])) << "replicas of a shard differ";
    }
    const auto hsdp_state = model.full_state_dict();
    expect_close(group, ddp::state_dict(*reference.module()), hsdp_state, 1e-5, "no_sync");
  }));
}

// A distributed checkpoint written under HSDP (each replica writes its half
// of the row's shard, so every element once) loads into plain FSDP at the
// same world size and into DDP at 2 ranks, and FSDP's loads into HSDP.
TEST(Hsdp, DistributedCheckpointsMoveBetweenHsdpAndPlainFsdp) {
  RanksTempDir dir;
  expect_phases_succeeded(run_phases_on_ranks({
      {4, [&](const Group& group) {
         TrainSpec save = hsdp("hybrid_shard");
         save.save_dcp = dir.path() + "/from_hsdp";
         save.save_full = dir.path() + "/hsdp";
         train(group, save);
         TrainSpec save_flat;
         save_flat.strategy = "fsdp-full";
         save_flat.save_dcp = dir.path() + "/from_fsdp";
         save_flat.save_full = dir.path() + "/fsdp";
         train(group, save_flat);

         // Loaded and trained 0 steps: exactly what was saved.
         TrainSpec into_flat;
         into_flat.strategy = "fsdp-full";
         into_flat.steps = 0;
         into_flat.load_dcp = dir.path() + "/from_hsdp";
         const auto flat = train(group, into_flat).state;
         TrainSpec into_hybrid = hsdp("hybrid_shard");
         into_hybrid.steps = 0;
         into_hybrid.load_dcp = dir.path() + "/from_fsdp";
         const auto hybrid = train(group, into_hybrid).state;
         if (group->rank() == 0) {
           EXPECT_EQ(max_difference(ddp::load_state_dict(dir.path() + "/hsdp.model.pt"), flat), 0.0);
           EXPECT_EQ(max_difference(ddp::load_state_dict(dir.path() + "/fsdp.model.pt"), hybrid), 0.0);
         }
         // Resuming from HSDP's checkpoint (optimizer included) continues as
         // an uninterrupted run.
         TrainSpec resumed = hsdp("hybrid_shard");
         resumed.first_step = 6;
         resumed.load_dcp = dir.path() + "/from_hsdp";
         TrainSpec straight;
         straight.steps = 12;
         expect_close(group, train(group, straight).state, train(group, resumed).state, 1e-5, "resumed");
       }},
      {2, [&](const Group& group) {
         TrainSpec into_ddp;
         into_ddp.steps = 0;
         into_ddp.load_dcp = dir.path() + "/from_hsdp";
         const auto state = train(group, into_ddp).state;
         if (group->rank() == 0) {
           EXPECT_EQ(max_difference(ddp::load_state_dict(dir.path() + "/hsdp.model.pt"), state), 0.0);
         }
       }},
  }), 2);
}

// Reduce to each row's first rank, all-reduce between those two, broadcast
// back: the same weights as the flat all-reduce, within rounding (the sum is
// taken in another order). Dropping any of the three steps leaves some rank
// without the others' gradients.
TEST(HierarchicalAllreduce, DdpWithTheHookMatchesFlatDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    ddp::DeviceMesh mesh(group, kMesh, {"replicate", "shard"});
    auto make = [] {
      torch::manual_seed(5);
      return torch::nn::Sequential(torch::nn::Linear(6, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32),
                                   torch::nn::Tanh(), torch::nn::Linear(32, 2));
    };
    // Small buckets: several in flight on the hook's thread at once.
    ddp::DistributedDataParallel<torch::nn::Sequential> flat(make(), group, ddp::DDPOptions().bucket_cap_mb(0.001));
    ddp::DistributedDataParallel<torch::nn::Sequential> hierarchical(
        make(), group,
        ddp::DDPOptions().bucket_cap_mb(0.001).comm_hook(ddp::hierarchical_allreduce_hook(mesh)));
    torch::optim::Adam flat_adam(flat->parameters(), 1e-2), hier_adam(hierarchical->parameters(), 1e-2);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(11);
    for (int step = 0; step < 4; ++step) {
      at::Tensor x = at::randn({16, 6}, generator), y = at::randn({16, 2}, generator);
      x = x.narrow(0, group->rank() * 4, 4);
      y = y.narrow(0, group->rank() * 4, 4);
      flat_adam.zero_grad();
      hier_adam.zero_grad();
      torch::nn::functional::mse_loss(flat.forward(x), y).backward();
      torch::nn::functional::mse_loss(hierarchical.forward(x), y).backward();
      flat_adam.step();
      hier_adam.step();
    }
    const auto a = ddp::state_dict(*flat.module()), b = ddp::state_dict(*hierarchical.module());
    EXPECT_LE(max_difference(a, b), 1e-6) << "rank " << group->rank();
    // Every rank holds the same weights.
    for (const auto& t : hierarchical->parameters()) {
      const auto all = group->all_gather(t.detach().contiguous());
      for (const auto& other : all) EXPECT_TRUE(other.equal(all[0]));
    }
  }));
}

TEST(Hsdp, HybridStrategiesParseAndAOneRowMeshIsPlainFsdp) {
  EXPECT_EQ(ddp::parse_sharding_strategy("HYBRID_SHARD"), ddp::ShardingStrategy::kHybridShard);
  EXPECT_EQ(ddp::parse_sharding_strategy("_HYBRID_SHARD_ZERO2"), ddp::ShardingStrategy::kHybridShardZero2);
  EXPECT_EQ(ddp::to_string(ddp::ShardingStrategy::kHybridShardZero2), "hybrid_shard_zero2");
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    // A 1 x 2 mesh: nothing to replicate, so plain FULL_SHARD over the row.
    ddp::DeviceMesh mesh(group, {1, 2}, {"replicate", "shard"});
    torch::manual_seed(0);
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(torch::nn::Sequential(torch::nn::Linear(4, 4)), mesh);
    EXPECT_EQ(model.sharding_strategy(), ddp::ShardingStrategy::kFullShard);
    EXPECT_FALSE(model.replicate_group());
  }));
}

}  // namespace
