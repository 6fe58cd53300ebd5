// DDP's bucket sizes (src/engine/bucket_sizing.h): PyTorch's first-bucket rule,
// the cap fitted to the link as a pure function, and, on 2 real ranks, the
// fitted rebuild (the same on every rank, following the measured link), the
// explicit cap that is never overridden, and gradients that still equal one
// process's over the whole batch.
#include "support/ranks.h"

#include "engine/bucket_assignment.h"
#include "engine/bucket_sizing.h"

#include <ddp/distributed_data_parallel.h>
#include <ddp/error.h>

#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace {

using ddp::detail::BucketTensorInfo;
using ddp::detail::LinkMeasurement;

constexpr size_t kMiB = 1024 * 1024;

BucketTensorInfo floats(int64_t numel) { return {numel, c10::kFloat, c10::Device(c10::kCPU)}; }

// A transformer-like gradient list: 40 tensors of 1 MiB (the layers) and one
// of 4 MiB (the embedding, ready last), visited in reverse registration order.
struct Gradients {
  std::vector<BucketTensorInfo> params;
  std::vector<size_t> visit;
  size_t bytes = 0;
};
Gradients layered(int layers, int64_t layer_numel, int64_t embedding_numel) {
  Gradients g;
  g.params.push_back(floats(embedding_numel));
  for (int i = 0; i < layers; ++i) g.params.push_back(floats(layer_numel));
  for (size_t k = g.params.size(); k-- > 0;) g.visit.push_back(k);
  for (const auto& p : g.params) g.bytes += static_cast<size_t>(p.numel) * 4;
  return g;
}

size_t buckets_with(const Gradients& g, size_t cap) {
  return ddp::detail::compute_bucket_assignment(g.params, g.visit, kMiB, cap).size();
}

// 1 Gbit/s: a 4 MB all-reduce of 2 ranks takes about 34 ms, 0.5 ms of it latency.
const LinkMeasurement kSlowLink{0.0005, 1.0 / 117e6, 0.100};

TEST(BucketSizing, CapsFollowPyTorchsFirstBucketRule) {
  auto unset = ddp::detail::bucket_caps_of(std::nullopt, std::nullopt);
  EXPECT_EQ(unset.first_bytes, kMiB);
  EXPECT_EQ(unset.bytes, 25 * kMiB);
  EXPECT_TRUE(unset.fit_to_link);

  // PyTorch: an explicit bucket_cap_mb is also the first bucket's cap.
  auto pinned = ddp::detail::bucket_caps_of(25.0, std::nullopt);
  EXPECT_EQ(pinned.first_bytes, 25 * kMiB);
  EXPECT_EQ(pinned.bytes, 25 * kMiB);
  EXPECT_FALSE(pinned.fit_to_link);

  auto both = ddp::detail::bucket_caps_of(5.0, 0.5);
  EXPECT_EQ(both.first_bytes, kMiB / 2);
  EXPECT_EQ(both.bytes, 5 * kMiB);
  EXPECT_FALSE(both.fit_to_link);

  auto first_only = ddp::detail::bucket_caps_of(std::nullopt, 2.0);
  EXPECT_EQ(first_only.first_bytes, 2 * kMiB);
  EXPECT_TRUE(first_only.fit_to_link);

  EXPECT_THROW(ddp::detail::bucket_caps_of(0.0, std::nullopt), c10::Error);
  EXPECT_THROW(ddp::detail::bucket_caps_of(std::nullopt, -1.0), c10::Error);
}

