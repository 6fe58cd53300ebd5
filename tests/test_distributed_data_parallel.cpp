// DistributedDataParallel across real processes (support/ranks.h), each
// rank's code and its assertions together: N ranks against one process with
// N times the batch under every engine option, no_sync(), unused parameters,
// buffers, communication hooks and the errors for mismatched replicas.

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


// The engine's options, so one scenario covers every combination. A cap of
// 0.0003 MB gives each of Mlp's layers its own bucket.
struct Engine {
  double bucket_cap_mb = 25;
  bool bucket_view = false;
  bool find_unused = false;
  bool overlap = true;
  bool rebuild = true;
  std::string hook = "allreduce";

  ddp::DDPOptions options() const {
    auto o = ddp::DDPOptions()
                 .bucket_cap_mb(bucket_cap_mb)
                 .first_bucket_cap_mb(std::min(bucket_cap_mb, 1.0))
                 .gradient_as_bucket_view(bucket_view)
                 .find_unused_parameters(find_unused)
                 .overlap_with_backward(overlap)
                 .rebuild_buckets(rebuild);
    if (hook == "fp16") o.comm_hook(ddp::fp16_compress_hook());
    if (hook == "bf16") o.comm_hook(ddp::bf16_compress_hook());
    return o;
  }
};

struct Equivalence {
  int64_t steps = 8;
  int64_t batch = 4;
  int64_t dataset = 61;
  Engine engine;
  std::optional<size_t> buckets;  // the bucket count expected after training
};

// N ranks with per-rank batch b against one process with batch N*b over the
// same samples in the same order, from rank 0's initial weights.
void expect_equivalence(const Group& group, const Equivalence& c, const std::string& label = "") {
  SCOPED_TRACE(label);
  const int world = group->size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1234);
  at::Tensor features = at::randn({c.dataset, 10}, generator);
  at::Tensor labels = at::randint(0, 4, {c.dataset}, generator, at::kLong);

  // Different initial weights per rank: DDP must replace them with rank 0's.
  torch::manual_seed(100 + group->rank());
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, c.engine.options());
  at::Tensor initial = flatten_parameters(*model).clone();
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-3));
  ddp::DistributedSampler sampler(c.dataset, ddp::SamplerOptions(world, group->rank()).seed(7));
  int64_t done = 0;
  for (int64_t epoch = 0; done < c.steps; ++epoch) {
    sampler.set_epoch(epoch);
    for (const auto& b : ddp::make_batches(sampler.indices(), c.batch)) {
      if (done == c.steps) break;
      at::Tensor idx = at::tensor(b, at::kLong);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                           labels.index_select(0, idx))
          .backward();
      optimizer.step();
      ++done;
    }
  }
  const auto& reducer = ddp_model.reducer();
  if (c.buckets) EXPECT_EQ(reducer.bucket_assignment().size(), *c.buckets);
  EXPECT_EQ(reducer.buckets_rebuilt(), c.engine.rebuild);
  if (c.engine.bucket_view) {
    // zero_grad() ran every step, and still every gradient lives in its bucket's memory.
    size_t inside = 0;
    for (auto& p : model->parameters()) {
      auto* data = static_cast<const char*>(p.grad().data_ptr());
      for (size_t b = 0; b < reducer.bucket_assignment().size(); ++b) {
        auto* begin = static_cast<const char*>(reducer.bucket_buffer(b).data_ptr());
        if (data >= begin && data < begin + reducer.bucket_buffer(b).nbytes()) ++inside;
      }
    }
    EXPECT_EQ(inside, model->parameters().size());
  }
  at::Tensor mine = flatten_parameters(*model);
  expect_replicas_identical(group, mine, label);

  if (group->rank() == 0) {
    // Batches of world*b made of the ranks' batches side by side.
    Mlp reference;
    load_flat_parameters(*reference, initial);
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-3));
    int64_t reference_done = 0;
    for (int64_t epoch = 0; reference_done < c.steps; ++epoch) {
      std::vector<std::vector<std::vector<int64_t>>> per_rank;
      for (int r = 0; r < world; ++r) {
        per_rank.push_back(ddp::make_batches(
            ddp::distributed_sampler_indices(c.dataset, ddp::SamplerOptions(world, r).seed(7), epoch), c.batch));
      }
      for (size_t k = 0; k < per_rank[0].size() && reference_done < c.steps; ++k) {
        std::vector<int64_t> joint;
        for (int r = 0; r < world; ++r) joint.insert(joint.end(), per_rank[r][k].begin(), per_rank[r][k].end());
        at::Tensor idx = at::tensor(joint, at::kLong);
        reference_optimizer.zero_grad();
        torch::nn::functional::cross_entropy(reference->forward(features.index_select(0, idx)),
                                             labels.index_select(0, idx))
            .backward();
        reference_optimizer.step();
        ++reference_done;
      }
    }
    EXPECT_LE((flatten_parameters(*reference) - mine).abs().max().item<double>(), 1e-6);
    EXPECT_GE((mine - initial).abs().max().item<double>(), 1e-4) << "training did not move the weights";
  }
  group->barrier();
}

