// The GPU path on a real GPU. Every test skips, saying why, where CUDA is
// not available, so the suite builds and passes on CPU-only machines;
// bench/gpu_check.sh runs it on a GPU machine (ctest -L gpu).

#include <ddp/autocast.h>
#include <ddp/comm_hooks.h>
#include <ddp/device.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/grad_scaler.h>
#include <ddp/process_group.h>

#include <gtest/gtest.h>
#include <support/launch.h>

#include <ATen/Functions.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <limits>

using namespace ddp::testing;

#define SKIP_WITHOUT_CUDA()                                                                                 \
  if (!torch::cuda::is_available())                                                                       \
  GTEST_SKIP() << "no CUDA device: torch::cuda::is_available() is false (no GPU, no driver, or a CPU-only " \
                  "build of ddp)"

namespace {

// A world of one process on GPU 0 with NCCL.
std::shared_ptr<ddp::ProcessGroup> nccl_group_of_one() {
  ddp::World world;
  c10::Device device = ddp::init_device(world, ddp::DeviceOptions().kind(ddp::DeviceKind::kCuda));
  return ddp::ProcessGroup::create(world, ddp::ProcessGroupOptions().device(device));
}

// Two ranks: NCCL with a GPU each, else gloo with both on GPU 0 (NCCL
// refuses two ranks on one GPU).
std::vector<std::string> two_rank_flags() {
  if (torch::cuda::device_count() >= 2) return {"--device", "cuda", "--backend", "nccl"};
  return {"--device", "cuda", "--backend", "gloo", "--share-devices"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST(Gpu, InitDevicePicksTheLocalRanksGpu) {
  SKIP_WITHOUT_CUDA();
  ddp::World world;
  EXPECT_EQ(ddp::init_device(world), c10::Device(c10::kCUDA, 0));
  world.local_rank = static_cast<int>(torch::cuda::device_count());
  EXPECT_THROW(ddp::init_device(world), c10::Error);
  EXPECT_EQ(ddp::init_device(world, ddp::DeviceOptions().share_devices(true)), c10::Device(c10::kCUDA, 0));
}

TEST(Gpu, AutoBackendOnCudaIsNcclAndItsCollectivesWork) {
  SKIP_WITHOUT_CUDA();
  auto group = nccl_group_of_one();
  EXPECT_EQ(group->backend(), ddp::BackendKind::kNccl);
  EXPECT_TRUE(group->control_options().device().is_cuda());
  at::Tensor t = at::arange(4, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  group->all_reduce(t);  // non-blocking on the host: .cpu() below waits
  EXPECT_TRUE(at::equal(t.cpu(), at::arange(4, at::kFloat)));
  group->barrier();
}

TEST(Gpu, DdpAtWorldSizeOneMatchesAPlainStep) {
  SKIP_WITHOUT_CUDA();
  auto group = nccl_group_of_one();
  torch::manual_seed(0);
  torch::nn::Linear plain(16, 4), wrapped(16, 4);
  plain->to(at::kCUDA);
  wrapped->to(at::kCUDA);
  {
    torch::NoGradGuard no_grad;
    wrapped->weight.copy_(plain->weight);
    wrapped->bias.copy_(plain->bias);
  }
  ddp::DistributedDataParallel<torch::nn::Linear> model(wrapped, group);
  torch::optim::Adam plain_opt(plain->parameters(), 1e-2), ddp_opt(model->parameters(), 1e-2);
  at::Tensor x = at::randn({8, 16}, at::kCUDA);
  at::Tensor y = at::randint(0, 4, {8}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  for (int step = 0; step < 3; ++step) {
    plain_opt.zero_grad();
    torch::nn::functional::cross_entropy(plain(x), y).backward();
    plain_opt.step();
    ddp_opt.zero_grad();
    torch::nn::functional::cross_entropy(model.forward(x), y).backward();
    ddp_opt.step();
  }
  EXPECT_TRUE(at::allclose(plain->weight, wrapped->weight, 1e-6, 1e-7));
  EXPECT_TRUE(wrapped->weight.is_cuda());
}

TEST(Gpu, TwoRanksMatchOneProcess) {
  SKIP_WITHOUT_CUDA();
  auto r = run_process(under_ddprun(2, "gpu_worker", with({"equivalence", "--tolerance", "1e-4"}, two_rank_flags())),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "120"}}, std::chrono::seconds(240)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("EQUIVALENCE device=cuda"), std::string::npos) << r.out;
}

// FSDP's units on the GPU: FULL_SHARD on two ranks (NCCL with two GPUs, or
// gloo sharing one) lands on DDP's weights computed on the CPU.
TEST(Gpu, FsdpFullShardOnCudaMatchesDdpOnTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto dir = make_temp_dir("ddp_gpu_fsdp");
  auto reference = run_process(under_ddprun(2, "ddp_worker", {"train", "--strategy", "ddp", "--out", dir + "/ddp.pt"}),
                               one_rank({}, std::chrono::seconds(120)));
  ASSERT_EQ(reference.exit_code, 0) << reference.describe();
  std::vector<std::string> flags = {"train", "--strategy", "fsdp-full", "--device", "cuda", "--out", dir + "/fsdp.pt"};
  if (torch::cuda::device_count() < 2) flags.insert(flags.end(), {"--backend", "gloo", "--share-devices", "yes"});
  auto r = run_process(under_ddprun(2, "ddp_worker", flags),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "120"}}, std::chrono::seconds(240)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto diff = run_process({DDP_PYTHON, "-c",
                           "import sys, torch\n"
                           "a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\n"
                           "print(max((a[k] - b[k]).abs().max().item() for k in a))\n",
                           dir + "/ddp.pt", dir + "/fsdp.pt"});
  ASSERT_EQ(diff.exit_code, 0) << diff.describe();
  EXPECT_LE(std::stod(diff.out), 1e-4) << diff.out;
}

TEST(Gpu, TwoRanksWithNcclNeedTwoGpus) {
  SKIP_WITHOUT_CUDA();
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "fewer than 2 GPUs (" << torch::cuda::device_count()
                 << "): NCCL refuses two ranks on one GPU; TwoRanksMatchOneProcess used gloo instead";
  }
  auto r = run_process(under_ddprun(2, "gpu_worker", {"equivalence", "--device", "cuda", "--backend", "nccl"}),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "120"}}, std::chrono::seconds(240)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("backend=nccl"), std::string::npos) << r.out;
}

