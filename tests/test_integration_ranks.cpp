// The parts of "ddp inside LibTorch programs" that need several ranks: each
// test runs its body on every rank in a real process (support/ranks.h), so
// the assertion and each rank's code sit together.

#include <ddp/ddp.h>

#include "engine/bucket_reducer.h"

#include <gtest/gtest.h>
#include <support/ranks.h>

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/script.h>

#include <filesystem>

namespace fs = std::filesystem;
using ddp::testing::expect_all_succeeded;
using ddp::testing::run_on_ranks;

namespace {

struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
  }
  at::Tensor forward(const at::Tensor& x) { return bn->forward(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(NormNet);

// A directory both the test process and its ranks agree on (the ranks re-run
// the test from its start, so it must not depend on the pid).
std::string shared_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("ddp_integration_ranks_" + name + "_" + std::to_string(::getppid()));
  if (!std::getenv(ddp::testing::kRanksChildVariable)) {
    dir = fs::temp_directory_path() / ("ddp_integration_ranks_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  return dir.string();
}

TEST(BufferSyncRanks, ForwardThroughTheArrowWarnsOnceNamingTheFix) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::DistributedDataParallel<NormNet> model(NormNet(), group);
    at::Tensor x = at::randn({6, 4}) + group->rank();
    ::testing::internal::CaptureStderr();
    model(x).sum().backward();  // the synchronising path
    std::string quiet = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(quiet.find("warning"), std::string::npos) << quiet;

    ::testing::internal::CaptureStderr();
    model->forward(x).sum().backward();
    model->forward(x).sum().backward();
    std::string warned = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(warned.find("model.forward(x) or model(x)"), std::string::npos) << warned;
    EXPECT_EQ(warned.find("warning"), warned.rfind("warning")) << "warned more than once: " << warned;
  });
  expect_all_succeeded(ranks);
}

TEST(BufferSyncRanks, ModelCallBroadcastsRankZerosBuffersFirst) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::DistributedDataParallel<NormNet> model(NormNet(), group);
    // Different data per rank makes different running statistics...
    model(at::randn({8, 4}) * (group->rank() + 1)).sum().backward();
    // ...and the next forward starts from rank 0's on every rank.
    torch::NoGradGuard no_grad;
    model->eval();
    model(at::zeros({1, 4}));
    auto means = group->all_gather(model->bn->running_mean.clone());
    EXPECT_TRUE(means[1].equal(means[0]));
  });
  expect_all_succeeded(ranks);
}

TEST(SparseGradientsRanks, ASparseGradientAtBackwardNamesTheParameter) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::Tensor table = at::randn({10, 3}).requires_grad_();
    ddp::detail::BucketReducer reducer({table}, {"table"}, group);
    at::Tensor rows = at::embedding(table, at::tensor({1, 4}, at::kLong), -1, false, /*sparse=*/true);
    try {
      rows.sum().backward();
      ADD_FAILURE() << "a sparse gradient was averaged";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'table' got a sparse gradient"), std::string::npos) << e.what();
    }
  });
  expect_all_succeeded(ranks);
}

TEST(CheckpointRanks, SaveWritesOnRankZeroAndLoadBroadcastsItsFile) {
  const std::string dir = shared_dir("checkpoint");
  auto ranks = run_on_ranks(2, [&](const std::shared_ptr<ddp::ProcessGroup>& group) {
    torch::manual_seed(7);
    NormNet source;
    if (group->rank() == 0) ddp::save(source, dir + "/only_on_rank0.pt");
    group->barrier();
    // Every rank starts from other weights; the wrapper's own broadcast
    // makes them rank 0's, so perturb them after wrapping.
    ddp::DistributedDataParallel<NormNet> model(NormNet(), group);
    {
      torch::NoGradGuard no_grad;
      model->fc->weight.add_(group->rank() + 1.0);
    }
    ddp::load(model, dir + "/only_on_rank0.pt");
    EXPECT_TRUE(model->fc->weight.equal(source->fc->weight));
    EXPECT_TRUE(model->bn->running_var.equal(source->bn->running_var));

    ddp::save(model, dir + "/saved_by_" + std::to_string(group->rank()) + ".pt");
    group->barrier();
    EXPECT_TRUE(fs::exists(dir + "/saved_by_0.pt"));
    EXPECT_FALSE(fs::exists(dir + "/saved_by_1.pt")) << "a rank other than 0 wrote a checkpoint";

    // A missing file fails on every rank, rank 0 with the cause.
    try {
      ddp::load(model, dir + "/missing.pt");
      ADD_FAILURE() << "loaded a missing file";
    } catch (const c10::Error& e) {
      std::string what = e.what();
      if (group->rank() == 0) {
        EXPECT_NE(what.find("missing.pt"), std::string::npos) << what;
      } else {
        EXPECT_NE(what.find("rank 0 could not load"), std::string::npos) << what;
      }
    }
  });
  expect_all_succeeded(ranks);
  fs::remove_all(dir);
}

// The forward of a TorchScript module (a small MLP written in TorchScript).
torch::jit::Module scripted_mlp() {
  torch::jit::Module m("mlp");
  torch::manual_seed(5);
  m.register_parameter("w1", (at::randn({13, 16}) * 0.3).requires_grad_(), false);
  m.register_parameter("b1", at::zeros({16}).requires_grad_(), false);
  m.register_parameter("w2", (at::randn({16, 3}) * 0.3).requires_grad_(), false);
  m.register_parameter("b2", at::zeros({3}).requires_grad_(), false);
  m.define(R"(
    def forward(self, x):
        return (x @ self.w1 + self.b1).relu() @ self.w2 + self.b2
  )");
  return m;
}