TEST(DistributedDataParallel, TwoRanksMatchOneProcessWithDoubleBatch) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    Equivalence c;
    c.steps = 10;
    c.buckets = 1;
    expect_equivalence(group, c);
  }));
}

// Each layer in its own bucket: all-reduces start while backward still
// computes earlier layers.
TEST(DistributedDataParallel, ManySmallBucketsGiveTheSameResult) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    Equivalence c;
    c.steps = 10;
    c.engine.bucket_cap_mb = 0.0003;
    c.buckets = 3;
    expect_equivalence(group, c);
  }));
}

TEST(DistributedDataParallel, ThreeRanksWithUnevenData) {
  expect_all_succeeded(run_on_ranks(3, [](const Group& group) {
    Equivalence c;
    c.batch = 3;
    c.dataset = 50;
    expect_equivalence(group, c);
  }));
}

TEST(DistributedDataParallel, EveryEngineOptionKeepsTheEquivalence) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    auto engine = [](auto&& set) {
      Equivalence c;
      set(c.engine);
      return c;
    };
    const std::vector<std::pair<std::string, Equivalence>> cases = {
        {"gradient_as_bucket_view", engine([](Engine& e) { e.bucket_view = true; })},
        {"gradient_as_bucket_view, 3 buckets", engine([](Engine& e) { e.bucket_view = true, e.bucket_cap_mb = 0.0003; })},
        {"find_unused_parameters with every parameter used", engine([](Engine& e) { e.find_unused = true; })},
        {"all-reduce after backward", engine([](Engine& e) { e.overlap = false; })},
        {"no bucket rebuild", engine([](Engine& e) { e.rebuild = false; })},
        {"3 buckets, no rebuild", engine([](Engine& e) { e.bucket_cap_mb = 0.0003, e.rebuild = false; })},
    };
    for (const auto& [name, c] : cases) expect_equivalence(group, c, name);
  }));
}

TEST(DistributedDataParallel, BucketViewGradientsLiveInTheBuckets) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    Equivalence c;
    c.engine.bucket_view = true;
    c.engine.bucket_cap_mb = 0.0003;
    c.buckets = 3;
    expect_equivalence(group, c);  // checks that all 6 gradients lie in bucket memory
  }));
}

TEST(DistributedDataParallel, BucketsAreRebuiltOnceUnlessDisabled) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    Equivalence rebuilt;
    rebuilt.steps = 2;
    expect_equivalence(group, rebuilt, "rebuilt");
    Equivalence kept = rebuilt;
    kept.engine.rebuild = false;
    expect_equivalence(group, kept, "kept");
  }));
}

TEST(DistributedDataParallel, MismatchedModelsFailOnEveryRank) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    Mlp model(group->rank() == 1 ? 5 : 4);
    const std::string error = error_of([&] { ddp::DistributedDataParallel<Mlp> ddp_model(model, group); });
    // The first differing parameter, with both shapes.
    EXPECT_NE(error.find("parameter 'fc3.weight' has shape [4, 32] on rank 0 but [5, 32] on rank 1"),
              std::string::npos)
        << error;
  }));
}