TEST(BucketSizing, ExposedCommunicationIsTheTailAfterBackward) {
  // Two tensors of 100 bytes, ready at 5 s and 10 s; 1 s latency, 0.01 s/byte.
  std::vector<BucketTensorInfo> params = {floats(25), floats(25)};
  std::vector<size_t> visit = {1, 0};
  LinkMeasurement link{1.0, 0.01, 10.0};
  // Two buckets: the first runs 5..7, the second 10..12, plus one launch.
  EXPECT_DOUBLE_EQ(ddp::detail::exposed_communication_s(params, visit, {{1}, {0}}, link), 2.0 + 1.0);
  // One bucket: 10..13.
  EXPECT_DOUBLE_EQ(ddp::detail::exposed_communication_s(params, visit, {{1, 0}}, link), 3.0);
  // A link slower than backward: the second waits for the first (5..11, then 11..17).
  LinkMeasurement slow{1.0, 0.05, 10.0};
  EXPECT_DOUBLE_EQ(ddp::detail::exposed_communication_s(params, visit, {{1}, {0}}, slow), 7.0 + 1.0);
}

TEST(BucketSizing, SlowLinkWithLongBackwardGetsAFewMiB) {
  auto g = layered(40, static_cast<int64_t>(kMiB / 4), static_cast<int64_t>(kMiB));  // 44 MiB
  size_t cap = ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, kSlowLink);
  EXPECT_GE(cap, 2 * kMiB);
  EXPECT_LE(cap, 8 * kMiB);
  EXPECT_GE(buckets_with(g, cap), 6u);
  // And it is the model's best: 25 MiB (PyTorch) exposes more.
  auto exposed = [&](size_t c) {
    return ddp::detail::exposed_communication_s(
        g.params, g.visit, ddp::detail::compute_bucket_assignment(g.params, g.visit, kMiB, c), kSlowLink);
  };
  EXPECT_LT(exposed(cap), exposed(25 * kMiB) * 0.9);
}

TEST(BucketSizing, LatencyDominatedLinkGetsOneBucketAfterTheFirst) {
  auto g = layered(40, static_cast<int64_t>(kMiB / 4), static_cast<int64_t>(kMiB));
  // 5 ms per all-reduce, 10 GB/s: latency dominates any bucket under 50 MB.
  LinkMeasurement latency_bound{0.005, 1e-10, 0.100};
  size_t cap = ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, latency_bound);
  EXPECT_GE(cap, g.bytes);
  EXPECT_EQ(buckets_with(g, cap), 2u);
}

TEST(BucketSizing, LocalLinkThatBusiesTheCpuGetsFewBuckets) {
  auto g = layered(40, static_cast<int64_t>(kMiB / 4), static_cast<int64_t>(kMiB));
  // Gloo over loopback on one host: 150 us, about 1.5 GB/s, the CPU busy
  // copying and summing for most of it.
  LinkMeasurement loopback{0.00015, 1.0 / 1.5e9, 0.100, 0.9};
  EXPECT_LE(buckets_with(g, ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, loopback)), 3u);
  // Shared memory: 5 us, 5 GB/s, all of it on the CPU.
  LinkMeasurement shared_memory{0.000005, 1.0 / 5e9, 0.100, 1.0};
  EXPECT_LE(buckets_with(g, ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, shared_memory)), 3u);
  // The same loopback figures with a CPU to spare would be split.
  loopback.cpu_share = 0;
  EXPECT_GE(buckets_with(g, ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, loopback)), 6u);
}

TEST(BucketSizing, NothingToHideBehindGetsOneBucketAfterTheFirst) {
  auto g = layered(40, static_cast<int64_t>(kMiB / 4), static_cast<int64_t>(kMiB));
  LinkMeasurement no_overlap = kSlowLink;
  no_overlap.backward_s = 0;  // overlap_with_backward(false)
  size_t cap = ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, no_overlap);
  EXPECT_EQ(buckets_with(g, cap), 2u);
}

TEST(BucketSizing, ModelUnderTheFirstBucketStaysOneBucket) {
  auto g = layered(4, 10000, 20000);  // 240 KB
  size_t cap = ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, kSlowLink);
  EXPECT_EQ(buckets_with(g, cap), 1u);
}

