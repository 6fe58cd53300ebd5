// FSDP's gradient reduction on real ranks (support/ranks.h): reduce_dtype
// against DDP's compression hooks, FSDPOptions::comm_hook, and how long a
// unit's full gradient lives.
#include "support/fsdp_nets.h"
#include "support/ranks.h"
#include "support/torch_errors.h"

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/StorageImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace ddp::testing;


// FSDPOptions::reduce_dtype: gradients reduce-scattered (all-reduced under
// NO_SHARD) in float16 or bfloat16 equal DDP's with the matching compression
// hook: the same arithmetic (divide by the world size, cast, sum in the low
// dtype, cast back). SGD keeps the weights a linear image of the gradients,
// so a rounding difference stays as small as it was made.
ddp::StateDict sgd_fsdp(const std::shared_ptr<ddp::ProcessGroup>& group, ddp::ShardingStrategy strategy,
                        std::optional<at::ScalarType> reduce_dtype) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(
      net, group, ddp::FSDPOptions().sharding_strategy(strategy).reduce_dtype(reduce_dtype));
  train_sgd(model, model.parameters(), group);
  for (const auto& shard : model.parameters()) EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
  return model.full_state_dict(/*rank0_only=*/false);
}

class ReduceDtype : public ::testing::TestWithParam<int> {};

// Tolerances. At 2 ranks each element's sum is one rounding of a + b in
// both, so the weights must be bit-identical to DDP's with the hook. At 3
// ranks Gloo's all-reduce and FSDP's ring (or Gloo's all-reduce of a unit's
// buffer, chunked differently from DDP's bucket) associate (a + b) + c
// differently, which can round an element by one unit in the last place of
// the low dtype: the weights may then differ by up to 2 epsilon(dtype) of
// how far training moved them (epsilon: 2^-10 for float16, 2^-7 for
// bfloat16), the same bound that the compression itself must keep to.
TEST_P(ReduceDtype, Fp16AndBf16MatchDdpsCompressionHooks) {
  const int world = GetParam();
  auto ranks = run_on_ranks(world, [world](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    torch::manual_seed(0);
    ddp::StateDict initial = ddp::state_dict(*BranchyNet());
    ddp::StateDict exact = sgd_ddp(group, nullptr);
    const double moved = max_difference(initial, exact);
    EXPECT_GT(moved, 1e-2);
    struct Case {
      at::ScalarType dtype;
      std::shared_ptr<ddp::CommHook> hook;
      double epsilon;
    };
    double fp16_effect = 0;
    for (const Case& c : {Case{at::kHalf, ddp::fp16_compress_hook(), 1.0 / 1024},
                          Case{at::kBFloat16, ddp::bf16_compress_hook(), 1.0 / 128}}) {
      const double tolerance = 2 * c.epsilon * moved;
      ddp::StateDict compressed = sgd_ddp(group, c.hook);
      const double effect = max_difference(exact, compressed);
      EXPECT_GT(effect, 0) << c.dtype << ": the rounding must show";
      EXPECT_LE(effect, tolerance) << c.dtype;
      for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kNoShard}) {
        ddp::StateDict sharded = sgd_fsdp(group, strategy, c.dtype);
        const double difference = max_difference(compressed, sharded);
        if (world == 2) {
          EXPECT_EQ(difference, 0.0) << c.dtype << " " << ddp::to_string(strategy) << " rank " << group->rank();
        } else {
          EXPECT_LE(difference, tolerance) << c.dtype << " " << ddp::to_string(strategy) << " rank " << group->rank();
        }
        EXPECT_GT(max_difference(exact, sharded), 0) << c.dtype << " " << ddp::to_string(strategy);
        std::printf("rank %d %s %s: against the hook %.3g, compression %.3g, tolerance %.3g\n", group->rank(),
                    c10::toString(c.dtype), ddp::to_string(strategy).c_str(), difference, effect, tolerance);
      }
      if (c.dtype == at::kHalf) fp16_effect = effect;
      else EXPECT_GT(effect, fp16_effect) << "bf16 keeps fewer mantissa bits than fp16";
    }
    // The parameters' own dtype: no rounding at all.
    EXPECT_LE(max_difference(exact, sgd_fsdp(group, ddp::ShardingStrategy::kFullShard, at::kFloat)), 1e-6);
    std::printf("rank %d compared reduce dtypes\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared reduce dtypes"), std::string::npos) << r.out;
  // Rank 0's measurements, in this test's output.
  std::istringstream lines(ranks.front().out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("against the hook") != std::string::npos) std::printf("%s\n", line.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Fsdp, ReduceDtype, ::testing::Values(2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

// A CommHook that records each bucket it gets and reduces it as the default
// hook does.
class RecordingHook : public ddp::CommHook {
 public:
  struct Call {
    size_t index;
    bool scatters, is_last;
    int64_t buffer_numel, shard_numel;
    at::ScalarType buffer_dtype, shard_dtype;
  };
  c10::intrusive_ptr<c10::ivalue::Future> run(ddp::ProcessGroup& group, ddp::GradBucket& bucket) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const bool scatters = bucket.scatters();
      calls_.push_back(Call{bucket.index(), scatters, bucket.is_last(), bucket.buffer().numel(),
                            scatters ? bucket.shard().numel() : 0, bucket.buffer().scalar_type(),
                            scatters ? bucket.shard().scalar_type() : at::kFloat});
    }
    return inner_->run(group, bucket);
  }
  std::vector<Call> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(calls_, {});
  }

 private:
  std::shared_ptr<ddp::CommHook> inner_ = ddp::allreduce_hook();
  std::mutex mutex_;
  std::vector<Call> calls_;
};