// A program that lets the error escape ends with exit code 1 on every rank,
// with the parameter named on its stderr.
TEST(DistributedDataParallel, BothRanksReportAMismatchWhenLaunchedByHand) {
  auto ranks = run_on_ranks(2, [](const Group& group) {
    Mlp model(group->rank() == 1 ? 5 : 4);
    ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
    ADD_FAILURE() << "no error";
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(ranks[rank].exit_code, 1) << describe_ranks(ranks);
    EXPECT_FALSE(ranks[rank].timed_out) << describe_ranks(ranks);
    EXPECT_NE(ranks[rank].err.find("'fc3.weight'"), std::string::npos) << "rank " << rank << ": "
                                                                       << describe_ranks(ranks);
    EXPECT_EQ(ranks[rank].out.find("no error"), std::string::npos) << describe_ranks(ranks);
  }
}

// A launcher's business: ddprun ends the job once one rank fails.
TEST(DistributedDataParallel, ARankThatThrowsEndsTheJobQuickly) {
  auto r = run_process(under_ddprun(2, "ddp_worker", {"throw", "--rank", "1"}),
                       one_rank({}, std::chrono::seconds(60)));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_LT(r.seconds, 30) << r.describe();
  EXPECT_NE(r.err.find("deliberate failure on rank 1"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r.describe();
}

TEST(DistributedDataParallel, UnusedParametersAreNamed) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    const std::string error = error_of([&] {
      auto model = std::make_shared<torch::nn::Module>();
      auto used = model->register_module("used", torch::nn::Linear(4, 2));
      model->register_module("unused", torch::nn::Linear(4, 2));
      ddp::DistributedDataParallel<std::shared_ptr<torch::nn::Module>> ddp_model(model, group);
      used->forward(at::ones({3, 4})).sum().backward();
    });
    EXPECT_NE(error.find("'unused.weight'"), std::string::npos) << error;
  }));
}

struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(2, 2));
    counter = register_buffer("counter", at::zeros({3}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(x) + counter.sum(); }
  torch::nn::Linear fc{nullptr};
  at::Tensor counter;
};
TORCH_MODULE(WithBuffer);

TEST(DistributedDataParallel, BuffersFollowRankZeroBeforeEachForward) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    WithBuffer model;
    ddp::DistributedDataParallel<WithBuffer> ddp_model(model, group);
    // Ranks drift apart (as BatchNorm statistics would); the next forward
    // brings rank 0's values everywhere.
    model->counter.fill_(static_cast<float>(10 + group->rank()));
    ddp_model.forward(at::ones({1, 2}));
    EXPECT_TRUE(at::equal(model->counter, at::full({3}, 10.0f))) << model->counter;
  }));
}

// k micro-batches under no_sync() plus one synced backward give the
// gradient of one batch k+1 times larger (times k+1, as losses are means).
void expect_no_sync_matches_one_batch(const Group& group, int64_t micro, Engine engine) {
  const int64_t batch = 4;
  const int world = group->size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(99);
  const int64_t rows_per_step = (micro + 1) * batch * world;
  at::Tensor features = at::randn({rows_per_step, 10}, generator);
  at::Tensor labels = at::randint(0, 4, {rows_per_step}, generator, at::kLong);
  torch::manual_seed(5);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, engine.options());
  // Micro-batch m of rank r: rows [(m*world + r)*batch, +batch).
  auto rows = [&](int64_t m, int r) { return at::arange((m * world + r) * batch, (m * world + r + 1) * batch); };
  {
    auto guard = ddp_model.no_sync();
    for (int64_t m = 0; m < micro; ++m) {
      auto idx = rows(m, group->rank());
      torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                           labels.index_select(0, idx))
          .backward();
    }
  }
  // Nothing was communicated yet: local gradients still differ.
  auto local = group->all_gather(model->fc1->weight.grad());
  EXPECT_FALSE(at::equal(local[0], local[1])) << "no_sync() communicated";
  auto idx = rows(micro, group->rank());
  torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)), labels.index_select(0, idx))
      .backward();

  // One process, one batch of every sample, mean loss.
  Mlp reference;
  load_flat_parameters(*reference, flatten_parameters(*model));
  torch::nn::functional::cross_entropy(reference->forward(features), labels).backward();
  auto got = model->parameters();
  auto want = reference->parameters();
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_LE((got[k].grad() / static_cast<double>(micro + 1) - want[k].grad()).abs().max().item<double>(), 1e-6)
        << "parameter " << k;
  }
}

TEST(DistributedDataParallel, NoSyncAccumulatesLocallyThenMatchesOneLargeBatch) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    expect_no_sync_matches_one_batch(group, 3, Engine{});
    Engine view;
    view.bucket_view = true;
    expect_no_sync_matches_one_batch(group, 2, view);
  }));
}

// Parameters used on some ranks only, and one used nowhere.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(4, 4));
    left = register_module("left", torch::nn::Linear(4, 2));
    right = register_module("right", torch::nn::Linear(4, 2));
    never = register_module("never", torch::nn::Linear(4, 2));
  }
  at::Tensor forward(const at::Tensor& x, bool use_right) {
    auto h = trunk(x);
    return use_right ? left(h) + right(h) : left(h);
  }
  torch::nn::Linear trunk{nullptr}, left{nullptr}, right{nullptr}, never{nullptr};
};
TORCH_MODULE(Branchy);