TEST(BucketSizing, OnlyModelsBeyondTheFirstBucketNeedTheLinkMeasured) {
  auto small = layered(4, 10000, 20000);  // 240 KB: one bucket whatever the cap
  EXPECT_FALSE(ddp::detail::bucket_cap_matters(small.params, small.visit, kMiB));
  auto large = layered(40, static_cast<int64_t>(kMiB / 4), static_cast<int64_t>(kMiB));
  EXPECT_TRUE(ddp::detail::bucket_cap_matters(large.params, large.visit, kMiB));
  // Beyond 1 MiB but within one bucket after the first, whatever the cap: 2 buckets always.
  auto two = layered(1, static_cast<int64_t>(kMiB / 4), 1000);
  EXPECT_FALSE(ddp::detail::bucket_cap_matters(two.params, two.visit, kMiB / 2));
}

TEST(BucketSizing, UnusableMeasurementKeepsPyTorchsCap) {
  auto g = layered(4, 10000, 20000);
  EXPECT_EQ(ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, {0.001, 0.0, 0.1}), 25 * kMiB);
  EXPECT_EQ(ddp::detail::fit_bucket_cap_bytes(g.params, g.visit, kMiB, {NAN, 1e-9, 0.1}), 25 * kMiB);
  EXPECT_EQ(ddp::detail::fit_bucket_cap_bytes({}, {}, kMiB, kSlowLink), 25 * kMiB);
}

// ---- 2 real ranks -------------------------------------------------------

// 10 layers of 512 x 512 (about 1 MiB each): 10.5 MB of gradients, so the
// first iteration's buckets (1 MiB, then 25 MiB) are 2.
torch::nn::Sequential make_net() {
  torch::manual_seed(7);
  torch::nn::Sequential net;
  for (int i = 0; i < 10; ++i) {
    net->push_back(torch::nn::Linear(512, 512));
    if (i < 9) net->push_back(torch::nn::Tanh());
  }
  return net;
}

std::vector<BucketTensorInfo> infos_of(const std::vector<at::Tensor>& params) {
  std::vector<BucketTensorInfo> infos;
  for (const auto& p : params) infos.push_back({p.numel(), p.scalar_type(), p.device()});
  return infos;
}

// Each rank's injected figures: rank 0 sees a slower link, rank 1 a longer
// backward. Alone, each would fit a different cap; the ranks must agree on
// the maxima.
LinkMeasurement injected_for(int rank) {
  return rank == 0 ? LinkMeasurement{0.002, 1.0 / 40e6, 0.010} : LinkMeasurement{0.0002, 1.0 / 400e6, 0.300};
}
LinkMeasurement agreed() {
  LinkMeasurement a = injected_for(0), b = injected_for(1);
  return {std::max(a.latency_s, b.latency_s), std::max(a.seconds_per_byte, b.seconds_per_byte),
          std::max(a.backward_s, b.backward_s)};
}

void train_steps(ddp::DistributedDataParallel<torch::nn::Sequential>& model, int steps, int64_t batch) {
  for (int s = 0; s < steps; ++s) {
    at::Tensor x = at::randn({batch, 512});
    auto loss = model.forward(x).pow(2).mean();
    loss.backward();
  }
}

// Rank 0's assignment, flattened with -1 between buckets, broadcast to all.
std::vector<int64_t> flatten(const std::vector<std::vector<size_t>>& buckets) {
  std::vector<int64_t> flat;
  for (const auto& b : buckets) {
    for (size_t i : b) flat.push_back(static_cast<int64_t>(i));
    flat.push_back(-1);
  }
  return flat;
}
std::vector<int64_t> rank0s(ddp::ProcessGroup& group, std::vector<int64_t> mine) {
  at::Tensor size = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  group.broadcast(size, 0);
  at::Tensor data = at::empty({size.item<int64_t>()}, at::kLong);
  if (group.rank() == 0) std::copy(mine.begin(), mine.end(), data.data_ptr<int64_t>());
  group.broadcast(data, 0);
  return std::vector<int64_t>(data.data_ptr<int64_t>(), data.data_ptr<int64_t>() + data.numel());
}

