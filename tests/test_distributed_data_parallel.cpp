// DistributedDataParallel across real processes (support/ranks.h), each
// rank's code and its assertions together: N ranks against one process with
// N times the batch under every engine option, no_sync(), unused parameters,
// buffers, communication hooks and the errors for mismatched replicas.

#include <support/launch.h>
#include <support/ddp_models.h>
#include <support/ddp_scenarios.h>
#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/checkpoint.h>
#include <ddp/clip_grad.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/grad_scaler.h>
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
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;


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

TEST(DistributedDataParallel, NoSyncAccumulatesLocallyThenMatchesOneLargeBatch) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    expect_no_sync_matches_one_batch(group, 3, Engine{});
    Engine view;
    view.bucket_view = true;
    expect_no_sync_matches_one_batch(group, 2, view);
  }));
}

TEST(DistributedDataParallel, FindUnusedParametersHandlesPerRankBranches) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(bucket_view ? "gradient_as_bucket_view" : "copied gradients");
      expect_unused_parameters_per_rank_handled(group, bucket_view);
    }
  }));
}

// A parameter used only in no_sync() micro-batches is still averaged by the
// next synced step, or the replicas would drift apart.
TEST(DistributedDataParallel, GradientsFromNoSyncStepsAreAveragedEvenIfUnusedLater) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(bucket_view ? "gradient_as_bucket_view" : "copied gradients");
      BranchyUnderDdp branchy(group, bucket_view);
      Branchy& model = branchy.model;
      auto& ddp_model = branchy.ddp_model;
      const at::Tensor& x = branchy.x;
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

// An inner hook that records the dtype of every bucket it is handed and
// all-reduces it.
class DtypeRecordingHook : public ddp::CommHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> run(ddp::ProcessGroup& group, ddp::GradBucket& bucket) override {
    seen.push_back(bucket.buffer().scalar_type());
    for (const at::Tensor& g : bucket.gradients()) seen.push_back(g.scalar_type());
    return inner_->run(group, bucket);
  }
  std::vector<at::ScalarType> seen;

 private:
  std::shared_ptr<ddp::CommHook> inner_ = ddp::allreduce_hook();
};

// One backward of Mlp under `hook`; its gradients, flattened.
at::Tensor gradients_under(const Group& group, std::shared_ptr<ddp::CommHook> hook) {
  torch::manual_seed(11);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, ddp::DDPOptions().bucket_cap_mb(1e-4).comm_hook(hook));
  at::manual_seed(17 + group->rank());
  ddp_model.forward(at::randn({8, 10})).pow(2).mean().backward();
  std::vector<at::Tensor> grads;
  for (auto& p : model->parameters()) grads.push_back(p.grad().flatten());
  return at::cat(grads);
}

TEST(DistributedDataParallel, CompressHookDecoratesAnyInnerHook) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    auto recording = std::make_shared<DtypeRecordingHook>();
    const at::Tensor decorated = gradients_under(group, ddp::compress_hook(at::kHalf, recording));
    // The inner hook reduced float16 buckets, their per-parameter views too,
    // and the gradients came back as float32, with the same bits as
    // fp16_compress_hook's (the same casts around the same all-reduce).
    EXPECT_FALSE(recording->seen.empty());
    for (at::ScalarType dtype : recording->seen) EXPECT_EQ(dtype, at::kHalf);
    EXPECT_EQ(decorated.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(decorated, gradients_under(group, ddp::fp16_compress_hook())));
    EXPECT_FALSE(at::equal(decorated, gradients_under(group, ddp::allreduce_hook()))) << "fp16 rounding must show";
    EXPECT_NE(error_of([] { ddp::compress_hook(at::kHalf, nullptr); }).find("needs an inner hook"), std::string::npos);
  }));
}

}  // namespace