ddp::StateDict sgd_fsdp_with(const std::shared_ptr<ddp::ProcessGroup>& group, const ddp::FSDPOptions& options) {
  torch::manual_seed(0);
  BranchyNet net;
  ddp::FullyShardedDataParallel<BranchyNet> model(net, group, options);
  train_sgd(model, model.parameters(), group);
  for (const auto& shard : model.parameters()) EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
  return model.full_state_dict(/*rank0_only=*/false);
}

// FSDPOptions::comm_hook: the compression hooks on FSDP's reduce-scatter do
// what reduce_dtype does (divide, cast, sum in the low dtype, cast back), bit
// for bit at 2 ranks. A hook of one's own is called once per unit per
// synchronised backward (none inside no_sync()), in launch order, with the
// shard to scatter into under FULL_SHARD and none under NO_SHARD. A hook and
// a reduce_dtype together are refused.
TEST(FsdpCommHook, Fp16HookOnReduceScatterEqualsReduceDtypeFp16) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    const int world = group->size();
    const auto full_shard = ddp::FSDPOptions().sharding_strategy(ddp::ShardingStrategy::kFullShard);
    ddp::StateDict exact = sgd_fsdp_with(group, full_shard);
    for (const auto& [hook, dtype] : {std::pair{ddp::fp16_compress_hook(), at::kHalf},
                                      std::pair{ddp::bf16_compress_hook(), at::kBFloat16}}) {
      ddp::StateDict hooked = sgd_fsdp_with(group, ddp::FSDPOptions(full_shard).comm_hook(hook));
      ddp::StateDict reduced = sgd_fsdp_with(group, ddp::FSDPOptions(full_shard).reduce_dtype(dtype));
      EXPECT_EQ(max_difference(reduced, hooked), 0.0) << dtype << " rank " << group->rank();
      EXPECT_GT(max_difference(exact, hooked), 0.0) << dtype << ": the compression must show";
    }

    for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kNoShard}) {
      const std::string name = ddp::to_string(strategy);
      auto hook = std::make_shared<RecordingHook>();
      torch::manual_seed(0);
      BranchyNet net;
      ddp::FullyShardedDataParallel<BranchyNet> model(
          net, group, ddp::FSDPOptions().sharding_strategy(strategy).comm_hook(hook));
      const size_t units = model.unit_names().size();
      EXPECT_EQ(units, 3u);
      torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));
      auto expect_one_call_per_unit = [&](const std::string& when) {
        auto calls = hook->take();
        ASSERT_EQ(calls.size(), units) << name << " " << when;
        for (size_t i = 0; i < calls.size(); ++i) {
          const auto& call = calls[i];
          EXPECT_EQ(call.index, i) << name << " " << when;
          EXPECT_EQ(call.is_last, i + 1 == calls.size()) << name << " " << when << " bucket " << i;
          EXPECT_EQ(call.buffer_dtype, at::kFloat) << name;
          EXPECT_EQ(call.scatters, strategy != ddp::ShardingStrategy::kNoShard) << name << " bucket " << i;
          if (call.scatters) {
            EXPECT_EQ(call.shard_numel * world, call.buffer_numel) << name << " bucket " << i;
            EXPECT_EQ(call.shard_dtype, at::kFloat) << name;
          }
        }
      };
      for (int64_t step = 0; step < kSteps; ++step) {
        auto [x, y] = batch(step, group->rank(), group->size());
        optimizer.zero_grad();
        torch::nn::functional::mse_loss(model.forward(x), y).backward();
        expect_one_call_per_unit("step " + std::to_string(step));
        optimizer.step();
      }
      // The default hook's arithmetic is the engine's own.
      EXPECT_EQ(max_difference(sgd_fsdp_with(group, ddp::FSDPOptions().sharding_strategy(strategy)),
                               model.full_state_dict(/*rank0_only=*/false)),
                0.0)
          << name;
      auto [x, y] = batch(0, group->rank(), group->size());
      {
        auto guard = model.no_sync();
        torch::nn::functional::mse_loss(model.forward(x), y).backward();
      }
      EXPECT_TRUE(hook->take().empty()) << name << ": no_sync() backward called the hook";
      torch::nn::functional::mse_loss(model.forward(x), y).backward();
      expect_one_call_per_unit("after no_sync");
    }

    std::string message = error_of([&] {
      torch::manual_seed(0);
      ddp::FullyShardedDataParallel<BranchyNet> model(
          BranchyNet(), group, ddp::FSDPOptions().comm_hook(ddp::fp16_compress_hook()).reduce_dtype(at::kHalf));
    });
    EXPECT_NE(message, "") << "comm_hook with reduce_dtype accepted";
    EXPECT_NE(message.find("reduce_dtype"), std::string::npos) << message;
    EXPECT_THROW(
        {
          torch::manual_seed(0);
          ddp::FullyShardedDataParallel<BranchyNet> model(
              BranchyNet(), group,
              ddp::FSDPOptions().comm_hook(ddp::bf16_compress_hook()).reduce_dtype(at::kBFloat16));
        },
        ddp::Error);
    std::printf("rank %d compared comm hooks\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("compared comm hooks"), std::string::npos) << r.out;
}

