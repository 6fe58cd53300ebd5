// FSDPOptions::replicate_hook: HSDP's across-replica stage through a
// CommHook (what fault-tolerant HSDP needs: FSDP over one replica's ranks,
// the replicas averaged by FaultTolerance's hook). On 4 real ranks laid out
// as 2 replicas x 2 shards (support/ranks.h), FSDP over the mesh's shard
// group with a hook that averages over the replicate group trains exactly as
// HSDP on the 2-D mesh; a hook's failure fails the backward with the unit's
// name on its rank only, and a failed shard reduction still runs the hook
// (on zeros) so the other replica does not wait; a mesh that already
// replicates is refused.
#include "support/fsdp_nets.h"
#include "support/fsdp_trainers.h"
#include "support/ranks.h"
#include "support/torch_errors.h"

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace ddp::testing;
using Group = std::shared_ptr<ddp::ProcessGroup>;

const std::vector<int> kMesh = {2, 2};  // {replicate, shard}

// What the hook saw of one bucket.
struct Seen {
  size_t index;
  bool is_last;
  bool scatters;
  at::ScalarType dtype;
  int64_t numel;
  bool zeros;
};

// A stand-in for FaultTolerance::comm_hook(): all-reduces the bucket over
// the replicas (a group FSDP does not know) and divides by their number.
class AverageOverReplicas : public ddp::CommHook {
 public:
  explicit AverageOverReplicas(Group replicate) : replicate_(std::move(replicate)) {}

  c10::intrusive_ptr<c10::ivalue::Future> run(ddp::ProcessGroup& /*group*/, ddp::GradBucket& bucket) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen.push_back({bucket.index(), bucket.is_last(), bucket.scatters(), bucket.buffer().scalar_type(),
                      bucket.buffer().numel(), bucket.buffer().abs().sum().item<double>() == 0.0});
    }
    at::Tensor buffer = bucket.buffer();
    const int64_t replicas = replicate_->size();
    auto summed = replicate_->all_reduce_async(buffer)->getFuture();
    const bool fail = fail_bucket && *fail_bucket == bucket.index() && armed;
    return summed->then(
        [buffer, replicas, fail](c10::ivalue::Future& done) -> c10::IValue {
          (void)done.value();  // rethrows the all-reduce's error
          // The replicas' collective is done (they complete); this rank's
          // part fails, as a lost member would make it.
          if (fail) throw std::runtime_error("the test hook lost its replica");
          return buffer.div_(replicas);
        },
        c10::TensorType::get());
  }

  std::vector<Seen> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(seen, {});
  }

  std::optional<size_t> fail_bucket;  // fails this bucket's future while armed
  bool armed = false;
  std::vector<Seen> seen;

 private:
  Group replicate_;
  std::mutex mutex_;
};

// A shard-group hook (FSDPOptions::comm_hook) whose reduce-scatter of one
// bucket runs and then fails, while armed.
class FailingShardReduce : public ddp::CommHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> run(ddp::ProcessGroup& group, ddp::GradBucket& bucket) override {
    auto future = group.reduce_scatter_async(bucket.shard(), bucket.buffer())->getFuture();
    if (!armed || bucket.index() != fail_bucket) return future;
    return future->then(
        [](c10::ivalue::Future& done) -> c10::IValue {
          (void)done.value();
          throw std::runtime_error("the test's reduce-scatter broke");
        },
        c10::TensorType::get());
  }
  size_t fail_bucket = 1;
  bool armed = false;
};

torch::nn::Sequential make_seq() {
  torch::manual_seed(3);
  // Units of 49 (padded to 50), 40 and 18 elements.
  return torch::nn::Sequential(torch::nn::Linear(6, 7), torch::nn::Tanh(), torch::nn::Linear(7, 5), torch::nn::Tanh(),
                               torch::nn::Linear(5, 3));
}

// This rank's rows of step `step`'s global batch (16 rows, 4 per rank).
std::pair<at::Tensor, at::Tensor> batch(int64_t step, int rank) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  at::Tensor x = at::randn({16, 6}, generator), y = at::randn({16, 3}, generator);
  return {x.narrow(0, rank * 4, 4), y.narrow(0, rank * 4, 4)};
}