namespace {

// static_graph with find_unused_parameters: the same weights as without it,
// and after the first iteration no all-reduce of "used" flags (one
// collective fewer per step; the graph search is skipped too).
TEST(StaticGraph, KeepsTheFirstIterationsUnusedParametersAndSkipsTheFlagsAllReduce) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    auto train = [&](bool static_graph, uint64_t* collectives) {
      torch::manual_seed(3);
      Branchy model;
      ddp::DistributedDataParallel<Branchy> ddp_model(
          model, group, ddp::DDPOptions().find_unused_parameters(true).static_graph(static_graph));
      torch::optim::SGD optimizer(ddp_model->parameters(), torch::optim::SGDOptions(0.1));
      const at::Tensor x = at::full({2, 4}, 1.0 + group->rank());
      const uint64_t first = group->trace().last_entered();
      for (int step = 0; step < 4; ++step) {
        optimizer.zero_grad();
        ddp_model.forward(x, /*use_right=*/false).sum().backward();
        optimizer.step();
      }
      *collectives = group->trace().last_entered() - first;
      // `right` and `never` took no part: no gradient, as in PyTorch.
      EXPECT_FALSE(model->right->weight.grad().defined());
      EXPECT_FALSE(model->never->weight.grad().defined());
      return flatten_parameters(*model);
    };
    uint64_t dynamic_count = 0, static_count = 0;
    const at::Tensor dynamic_weights = train(false, &dynamic_count);
    const at::Tensor static_weights = train(true, &static_count);
    EXPECT_TRUE(at::equal(dynamic_weights, static_weights));
    // Per step a bucket all-reduce, plus the flags' all-reduce (every step,
    // or only the first under static_graph), plus the bucket rebuild's
    // broadcast once.
    EXPECT_EQ(dynamic_count, 4u + 4u + 1u);
    EXPECT_EQ(static_count, 4u + 1u + 1u);
  }));
}

}  // namespace

namespace {

// An SGD that records which parameters had a gradient at each step() call:
// stepping in backward must call it once per bucket, with that bucket's
// parameters only.
class RecordingSgd : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  at::Tensor step(LossClosure closure = nullptr) override {
    std::vector<const c10::TensorImpl*> visible;
    for (auto& group : param_groups()) {
      for (auto& p : group.params()) {
        if (p.grad().defined()) visible.push_back(p.unsafeGetTensorImpl());
      }
    }
    calls.push_back(std::move(visible));
    return torch::optim::SGD::step(std::move(closure));
  }
  std::vector<std::vector<const c10::TensorImpl*>> calls;
};

enum class Stepping { kAfterBackward, kInBackward };

// Trains a fresh Mlp for `steps` synchronised steps, each after one no_sync()
// micro-batch, and returns its weights. Every rank sees other data.
template <typename Optimizer, typename Options>
at::Tensor train_mlp(const Group& group, Stepping stepping, const Options& options, int steps,
                     Optimizer** seen = nullptr, bool gradient_as_bucket_view = false,
                     std::shared_ptr<ddp::CommHook> comm_hook = nullptr) {
  torch::manual_seed(11);
  Mlp model;
  // Every parameter a bucket of its own: six buckets, six steps per backward.
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group,
                                              ddp::DDPOptions()
                                                  .first_bucket_cap_mb(1e-4)
                                                  .bucket_cap_mb(1e-4)
                                                  .gradient_as_bucket_view(gradient_as_bucket_view)
                                                  .comm_hook(comm_hook));
  auto optimizer = std::make_unique<Optimizer>(ddp_model.parameters(), options);
  if (stepping == Stepping::kInBackward) ddp_model.step_in_backward(*optimizer);
  at::manual_seed(100 + group->rank());
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    {
      auto guard = ddp_model.no_sync();
      ddp_model.forward(at::randn({5, 10})).pow(2).mean().backward();
    }
    ddp_model.forward(at::randn({5, 10})).pow(2).mean().backward();
    if (stepping == Stepping::kAfterBackward) optimizer->step();
  }
  ddp_model.stop_stepping_in_backward();
  if (seen) *seen = optimizer.release();  // the caller inspects it (and leaks it: a test)
  return flatten_parameters(*model);
}

TEST(StepInBackward, GivesExactlyTheWeightsOfAStepAfterBackward) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    torch::manual_seed(11);
    const at::Tensor initial = flatten_parameters(*Mlp());
    const auto adam = torch::optim::AdamOptions(1e-2).weight_decay(1e-3);
    const at::Tensor after = train_mlp<torch::optim::Adam>(group, Stepping::kAfterBackward, adam, 4);
    const at::Tensor in = train_mlp<torch::optim::Adam>(group, Stepping::kInBackward, adam, 4);
    EXPECT_FALSE(at::allclose(after, initial));
    EXPECT_TRUE(at::equal(after, in)) << (after - in).abs().max();
    expect_replicas_identical(group, in, "adam, stepped in backward");

    // Gradients that live in the buckets: the hidden ones are the buckets' memory.
    EXPECT_TRUE(at::equal(after, train_mlp<torch::optim::Adam>(group, Stepping::kInBackward, adam, 4, nullptr,
                                                               /*gradient_as_bucket_view=*/true)));

    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    EXPECT_TRUE(at::equal(train_mlp<torch::optim::SGD>(group, Stepping::kAfterBackward, sgd, 3),
                          train_mlp<torch::optim::SGD>(group, Stepping::kInBackward, sgd, 3)));
  }));
}

