// GradScaler and AutocastGuard in one process on the CPU: torch.amp's
// semantics (skip and back off on inf/NaN, grow after growth_interval clean
// steps, Python's state_dict), float32 and float16 gradients.

#include <ddp/autocast.h>
#include <ddp/checkpoint.h>
#include <ddp/grad_scaler.h>

#include <gtest/gtest.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>

#include <ATen/Functions.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <limits>

using ddp::testing::error_of;

namespace {

struct Fixture {
  torch::nn::Linear model{torch::nn::Linear(4, 2)};
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(0.1)};
  at::Tensor x = at::arange(8, at::kFloat).view({2, 4}) / 8;

  at::Tensor loss() { return model(x).pow(2).sum(); }
  at::Tensor weights() { return at::cat({model->weight.detach().reshape({-1}), model->bias.detach()}).clone(); }
  // One iteration; `poison` puts an inf into the weight's gradient.
  bool iteration(ddp::GradScaler& scaler, bool poison = false) {
    optimizer.zero_grad();
    scaler.scale(loss()).backward();
    if (poison) model->weight.mutable_grad().view({-1})[0].fill_(std::numeric_limits<float>::infinity());
    bool stepped = scaler.step(optimizer);
    scaler.update();
    return stepped;
  }
};

}  // namespace

TEST(GradScaler, DefaultsArePythons) {
  ddp::GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.get_growth_factor(), 2.0);
  EXPECT_EQ(scaler.get_backoff_factor(), 0.5);
  EXPECT_EQ(scaler.get_growth_interval(), 2000);
  EXPECT_TRUE(scaler.is_enabled());
}

TEST(GradScaler, ScalesTheLossAndUnscalesGradientsExactly) {
  Fixture f;
  f.optimizer.zero_grad();
  f.loss().backward();
  at::Tensor expected = f.model->weight.grad().clone();

  ddp::GradScaler scaler;
  f.optimizer.zero_grad();
  at::Tensor loss = f.loss();
  at::Tensor scaled = scaler.scale(loss);
  EXPECT_TRUE(at::allclose(scaled, loss * 65536.0));
  scaled.backward();
  scaler.unscale_(f.optimizer);
  // A power-of-two scale divides back without rounding.
  EXPECT_TRUE(at::equal(f.model->weight.grad(), expected));
  at::Tensor before = f.weights();
  EXPECT_TRUE(scaler.step(f.optimizer));
  EXPECT_FALSE(at::equal(before, f.weights()));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
}

TEST(GradScaler, InfSkipsTheStepAndHalvesTheScale) {
  Fixture f;
  ddp::GradScaler scaler;
  at::Tensor before = f.weights();
  EXPECT_FALSE(f.iteration(scaler, /*poison=*/true));
  EXPECT_TRUE(at::equal(before, f.weights()));
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  EXPECT_TRUE(f.iteration(scaler));
  EXPECT_FALSE(at::equal(before, f.weights()));
}

TEST(GradScaler, NanSkipsTheStepToo) {
  Fixture f;
  ddp::GradScaler scaler;
  f.optimizer.zero_grad();
  scaler.scale(f.loss()).backward();
  f.model->bias.mutable_grad()[1].fill_(std::numeric_limits<float>::quiet_NaN());
  EXPECT_FALSE(scaler.step(f.optimizer));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScaler, GrowsAfterTheIntervalOfCleanSteps) {
  Fixture f;
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(8).growth_interval(3));
  EXPECT_TRUE(f.iteration(scaler));
  EXPECT_TRUE(f.iteration(scaler));
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 2);
  EXPECT_TRUE(f.iteration(scaler));
  EXPECT_EQ(scaler.get_scale(), 16.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  // A skipped step resets the count.
  EXPECT_TRUE(f.iteration(scaler));
  EXPECT_FALSE(f.iteration(scaler, /*poison=*/true));
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
}

TEST(GradScaler, UnscalesFloat16Gradients) {
  at::Tensor p = at::ones({3}, at::kHalf).requires_grad_(true);
  torch::optim::SGD optimizer({p}, torch::optim::SGDOptions(1.0));
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(1024));
  scaler.scale(at::ones({}, at::kFloat));  // creates the scale
  p.mutable_grad() = at::full({3}, 2048.0, at::kHalf);
  scaler.unscale_(optimizer);
  EXPECT_TRUE(at::equal(p.grad(), at::full({3}, 2.0, at::kHalf)));
  EXPECT_TRUE(scaler.step(optimizer));
  EXPECT_TRUE(at::equal(p.detach(), at::full({3}, -1.0, at::kHalf)));
  scaler.update();

  p.mutable_grad() = at::full({3}, 65504.0, at::kHalf) * 2;  // overflows to inf in float16
  EXPECT_FALSE(scaler.step(optimizer));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