// Trains `model` for `steps` Adam steps on this rank's rows; the full
// parameters at the end, on every rank.
template <typename Model>
ddp::StateDict train_steps(Model& model, int rank, int steps, AverageOverReplicas* hook = nullptr) {
  torch::optim::Adam adam(model.parameters(), 1e-2);
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step, rank);
    adam.zero_grad();
    torch::nn::functional::mse_loss(model.forward(x), y).backward();
    adam.step();
    if (hook) {
      // One bucket per unit and pass, in launch order, the last marked.
      const auto seen = hook->take();
      EXPECT_EQ(seen.size(), model.unit_names().size());
      for (size_t i = 0; i < seen.size(); ++i) {
        EXPECT_EQ(seen[i].index, i);
        EXPECT_EQ(seen[i].is_last, i + 1 == seen.size());
        EXPECT_FALSE(seen[i].scatters);
      }
    }
  }
  return model.full_state_dict(/*rank0_only=*/false);
}

struct Case {
  ddp::ShardingStrategy hybrid;  // on the 2-D mesh
  ddp::ShardingStrategy plain;   // over the shard group, with the hook
  std::optional<at::ScalarType> reduce_dtype;
  std::string label;
};

// The same data per rank, the same steps: FSDP over the shard group with the
// hook lands on HSDP's weights bit for bit (dividing by 2 before the shard
// group's sum and by 2 after the replicas' is dividing by 4 before both,
// exactly, for powers of two).
TEST(FsdpReplicateHook, MatchesHsdpOnATwoByTwoMesh) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    ddp::DeviceMesh mesh(group, kMesh, {"replicate", "shard"});
    const std::vector<Case> cases = {
        {ddp::ShardingStrategy::kHybridShard, ddp::ShardingStrategy::kFullShard, std::nullopt, "full_shard"},
        {ddp::ShardingStrategy::kHybridShardZero2, ddp::ShardingStrategy::kShardGradOp, std::nullopt,
         "shard_grad_op"},
        {ddp::ShardingStrategy::kNoShard, ddp::ShardingStrategy::kNoShard, std::nullopt, "no_shard"},
        {ddp::ShardingStrategy::kHybridShard, ddp::ShardingStrategy::kFullShard, at::kBFloat16,
         "full_shard, reduce_dtype bf16"},
    };
    ddp::StateDict untrained;
    {
      ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_seq(), mesh,
                                                                 ddp::FSDPOptions().min_num_params(1));
      untrained = train_steps(model, group->rank(), 0);
    }
    for (const auto& c : cases) {
      ddp::FSDPOptions hybrid = ddp::FSDPOptions().min_num_params(1).sharding_strategy(c.hybrid);
      if (c.reduce_dtype) hybrid.reduce_dtype(*c.reduce_dtype);
      ddp::FullyShardedDataParallel<torch::nn::Sequential> reference(make_seq(), mesh, hybrid);
      ASSERT_TRUE(reference.replicate_group()) << c.label;
      const auto expected = train_steps(reference, group->rank(), 4);

      auto hook = std::make_shared<AverageOverReplicas>(mesh.group("replicate"));
      ddp::FSDPOptions plain = ddp::FSDPOptions().min_num_params(1).sharding_strategy(c.plain).replicate_hook(hook);
      if (c.reduce_dtype) plain.reduce_dtype(*c.reduce_dtype);
      ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_seq(), mesh.group("shard"), plain);
      EXPECT_FALSE(model.replicate_group()) << c.label;
      EXPECT_EQ(model.sharding_strategy(), c.plain) << c.label;
      EXPECT_EQ(model.process_group()->size(), 2) << c.label;
      const auto units = model.parameters();
      const auto got = train_steps(model, group->rank(), 4, hook.get());

      EXPECT_GT(max_difference(expected, untrained), 1e-2) << c.label;
      EXPECT_EQ(max_difference(expected, got), 0.0) << c.label << " on rank " << group->rank();
      // One more backward: the gradients themselves are HSDP's, bit for bit
      // (not just the Adam steps, which hardly change when every gradient
      // is scaled alike).
      const at::Tensor x = batch(9, group->rank()).first;
      reference.forward(x).sum().backward();
      model.forward(x).sum().backward();
      const auto reference_units = reference.parameters();
      ASSERT_EQ(reference_units.size(), units.size());
      for (size_t i = 0; i < units.size(); ++i) {
        EXPECT_TRUE(units[i].grad().equal(reference_units[i].grad()))
            << c.label << ", unit " << i << ": " << units[i].grad().sub(reference_units[i].grad()).abs().max().item<double>();
      }
      // The hook's buffer: the shard (the whole unit under no_shard), in the
      // reduce dtype.
      const auto seen = hook->take();
      ASSERT_EQ(seen.size(), units.size());
      std::vector<int64_t> numels;
      for (const auto& s : seen) {
        EXPECT_EQ(s.dtype, c.reduce_dtype.value_or(at::kFloat)) << c.label;
        numels.push_back(s.numel);
      }
      // Launched in backward's order: the last unit first.
      std::vector<int64_t> shard_numels;
      for (auto it = units.rbegin(); it != units.rend(); ++it) shard_numels.push_back(it->numel());
      EXPECT_EQ(numels, shard_numels) << c.label;
    }
  }));
}