// The step is a continuation of whatever hook reduces the bucket: with a
// compressing hook it sees exactly the averages that hook produced, as a step
// after backward would.
TEST(StepInBackward, ComposesWithTheUsersCommHook) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    const auto adam = torch::optim::AdamOptions(1e-2);
    const at::Tensor plain = train_mlp<torch::optim::Adam>(group, Stepping::kAfterBackward, adam, 3);
    const at::Tensor after = train_mlp<torch::optim::Adam>(group, Stepping::kAfterBackward, adam, 3, nullptr, false,
                                                           ddp::bf16_compress_hook());
    const at::Tensor in = train_mlp<torch::optim::Adam>(group, Stepping::kInBackward, adam, 3, nullptr, false,
                                                        ddp::bf16_compress_hook());
    EXPECT_FALSE(at::equal(plain, after)) << "bfloat16 rounding should change the trajectory";
    EXPECT_TRUE(at::equal(after, in)) << (after - in).abs().max();
    expect_replicas_identical(group, in, "adam over bf16-compressed buckets, stepped in backward");
  }));
}

TEST(StepInBackward, StepsOncePerBucketWithThatBucketsParametersOnly) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    RecordingSgd* optimizer = nullptr;
    train_mlp<RecordingSgd>(group, Stepping::kInBackward, torch::optim::SGDOptions(0.1), 2, &optimizer);
    // Each synchronised backward steps once per bucket (the buckets are
    // rebuilt after the first): disjoint sets of parameters that together
    // cover all six. The no_sync() passes step nothing.
    size_t backward_passes = 0;
    std::set<const c10::TensorImpl*> stepped;
    for (const auto& call : optimizer->calls) {
      EXPECT_FALSE(call.empty());
      for (const auto* p : call) EXPECT_TRUE(stepped.insert(p).second) << "a parameter stepped twice in one pass";
      if (stepped.size() == 6) {
        ++backward_passes;
        stepped.clear();
      }
    }
    EXPECT_TRUE(stepped.empty());
    EXPECT_EQ(backward_passes, 2u);
    EXPECT_GE(optimizer->calls.size(), 2 * 3u) << "several buckets each pass";
    // The hidden gradients are back after each step.
    for (auto& p : optimizer->param_groups()[0].params()) EXPECT_TRUE(p.grad().defined());
  }));
}

TEST(StepInBackward, WorksOnOneRankWhereNothingIsReduced) {
  expect_all_succeeded(run_on_ranks(1, [](const Group& group) {
    const auto adam = torch::optim::AdamOptions(1e-2);
    EXPECT_TRUE(at::equal(train_mlp<torch::optim::Adam>(group, Stepping::kAfterBackward, adam, 3),
                          train_mlp<torch::optim::Adam>(group, Stepping::kInBackward, adam, 3)));
  }));
}

// With find_unused_parameters: a parameter that one rank used is stepped with
// the average, one that no rank used is not stepped at all, exactly as by
// optimizer.step() after backward.
TEST(StepInBackward, StepsWhatAnyRankUsedUnderFindUnusedParameters) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(bucket_view ? "gradient_as_bucket_view" : "copied gradients");
      auto train = [&](Stepping stepping) {
        BranchyUnderDdp branchy(group, bucket_view);
        auto& ddp_model = branchy.ddp_model;
        torch::optim::Adam adam(ddp_model.parameters(), torch::optim::AdamOptions(1e-2));
        if (stepping == Stepping::kInBackward) ddp_model.step_in_backward(adam);
        for (int step = 0; step < 3; ++step) {
          adam.zero_grad();
          ddp_model.forward(branchy.x, group->rank() == 0).sum().backward();  // only rank 0 uses `right`
          if (stepping == Stepping::kAfterBackward) adam.step();
        }
        ddp_model.stop_stepping_in_backward();
        EXPECT_FALSE(branchy.model->never->weight.grad().defined());
        return flatten_parameters(*branchy.model);
      };
      const at::Tensor after = train(Stepping::kAfterBackward);
      EXPECT_TRUE(at::equal(after, train(Stepping::kInBackward)));
    }
  }));
}