TEST(TorchScriptRanks, TwoRanksEqualOneProcessOnTheWholeBatch) {
  const std::string dir = shared_dir("jit");
  // One process, batches of 16.
  {
    torch::jit::Module single = scripted_mlp();
    torch::manual_seed(9);
    at::Tensor x = at::randn({64, 13});
    at::Tensor y = at::randint(0, 3, {64}, at::kLong);
    std::vector<at::Tensor> params;
    for (const auto& p : single.parameters()) params.push_back(p);
    torch::optim::Adam optimizer(params, 1e-2);
    for (int64_t step = 0; step < 4; ++step) {
      optimizer.zero_grad();
      auto out = single.forward({x.narrow(0, step * 16, 16)}).toTensor();
      at::cross_entropy_loss(out, y.narrow(0, step * 16, 16)).backward();
      optimizer.step();
    }
    if (!std::getenv(ddp::testing::kRanksChildVariable)) ddp::save(single, dir + "/single.pt");
  }
  auto ranks = run_on_ranks(2, [&](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::DistributedDataParallel<torch::jit::Module> model(scripted_mlp(), group);
    torch::manual_seed(9);
    at::Tensor x = at::randn({64, 13});
    at::Tensor y = at::randint(0, 3, {64}, at::kLong);
    torch::optim::Adam optimizer(model.parameters(), 1e-2);
    for (int64_t step = 0; step < 4; ++step) {
      optimizer.zero_grad();
      // This rank's half of the same 16 samples.
      at::Tensor part = x.narrow(0, step * 16 + group->rank() * 8, 8);
      at::Tensor out = model.forward(part).toTensor();
      at::cross_entropy_loss(out, y.narrow(0, step * 16 + group->rank() * 8, 8)).backward();
      optimizer.step();
    }
    auto single = ddp::load_state_dict(dir + "/single.pt");
    auto mine = model.state_dict();
    ASSERT_EQ(single.size(), mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(single[i].first, mine[i].first);
      double diff = (single[i].second - mine[i].second).abs().max().item<double>();
      EXPECT_LE(diff, 1e-6) << mine[i].first;
    }
  });
  expect_all_succeeded(ranks);
  fs::remove_all(dir);
}

}  // namespace

namespace {

// Issue 21: rank 1 issues one all-reduce fewer, so its next (smaller) one
// pairs with rank 0's last full-size one. Gloo's transport thread throws on
// the size mismatch where nobody can catch it; that used to abort the rank
// (SIGABRT, no "error:" line, no rank or collective named). Now both ranks
// exit 1 and the one whose transport failed names itself and its collective.
TEST(TransportFailureRanks, ARankThatIssuesOneCollectiveFewerEndsEveryRankWithAnError) {
  ddp::testing::RanksOptions options;
  options.collective_timeout_seconds = 5;
  options.grace_after_failure = std::chrono::seconds(20);
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        const int steps = group->rank() == 0 ? 3 : 2;
        for (int i = 0; i < steps; ++i) {
          ddp::CollectiveTag tag("step " + std::to_string(i));
          at::Tensor gradient = at::ones({256});
          group->all_reduce(gradient);
        }
        ddp::CollectiveTag tag("epoch loss");
        at::Tensor loss = at::ones({1}, at::kDouble);
        group->all_reduce(loss);
        std::cout << "RANK " << group->rank() << " FINISHED\n";
      },
      options);
  ASSERT_EQ(ranks.size(), 2u);
  bool named = false;
  for (const auto& r : ranks) {
    EXPECT_NE(r.exit_code, 0) << ddp::testing::describe_ranks(ranks);
    EXPECT_EQ(r.term_signal, 0) << "a rank died of a signal\n" << ddp::testing::describe_ranks(ranks);
    EXPECT_FALSE(r.timed_out) << ddp::testing::describe_ranks(ranks);
    EXPECT_EQ(r.out.find("FINISHED"), std::string::npos) << ddp::testing::describe_ranks(ranks);
    // The rank's own error line, or run_on_ranks' report of ddp's exception.
    EXPECT_TRUE(r.err.find("error: ddp: rank ") != std::string::npos || r.err.find("threw: ddp: ") != std::string::npos)
        << ddp::testing::describe_ranks(ranks);
    if (r.err.find("issued different collectives") != std::string::npos &&
        r.err.find("all_reduce") != std::string::npos) {
      named = true;
    }
  }
  EXPECT_TRUE(named) << "no rank named the mismatch and its collective\n" << ddp::testing::describe_ranks(ranks);
}

// DDP_GLOO_THREADS was read with atoi, so "2abc" meant 2.
TEST(EnvironmentRanks, AGlooThreadCountThatIsNotANumberStopsEveryRankNamingIt) {
  ddp::testing::RanksOptions options;
  options.env = {{"DDP_GLOO_THREADS", "2abc"}};
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>&) {}, options);
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 1) << ddp::testing::describe_ranks(ranks);
    EXPECT_NE(r.err.find("DDP_GLOO_THREADS='2abc' is not an integer"), std::string::npos)
        << ddp::testing::describe_ranks(ranks);
  }
}

}  // namespace