TEST(BucketSizingRanks, FittedBucketsAreTheSameOnEveryRankAndFollowTheLink) {
  auto ranks = ddp::testing::run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::detail::set_link_measurement_for_testing(injected_for(group->rank()));
    ddp::DistributedDataParallel<torch::nn::Sequential> model(make_net(), group);
    const auto first_iteration = model.bucket_assignment();
    EXPECT_EQ(first_iteration.size(), 2u);  // 1 MiB, then the rest under 25 MiB
    EXPECT_DOUBLE_EQ(model.bucket_cap_mb(), 25.0);
    train_steps(model, 2, 8);
    ASSERT_TRUE(model.buckets_rebuilt());
    const auto rebuilt = model.bucket_assignment();

    // The rebuild visited the parameters in the order its buckets list them
    // (one dtype, one device); the cap is the rule's for the agreed figures.
    std::vector<size_t> visit;
    for (const auto& b : rebuilt) visit.insert(visit.end(), b.begin(), b.end());
    const auto infos = infos_of(model.parameters());
    const size_t fitted = ddp::detail::fit_bucket_cap_bytes(infos, visit, kMiB, agreed());
    EXPECT_DOUBLE_EQ(model.bucket_cap_mb(), static_cast<double>(fitted) / kMiB);
    EXPECT_EQ(rebuilt, ddp::detail::compute_bucket_assignment(infos, visit, kMiB, fitted));
    EXPECT_GT(rebuilt.size(), first_iteration.size()) << "the slow link should split the buckets";
    // Alone, the two ranks' figures give different caps: only agreement makes them equal.
    EXPECT_NE(ddp::detail::fit_bucket_cap_bytes(infos, visit, kMiB, injected_for(0)),
              ddp::detail::fit_bucket_cap_bytes(infos, visit, kMiB, injected_for(1)));
    EXPECT_EQ(rank0s(*group, flatten(rebuilt)), flatten(rebuilt)) << "rank " << group->rank() << " differs";
    ddp::detail::set_link_measurement_for_testing(std::nullopt);
  });
  ddp::testing::expect_all_succeeded(ranks);
}

TEST(BucketSizingRanks, WithoutOverlapNothingHidesSoBucketsStayFew) {
  auto ranks = ddp::testing::run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    // The same slow link and long backward that split the buckets above.
    ddp::detail::set_link_measurement_for_testing(injected_for(group->rank()));
    ddp::DistributedDataParallel<torch::nn::Sequential> model(make_net(), group,
                                                              ddp::DDPOptions().overlap_with_backward(false));
    train_steps(model, 2, 8);
    ASSERT_TRUE(model.buckets_rebuilt());
    std::vector<size_t> visit;
    for (const auto& b : model.bucket_assignment()) visit.insert(visit.end(), b.begin(), b.end());
    LinkMeasurement no_overlap = agreed();
    no_overlap.backward_s = 0;
    const auto infos = infos_of(model.parameters());
    EXPECT_DOUBLE_EQ(model.bucket_cap_mb(),
                     static_cast<double>(ddp::detail::fit_bucket_cap_bytes(infos, visit, kMiB, no_overlap)) / kMiB);
    EXPECT_EQ(model.bucket_assignment().size(), 2u) << "1 MiB, then the rest in one bucket";
    ddp::detail::set_link_measurement_for_testing(std::nullopt);
  });
  ddp::testing::expect_all_succeeded(ranks);
}

TEST(BucketSizingRanks, MeasuredLinkGivesTheSameBucketsOnEveryRank) {
  auto ranks = ddp::testing::run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::DistributedDataParallel<torch::nn::Sequential> model(make_net(), group);
    train_steps(model, 2, 8);
    ASSERT_TRUE(model.buckets_rebuilt());
    const double cap = model.bucket_cap_mb();
    EXPECT_GE(cap, 1.0);
    EXPECT_LE(cap, 256.0);
    at::Tensor caps = at::full({1}, cap, at::kDouble);
    group->broadcast(caps, 0);
    EXPECT_DOUBLE_EQ(caps.item<double>(), cap);
    EXPECT_EQ(rank0s(*group, flatten(model.bucket_assignment())), flatten(model.bucket_assignment()));
    if (group->rank() == 0) std::cout << "measured loopback: bucket_cap_mb " << cap << "\n";
  });
  ddp::testing::expect_all_succeeded(ranks);
}