// At one rank the loss still rides, through the one-rank all-reduce: no
// special case, the same answer as alone.
TEST(CarryLoss, OneRankReducesToItsOwnLoss) {
  expect_all_succeeded(run_on_ranks(1, [](const Group& group) {
    Mlp model;
    ddp::DistributedDataParallel<Mlp> ddp_model(model, group, ddp::DDPOptions().carry_loss(true));
    at::Tensor loss = ddp_model.forward(at::randn({4, 10})).pow(2).mean();
    ddp_model.note_loss(loss);
    loss.backward();
    EXPECT_TRUE(ddp_model.reduced_loss().valid);
    EXPECT_TRUE(ddp_model.reduced_loss().nonfinite_ranks.empty());
    EXPECT_NEAR(ddp_model.reduced_loss().average, loss.item<double>(), 1e-6);
    at::Tensor nan = ddp_model.forward(at::randn({4, 10})).pow(2).mean() * std::nan("");
    ddp_model.note_loss(nan);
    nan.backward();
    EXPECT_EQ(ddp_model.reduced_loss().nonfinite_ranks, std::vector<int>{0});
  }));
}

TEST(StepInBackward, RefusesWhatItCannotStep) {
  expect_all_succeeded(run_on_ranks(1, [](const Group& group) {
    Mlp model;
    ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
    std::vector<at::Tensor> params = ddp_model.parameters();
    params.push_back(at::zeros({3}, at::requires_grad()));
    torch::optim::SGD foreign(params, torch::optim::SGDOptions(0.1));
    std::string error = error_of([&] { ddp_model.step_in_backward(foreign); });
    EXPECT_NE(error.find("1 of the optimizer's parameters are not this model's"), std::string::npos) << error;

    Mlp carried;
    ddp::DistributedDataParallel<Mlp> carrying(carried, group, ddp::DDPOptions().carry_loss(true));
    torch::optim::SGD sgd(carrying.parameters(), torch::optim::SGDOptions(0.1));
    error = error_of([&] { carrying.step_in_backward(sgd); });
    EXPECT_NE(error.find("carry_loss"), std::string::npos) << error;

    torch::optim::LBFGS lbfgs(ddp_model.parameters());
    error = error_of([&] { ddp_model.step_in_backward(lbfgs); });
    EXPECT_NE(error.find("LBFGS evaluates a closure"), std::string::npos) << error;

    // GradScaler would step it a second time, after the fact.
    torch::optim::SGD stepped(ddp_model.parameters(), torch::optim::SGDOptions(0.1));
    ddp_model.step_in_backward(stepped);
    EXPECT_TRUE(ddp_model.steps_optimizer_in_backward());
    ddp::GradScaler scaler(ddp::GradScalerOptions().enabled(false));
    error = error_of([&] { scaler.step(stepped, ddp_model); });
    EXPECT_NE(error.find("step_in_backward"), std::string::npos) << error;
    error = error_of([&] { scaler.unscale_(stepped, ddp_model); });
    EXPECT_NE(error.find("step_in_backward"), std::string::npos) << error;
    // Clipping would come after the step.
    error = error_of([&] { ddp::clip_grad_norm_(ddp_model, 1.0); });
    EXPECT_NE(error.find("step_in_backward"), std::string::npos) << error;
    ddp_model.stop_stepping_in_backward();
    EXPECT_FALSE(ddp_model.steps_optimizer_in_backward());
    EXPECT_TRUE(scaler.step(stepped, ddp_model));

    // A parameter group added after registering: no bucket holds it.
    Mlp grown;
    ddp::DistributedDataParallel<Mlp> growing(grown, group);
    torch::optim::SGD later(growing.parameters(), torch::optim::SGDOptions(0.1));
    growing.step_in_backward(later);
    at::Tensor extra = at::zeros({3}, at::requires_grad());
    extra.mutable_grad() = at::ones({3});
    later.add_param_group(torch::optim::OptimizerParamGroup({extra}));
    error = error_of([&] { growing.forward(at::ones({2, 10})).sum().backward(); });
    EXPECT_NE(error.find("added to the optimizer after step_in_backward"), std::string::npos) << error;
    growing.stop_stepping_in_backward();
  }));
}

}  // namespace
