// Device selection without GPUs: the pure choice for any device count, and
// the CPU fallback of this machine.

#include <ddp/device.h>
#include <ddp/process_group.h>

#include <gtest/gtest.h>
#include <support/torch_errors.h>

using ddp::testing::error_of;

TEST(Device, EachLocalRankGetsItsOwnGpu) {
  EXPECT_EQ(ddp::device_for_local_rank(0, 8), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(ddp::device_for_local_rank(7, 8), c10::Device(c10::kCUDA, 7));
}

TEST(Device, NoGpuMeansCpuUnlessCudaWasAskedFor) {
  EXPECT_EQ(ddp::device_for_local_rank(3, 0), c10::Device(c10::kCPU));
  auto message = error_of([] { ddp::device_for_local_rank(0, 0, ddp::DeviceOptions().kind(ddp::DeviceKind::kCuda)); });
  EXPECT_NE(message.find("no CUDA device is visible"), std::string::npos) << message;
  EXPECT_NE(message.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << message;
}

TEST(Device, CpuWinsEvenWithGpus) {
  EXPECT_EQ(ddp::device_for_local_rank(1, 4, ddp::DeviceOptions().kind(ddp::DeviceKind::kCpu)),
            c10::Device(c10::kCPU));
}

TEST(Device, MoreRanksThanGpusIsAnErrorNamingBothNumbers) {
  auto message = error_of([] { ddp::device_for_local_rank(2, 2); });
  EXPECT_NE(message.find("local rank 2"), std::string::npos) << message;
  EXPECT_NE(message.find("only 2 CUDA device(s)"), std::string::npos) << message;
  EXPECT_NE(message.find("share_devices(true)"), std::string::npos) << message;
}

TEST(Device, SharingDevicesWrapsAround) {
  auto share = ddp::DeviceOptions().share_devices(true);
  EXPECT_EQ(ddp::device_for_local_rank(2, 2, share), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(ddp::device_for_local_rank(5, 2, share), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(ddp::device_for_local_rank(1, 1, share), c10::Device(c10::kCUDA, 0));
}

TEST(Device, ParsesKinds) {
  EXPECT_EQ(ddp::parse_device_kind("auto"), ddp::DeviceKind::kAuto);
  EXPECT_EQ(ddp::parse_device_kind("cpu"), ddp::DeviceKind::kCpu);
  EXPECT_EQ(ddp::parse_device_kind("cuda"), ddp::DeviceKind::kCuda);
  auto message = error_of([] { ddp::parse_device_kind("gpu"); });
  EXPECT_NE(message.find("'gpu'"), std::string::npos) << message;
}

TEST(Device, InitDeviceFallsBackToCpuWithoutCuda) {
  if (ddp::visible_cuda_devices() > 0) GTEST_SKIP() << "this machine has a GPU; the gpu tests cover it";
  ddp::World world;
  world.local_rank = 1;
  world.local_world_size = 2;
  EXPECT_EQ(ddp::init_device(world), c10::Device(c10::kCPU));
  auto message = error_of([&] { ddp::init_device(world, ddp::DeviceOptions().kind(ddp::DeviceKind::kCuda)); });
  EXPECT_NE(message.find("no CUDA device is visible"), std::string::npos) << message;
  ddp::set_current_device(c10::Device(c10::kCPU));  // a no-op, not an error
}

TEST(Device, AutoBackendIsNcclOnCudaAndGlooOnCpu) {
  EXPECT_EQ(ddp::resolve_backend(ddp::BackendKind::kAuto, c10::Device(c10::kCUDA, 0)), ddp::BackendKind::kNccl);
  EXPECT_EQ(ddp::resolve_backend(ddp::BackendKind::kAuto, c10::Device(c10::kCUDA)), ddp::BackendKind::kNccl);
  EXPECT_EQ(ddp::resolve_backend(ddp::BackendKind::kAuto, c10::Device(c10::kCPU)), ddp::BackendKind::kGloo);
  EXPECT_EQ(ddp::resolve_backend(ddp::BackendKind::kGloo, c10::Device(c10::kCUDA, 0)), ddp::BackendKind::kGloo);
}

TEST(Device, NcclWithoutGpuFailsWithItsCause) {
  if (ddp::visible_cuda_devices() > 0) GTEST_SKIP() << "this machine has a GPU; the gpu tests cover it";
  ddp::World world;  // one process: no rendezvous, so the error comes at once
  auto message = error_of([&] {
    ddp::ProcessGroup::create(world, ddp::ProcessGroupOptions().device(c10::Device(c10::kCUDA, 0)));
  });
  EXPECT_TRUE(message.find("needs a CUDA device") != std::string::npos ||
              message.find("no NCCL support") != std::string::npos)
      << message;
}