// A model with a root unit and a buffer (WrappedNet), under the default
// strategy: the same.
TEST(FsdpReplicateHook, MatchesHsdpWithARootUnit) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    ddp::DeviceMesh mesh(group, kMesh, {"replicate", "shard"});
    auto make = [] {
      torch::manual_seed(4);
      return WrappedNet();
    };
    auto run = [&](auto& model) {
      torch::optim::Adam adam(model.parameters(), 1e-2);
      for (int64_t step = 0; step < 4; ++step) {
        auto [x, y] = global_batch(step);
        adam.zero_grad();
        torch::nn::functional::mse_loss(model.forward(x.narrow(0, group->rank() * 3, 3)),
                                        y.narrow(0, group->rank() * 3, 3))
            .backward();
        adam.step();
      }
      return model.full_state_dict(/*rank0_only=*/false);
    };
    ddp::FullyShardedDataParallel<WrappedNet> reference(make(), mesh);
    const auto expected = run(reference);
    auto hook = std::make_shared<AverageOverReplicas>(mesh.group("replicate"));
    ddp::FullyShardedDataParallel<WrappedNet> model(make(), mesh.group("shard"),
                                                    ddp::FSDPOptions().replicate_hook(hook));
    EXPECT_EQ(max_difference(expected, run(model)), 0.0) << "rank " << group->rank();
  }));
}

// A replica of one rank: FSDP switches to no_shard and reduces locally, and
// the hook still averages the replicas (each rank is one here).
TEST(FsdpReplicateHook, AShardGroupOfOneRankStillRunsTheHook) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    ddp::DeviceMesh mesh(group, {2, 1}, {"replicate", "shard"});
    ddp::FullyShardedDataParallel<torch::nn::Sequential> reference(make_seq(), mesh,
                                                                   ddp::FSDPOptions().min_num_params(1));
    const auto expected = train_steps(reference, group->rank(), 3);
    auto hook = std::make_shared<AverageOverReplicas>(mesh.group("replicate"));
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(
        make_seq(), mesh.group("shard"), ddp::FSDPOptions().min_num_params(1).replicate_hook(hook));
    EXPECT_EQ(model.sharding_strategy(), ddp::ShardingStrategy::kNoShard);
    const auto got = train_steps(model, group->rank(), 3, hook.get());
    EXPECT_EQ(max_difference(expected, got), 0.0) << "rank " << group->rank();
    // Both replicas hold the same weights (without the hook each would
    // have trained on its own rows).
    for (const auto& shard : model.parameters()) {
      const auto both = group->all_gather(shard.detach());
      EXPECT_TRUE(both[0].equal(both[1])) << "the replicas differ";
    }
  }));
}