TEST(Gpu, CompressionHooksOnCuda) {
  SKIP_WITHOUT_CUDA();
  // The hook alone, on a group of one: the value comes back on the GPU, in
  // the bucket's dtype, rounded through the wire dtype.
  auto group = nccl_group_of_one();
  for (auto [hook, wire] : {std::make_pair(ddp::fp16_compress_hook(), at::kHalf),
                            std::make_pair(ddp::bf16_compress_hook(), at::kBFloat16)}) {
    at::Tensor buffer = at::randn({1000}, at::kCUDA);
    at::Tensor expected = buffer.to(wire).to(at::kFloat);
    ddp::GradBucket bucket(0, buffer, true);
    auto future = hook->run(*group, bucket);
    future->wait();
    ASSERT_FALSE(future->hasError()) << future->tryRetrieveErrorMessage();
    at::Tensor result = future->value().toTensor();
    EXPECT_TRUE(result.is_cuda());
    EXPECT_EQ(result.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(result, expected));
  }
  // And inside DDP across two ranks.
  for (const char* hook : {"fp16", "bf16"}) {
    auto r = run_process(
        under_ddprun(2, "gpu_worker", with({"equivalence", "--hook", hook, "--tolerance", "2e-2"}, two_rank_flags())),
        one_rank({{"DDP_TIMEOUT_SECONDS", "120"}}, std::chrono::seconds(240)));
    ASSERT_EQ(r.exit_code, 0) << hook << "\n" << r.describe();
  }
}

TEST(Gpu, GradScalerWithFloat16Autocast) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Linear model(32, 8);
  model->to(at::kCUDA);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  ddp::GradScaler scaler;
  at::Tensor x = at::randn({16, 32}, at::kCUDA);
  at::Tensor y = at::randint(0, 8, {16}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    at::Tensor loss;
    {
      ddp::AutocastGuard autocast(at::kCUDA, at::kHalf);
      at::Tensor logits = model(x);
      EXPECT_EQ(logits.scalar_type(), at::kHalf);
      loss = torch::nn::functional::cross_entropy(logits, y);
    }
    scaler.scale(loss).backward();
    if (step == 1) model->weight.mutable_grad()[0][0].fill_(std::numeric_limits<float>::infinity());
    EXPECT_EQ(scaler.step(optimizer), step != 1) << "step " << step;
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  // Across two ranks: one rank's inf makes both skip.
  auto r = run_process(under_ddprun(2, "gpu_worker", with({"grad_scaler"}, two_rank_flags())),
                       one_rank({{"DDP_TIMEOUT_SECONDS", "120"}}, std::chrono::seconds(240)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, "SCALER identical on 2 ranks"), 2) << r.out;
}

TEST(Gpu, Bfloat16AutocastForward) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Linear linear(64, 64);
  linear->to(at::kCUDA);
  at::Tensor x = at::randn({4, 64}, at::kCUDA);
  {
    ddp::AutocastGuard autocast(at::kCUDA, at::kBFloat16);
    at::Tensor out = linear(x);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    EXPECT_EQ(at::softmax(out, -1).scalar_type(), at::kFloat);  // float32 op under autocast
  }
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
}