TEST(BucketSizingRanks, AnExplicitCapIsNeverOverriddenAndSetsTheFirstBucket) {
  auto ranks = ddp::testing::run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::detail::set_link_measurement_for_testing(injected_for(group->rank()));
    // PyTorch's fixed 25 MB: the first bucket follows it, so 10.5 MB is one bucket.
    ddp::DistributedDataParallel<torch::nn::Sequential> pinned(make_net(), group,
                                                               ddp::DDPOptions().bucket_cap_mb(25));
    EXPECT_EQ(pinned.bucket_assignment().size(), 1u);
    train_steps(pinned, 2, 8);
    EXPECT_TRUE(pinned.buckets_rebuilt());
    EXPECT_DOUBLE_EQ(pinned.bucket_cap_mb(), 25.0);
    EXPECT_EQ(pinned.bucket_assignment().size(), 1u);

    // A first bucket set as well is used as given.
    ddp::DistributedDataParallel<torch::nn::Sequential> both(
        make_net(), group, ddp::DDPOptions().bucket_cap_mb(25).first_bucket_cap_mb(1));
    EXPECT_EQ(both.bucket_assignment().size(), 2u);
    train_steps(both, 2, 8);
    EXPECT_DOUBLE_EQ(both.bucket_cap_mb(), 25.0);
    EXPECT_EQ(both.bucket_assignment().size(), 2u);

    // 3 MiB for all: every bucket (the first too) closes at 3 MiB.
    ddp::DistributedDataParallel<torch::nn::Sequential> small(make_net(), group,
                                                              ddp::DDPOptions().bucket_cap_mb(3));
    EXPECT_EQ(small.bucket_assignment(),
              ddp::detail::compute_bucket_assignment(infos_of(small.parameters()), 3 * kMiB, 3 * kMiB));
    EXPECT_EQ(small.bucket_assignment().size(), 4u);
    ddp::detail::set_link_measurement_for_testing(std::nullopt);
  });
  ddp::testing::expect_all_succeeded(ranks);
}

TEST(BucketSizingRanks, GradientsEqualOneProcessOverTheWholeBatchAcrossTheRebuild) {
  auto ranks = ddp::testing::run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::detail::set_link_measurement_for_testing(injected_for(group->rank()));
    const int64_t b = 6;
    auto reference = make_net();
    ddp::DistributedDataParallel<torch::nn::Sequential> model(make_net(), group);
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05));
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05));
    const auto first_iteration = model.bucket_assignment();
    for (int step = 0; step < 4; ++step) {
      at::manual_seed(100 + step);  // the same whole batch on every rank
      at::Tensor x = at::randn({2 * b, 512});
      at::Tensor y = at::randn({2 * b, 512});
      ref_opt.zero_grad();
      torch::nn::functional::mse_loss(reference->forward(x), y).backward();
      opt.zero_grad();
      const int64_t from = group->rank() * b;
      torch::nn::functional::mse_loss(model.forward(x.slice(0, from, from + b)), y.slice(0, from, from + b))
          .backward();
      auto ref_params = reference->parameters();
      auto params = model.parameters();
      ASSERT_EQ(ref_params.size(), params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(params[i].grad(), ref_params[i].grad(), 1e-5, 1e-6))
            << "step " << step << " parameter " << i << " max diff "
            << (params[i].grad() - ref_params[i].grad()).abs().max().item<double>();
      }
      ref_opt.step();
      opt.step();
    }
    EXPECT_TRUE(model.buckets_rebuilt());
    EXPECT_NE(model.bucket_assignment(), first_iteration) << "the rebuild should have changed the buckets";
    ddp::detail::set_link_measurement_for_testing(std::nullopt);
  });
  ddp::testing::expect_all_succeeded(ranks);
}

}  // namespace