// Rank 1's hook fails its future for the second unit launched (unit '1-2': the
// units run backward from '4'), after its all-reduce: rank 1's backward
// fails naming the unit and the hook's cause; the other ranks complete.
TEST(FsdpReplicateHook, AFailedHookFailsTheBackwardNamingTheUnitOnItsRankOnly) {
  RanksOptions options;
  options.timeout = std::chrono::seconds(60);
  options.collective_timeout_seconds = 10;
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    ddp::DeviceMesh mesh(group, kMesh, {"replicate", "shard"});
    auto hook = std::make_shared<AverageOverReplicas>(mesh.group("replicate"));
    hook->fail_bucket = 1;
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(
        make_seq(), mesh.group("shard"), ddp::FSDPOptions().min_num_params(1).replicate_hook(hook));
    ASSERT_EQ(model.unit_names(), (std::vector<std::string>{"0", "1-2", "3-4"}));
    torch::optim::Adam adam(model.parameters(), 1e-2);
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = batch(step, group->rank());
      adam.zero_grad();
      hook->armed = step == 1 && group->rank() == 1;
      const std::string error =
          error_of([&] { torch::nn::functional::mse_loss(model.forward(x), y).backward(); });
      if (hook->armed) {
        EXPECT_NE(error.find("FSDP unit '1-2'"), std::string::npos) << error;
        EXPECT_NE(error.find("the test hook lost its replica"), std::string::npos) << error;
      } else {
        EXPECT_EQ(error, "") << "step " << step;
        adam.step();
      }
      // Every unit still went through the hook, the failed one too.
      EXPECT_EQ(hook->take().size(), 3u);
    }
  }, options));
}

// Rank 0's reduce-scatter of unit '1-2' fails: its backward fails naming the
// unit, and its replicate hook still runs for that unit, on zeros, so rank 2
// (the other replica of its shard) completes. Were that hook skipped, the
// next unit's all-reduce (of another size) would meet rank 2's, and rank 2
// would fail on the mismatch.
TEST(FsdpReplicateHook, AFailedShardReductionStillRunsTheHookOnZeros) {
  RanksOptions options;
  options.timeout = std::chrono::seconds(60);
  options.collective_timeout_seconds = 10;
  expect_all_succeeded(run_on_ranks(4, [](const Group& group) {
    ddp::DeviceMesh mesh(group, kMesh, {"replicate", "shard"});
    auto hook = std::make_shared<AverageOverReplicas>(mesh.group("replicate"));
    auto shard_hook = std::make_shared<FailingShardReduce>();
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(
        make_seq(), mesh.group("shard"),
        ddp::FSDPOptions().min_num_params(1).comm_hook(shard_hook).replicate_hook(hook));
    shard_hook->armed = group->rank() == 0;
    auto [x, y] = batch(0, group->rank());
    const std::string error = error_of([&] { torch::nn::functional::mse_loss(model.forward(x), y).backward(); });
    const auto seen = hook->take();
    ASSERT_EQ(seen.size(), 3u);
    if (group->rank() == 0) {
      EXPECT_NE(error.find("FSDP unit '1-2'"), std::string::npos) << error;
      EXPECT_NE(error.find("the test's reduce-scatter broke"), std::string::npos) << error;
      EXPECT_TRUE(seen[1].zeros) << "the failed unit's hook ran on something other than zeros";
      EXPECT_EQ(seen[1].index, 1u);
    } else {
      EXPECT_EQ(error, "");
    }
    EXPECT_FALSE(seen[0].zeros);
  }, options));
}

// A mesh whose replicate dimension has two ranks already does what the hook
// would: refused, naming both. One of one rank is no replication: accepted.
TEST(FsdpReplicateHook, AMeshThatAlreadyReplicatesIsRefused) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    auto hook = std::make_shared<AverageOverReplicas>(group);
    ddp::DeviceMesh replicating(group, {2, 1}, {"replicate", "shard"});
    const std::string error = error_of([&] {
      ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_seq(), replicating,
                                                                 ddp::FSDPOptions().replicate_hook(hook));
    });
    EXPECT_NE(error.find("FSDPOptions::replicate_hook"), std::string::npos) << error;
    EXPECT_NE(error.find("already replicates across 2 ranks"), std::string::npos) << error;
    EXPECT_NE(error.find("mesh.group(\"shard\")"), std::string::npos) << error;
    ddp::DeviceMesh one_row(group, {1, 2}, {"replicate", "shard"});
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_seq(), one_row,
                                                               ddp::FSDPOptions().replicate_hook(hook));
    EXPECT_EQ(model.sharding_strategy(), ddp::ShardingStrategy::kFullShard);
  }));
}

}  // namespace