TEST(DistributedDataParallel, FindUnusedParametersHandlesPerRankBranches) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(bucket_view ? "gradient_as_bucket_view" : "copied gradients");
      Engine engine;
      engine.bucket_view = bucket_view;
      torch::manual_seed(3);
      Branchy model;
      ddp::DistributedDataParallel<Branchy> ddp_model(model, group, engine.options().find_unused_parameters(true));
      at::Tensor x = at::full({2, 4}, 1.0 + group->rank());
      // Only rank 0 uses `right`; nobody uses `never`.
      ddp_model.forward(x, group->rank() == 0).sum().backward();
      EXPECT_FALSE(model->never->weight.grad().defined());
      auto right_grads = group->all_gather(model->right->weight.grad());
      EXPECT_TRUE(at::equal(right_grads[0], right_grads[1]));
      if (group->rank() == 0) {
        // Rank 0's local gradient of `right`, halved, is the average.
        Branchy copy;
        load_flat_parameters(*copy, flatten_parameters(*model));
        copy->forward(x, true).sum().backward();
        EXPECT_TRUE(at::allclose(model->right->weight.grad(), copy->right->weight.grad() / group->size()));
      }
      // A second iteration where every rank uses `right` still synchronises.
      ddp_model.forward(x, true).sum().backward();
      expect_replicas_identical(group, model->right->weight.grad(), "second iteration");
    }
  }));
}

// A parameter used only in no_sync() micro-batches is still averaged by the
// next synced step, or the replicas would drift apart.
TEST(DistributedDataParallel, GradientsFromNoSyncStepsAreAveragedEvenIfUnusedLater) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(bucket_view ? "gradient_as_bucket_view" : "copied gradients");
      Engine engine;
      engine.bucket_view = bucket_view;
      torch::manual_seed(3);
      Branchy model;
      ddp::DistributedDataParallel<Branchy> ddp_model(model, group, engine.options().find_unused_parameters(true));
      at::Tensor x = at::full({2, 4}, 1.0 + group->rank());
      {
        auto guard = ddp_model.no_sync();
        ddp_model.forward(x, true).sum().backward();  // uses `right`
      }
      at::Tensor local = model->right->weight.grad().clone();
      ddp_model.forward(x, false).sum().backward();  // does not
      auto all = group->all_gather(model->right->weight.grad());
      auto locals = group->all_gather(local);
      EXPECT_FALSE(at::equal(locals[0], locals[1])) << "the ranks' local gradients must differ to prove anything";
      EXPECT_TRUE(at::equal(all[0], all[1]));
      EXPECT_TRUE(at::allclose(all[0], (locals[0] + locals[1]) / 2));
    }
  }));
}

// One backward through a communication hook against the exact average of
// the ranks' local gradients, gathered separately: the largest relative error.
double hook_error(const Group& group, const std::string& hook) {
  Engine engine;
  engine.hook = hook;
  torch::manual_seed(11);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, engine.options());
  torch::manual_seed(11);
  Mlp local;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(17 + group->rank());
  at::Tensor x = at::randn({8, 10}, generator);
  at::Tensor y = at::randint(0, 4, {8}, generator, at::kLong);
  torch::nn::functional::cross_entropy(ddp_model.forward(x), y).backward();
  torch::nn::functional::cross_entropy(local->forward(x), y).backward();
  double worst = 0;
  auto got = model->parameters();
  auto mine = local->parameters();
  for (size_t k = 0; k < got.size(); ++k) {
    at::Tensor exact = at::zeros_like(mine[k]);
    for (auto& g : group->all_gather(mine[k].grad())) exact += g;
    exact /= group->size();
    double scale = exact.abs().max().item<double>();
    worst = std::max(worst, (got[k].grad() - exact).abs().max().item<double>() / std::max(scale, 1e-12));
  }
  return worst;
}

TEST(DistributedDataParallel, CommunicationHooks) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    EXPECT_LE(hook_error(group, "allreduce"), 1e-6);
    const double fp16 = hook_error(group, "fp16");
    EXPECT_GT(fp16, 0) << "fp16 rounding must show";
    EXPECT_LE(fp16, 2e-3);
    // bf16 keeps 8 mantissa bits to fp16's 11: a larger error than fp16's.
    const double bf16 = hook_error(group, "bf16");
    EXPECT_GT(bf16, fp16);
    EXPECT_LE(bf16, 2e-2);
  }));
}

}  // namespace