TEST(GradScaler, StateDictHasPythonsKeys) {
  Fixture f;
  ddp::GradScaler scaler(ddp::GradScalerOptions().growth_interval(7));
  f.iteration(scaler);
  f.iteration(scaler, /*poison=*/true);
  f.iteration(scaler);
  auto state = scaler.state_dict();
  ASSERT_EQ(state.size(), 5u);
  EXPECT_EQ(state.at("scale").toDouble(), 32768.0);
  EXPECT_EQ(state.at("growth_factor").toDouble(), 2.0);
  EXPECT_EQ(state.at("backoff_factor").toDouble(), 0.5);
  EXPECT_EQ(state.at("growth_interval").toInt(), 7);
  EXPECT_EQ(state.at("_growth_tracker").toInt(), 1);

  ddp::GradScaler restored;
  restored.load_state_dict(state);
  EXPECT_EQ(restored.get_scale(), 32768.0);
  EXPECT_EQ(restored.get_growth_interval(), 7);
  EXPECT_EQ(restored.get_growth_tracker(), 1);
  // And back from the file format.
  std::string path = ddp::testing::make_temp_dir() + "/scaler.pt";
  ddp::save_value(state, path);
  ddp::GradScaler reloaded;
  reloaded.load_state_dict(ddp::load_value(path).toGenericDict());
  EXPECT_EQ(reloaded.get_scale(), 32768.0);
  Fixture g;
  g.iteration(restored);  // the scale is created from the loaded state
  EXPECT_EQ(restored.get_scale(), 32768.0);
  EXPECT_EQ(restored.get_growth_tracker(), 2);
}

TEST(GradScaler, StateDictLoadsIntoPythonsGradScaler) {
  Fixture f;
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(1024).growth_interval(5));
  f.iteration(scaler, /*poison=*/true);
  f.iteration(scaler);
  std::string path = ddp::testing::make_temp_dir() + "/scaler.pt";
  ddp::save_value(scaler.state_dict(), path);
  auto r = ddp::testing::run_process(
      {DDP_PYTHON, "-c",
       "import sys, torch\n"
       "state = torch.load(sys.argv[1], weights_only=True)\n"
       "scaler = torch.amp.GradScaler('cpu')\n"
       "scaler.load_state_dict(state)\n"
       "print(sorted(state), scaler.get_scale(), scaler._init_growth_tracker, scaler.get_growth_interval())\n",
       path});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("['_growth_tracker', 'backoff_factor', 'growth_factor', 'growth_interval', 'scale'] "
                       "512.0 1 5"),
            std::string::npos)
      << r.out;
}

TEST(GradScaler, MisuseFailsWithTheFix) {
  Fixture f;
  ddp::GradScaler scaler;
  auto message = error_of([&] { scaler.step(f.optimizer); });
  EXPECT_NE(message.find("before any scale()"), std::string::npos) << message;
  scaler.scale(f.loss()).backward();
  scaler.unscale_(f.optimizer);
  message = error_of([&] { scaler.unscale_(f.optimizer); });
  EXPECT_NE(message.find("already been called"), std::string::npos) << message;
  scaler.step(f.optimizer);
  message = error_of([&] { scaler.step(f.optimizer); });
  EXPECT_NE(message.find("call update()"), std::string::npos) << message;
  scaler.update();
  message = error_of([&] { scaler.update(); });
  EXPECT_NE(message.find("no inf checks"), std::string::npos) << message;
  message = error_of([] { ddp::GradScaler(ddp::GradScalerOptions().backoff_factor(1.5)); });
  EXPECT_NE(message.find("backoff_factor must be in (0, 1), got 1.5"), std::string::npos) << message;
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Fixture f;
  ddp::GradScaler scaler(ddp::GradScalerOptions().enabled(false));
  at::Tensor loss = f.loss();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  at::Tensor before = f.weights();
  EXPECT_TRUE(scaler.step(f.optimizer));
  EXPECT_FALSE(at::equal(before, f.weights()));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(scaler.state_dict().size(), 0u);
}

TEST(Autocast, Bfloat16OnCpuInsideTheGuardOnly) {
  torch::nn::Linear linear(4, 3);
  at::Tensor x = at::randn({2, 4});
  {
    ddp::AutocastGuard autocast(at::kCPU, at::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
    {
      ddp::AutocastGuard off(at::kCPU, at::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
    }
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);  // the outer guard is back
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
}