// A unit's full flat gradient lives only until its reduce-scatter is done
// (issue 34 item 18): a hook watches each unit's buffer through a weak
// reference to its storage and, when unit k launches, every unit launched
// before k - 1 must have given its buffer back (k - 1's reduce-scatter may
// still be running; FSDP waits for it before flattening k, so at most two
// exist at once however far backward runs ahead of communication). Keeping
// them until backward ends held one full gradient per unit. The weights
// trained meanwhile equal those of the default hook, bit for bit.
class BufferWatchingHook : public ddp::CommHook {
 public:
  explicit BufferWatchingHook(std::shared_ptr<ddp::CommHook> inner) : inner_(std::move(inner)) {}
  c10::intrusive_ptr<c10::ivalue::Future> run(ddp::ProcessGroup& group, ddp::GradBucket& bucket) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t j = 0; j + 1 < buffers_.size(); ++j) {
      if (!buffers_[j].expired()) {
        alive_too_long_.push_back(std::to_string(j) + " at " + std::to_string(buffers_.size()));
      }
    }
    buffers_.push_back(c10::weak_intrusive_ptr<c10::StorageImpl>(bucket.buffer().storage().getWeakStorageImpl()));
    return inner_->run(group, bucket);
  }
  // Buffers still alive after backward, and "j at k" for each buffer j
  // still alive when unit k launched; then starts over.
  std::pair<size_t, std::vector<std::string>> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t alive = 0;
    for (const auto& buffer : buffers_) alive += buffer.expired() ? 0 : 1;
    buffers_.clear();
    return {alive, std::exchange(alive_too_long_, {})};
  }

 private:
  std::shared_ptr<ddp::CommHook> inner_;
  std::mutex mutex_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> buffers_;
  std::vector<std::string> alive_too_long_;
};

TEST(FsdpGradientMemory, EachUnitsFullGradientIsFreedOnceItsReduceScatterIsDone) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    constexpr int64_t kLayers = 8, kWidth = 64;
    for (auto strategy : {ddp::ShardingStrategy::kFullShard, ddp::ShardingStrategy::kShardGradOp}) {
      for (auto [inner, hook_name] : {std::pair{ddp::allreduce_hook(), "default hook"},
                                      std::pair{ddp::bf16_compress_hook(), "bf16 hook"}}) {
        const std::string what = ddp::to_string(strategy) + ", " + hook_name;
        auto watcher = std::make_shared<BufferWatchingHook>(inner);
        auto train = [&](const std::shared_ptr<ddp::CommHook>& hook) {
          torch::manual_seed(0);
          torch::nn::Sequential net;
          for (int64_t l = 0; l < kLayers; ++l) net->push_back(torch::nn::Linear(kWidth, kWidth));
          ddp::FullyShardedDataParallel<torch::nn::Sequential> model(
              net, group, ddp::FSDPOptions().min_num_params(1).sharding_strategy(strategy).comm_hook(hook));
          EXPECT_EQ(model.unit_names().size(), static_cast<size_t>(kLayers));
          torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
          for (int64_t step = 0; step < 3; ++step) {
            at::Tensor x = at::randn({4, kWidth}, at::make_generator<at::CPUGeneratorImpl>(10 * step + group->rank()));
            optimizer.zero_grad();
            model.forward(x).square().mean().backward();
            if (hook == watcher) {
              auto [alive, too_long] = watcher->take();
              EXPECT_EQ(alive, 0u) << what << ": full gradients left after backward, step " << step;
              std::string list;
              for (const auto& entry : too_long) list += " " + entry;
              EXPECT_TRUE(too_long.empty()) << what << ", step " << step << ": unit buffers alive after the "
                                            << "next unit launched (buffer at launch):" << list;
            }
            optimizer.step();
          }
          return model.full_state_dict(/*rank0_only=*/false);
        };
        EXPECT_EQ(max_difference(train(inner), train(watcher)), 0.0) << what;
      }
    }
    std::printf("rank %d watched the full gradients\n", group->rank());
  });
  expect_all_succeeded(ranks);
  for (const auto& r : ranks) EXPECT_NE(r.out.find("watched the full gradients"), std::string::npos) << r.out;
}

// The wait for the previous unit's reduce-scatter (above) is bounded as
// every collective is: a peer that stops after the forward makes the other
// rank's backward fail within the collective timeout, naming the unit whose
// reduction failed, instead of hanging there. SHARD_GRAD_OP, so that
// backward gathers nothing and a reduce-scatter is the first to miss the peer.
TEST(FsdpGradientMemory, APeerThatStopsBeforeBackwardFailsItWithinTheTimeout) {
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(90);
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        at::set_num_threads(1);
        auto pids = group->all_gather(at::full({1}, static_cast<int64_t>(::getpid()), at::kLong));
        torch::manual_seed(0);
        torch::nn::Sequential net;
        for (int i = 0; i < 6; ++i) net->push_back(torch::nn::Linear(32, 32));
        ddp::FullyShardedDataParallel<torch::nn::Sequential> model(
            net, group,
            ddp::FSDPOptions().min_num_params(1).sharding_strategy(ddp::ShardingStrategy::kShardGradOp));
        at::Tensor loss = model.forward(at::ones({2, 32})).square().mean();
        group->barrier();
        if (group->rank() == 1) std::raise(SIGSTOP);
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([&] { loss.backward(); });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_NE(error.find("reducing the gradients of FSDP unit"), std::string::npos) << error;
        EXPECT_LT(seconds, 30) << error;
        std::printf("backward failed after %.1f s: %s\n", seconds, error.c_str());
        ::kill(static_cast<pid_t>(pids[1].item<int64_t>()), SIGKILL);
        std::fflush(nullptr);
        std::_Exit(::testing::Test::HasFailure() ? 1 : 0);  // no shutdown with a dead peer
      },
      options);
  EXPECT_EQ(ranks[0].exit_code, 0) << describe_ranks(ranks);
  EXPECT_FALSE(ranks[0].timed_out) << describe_ranks(ranks);
  EXPECT_EQ(ranks[1].term_signal, SIGKILL) << describe_ranks(ranks);
  const size_t line = ranks[0].out.find("backward failed after");
  if (line != std::string::npos) std::printf("rank 0: %s\n", ranks[0].out.substr(line, 400).c_str());
}

}  // namespace
