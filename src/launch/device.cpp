#include <ddp/device.h>

#include <ddp/error.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

namespace ddp {

DeviceKind parse_device_kind(const std::string& name) {
  if (name == "auto") return DeviceKind::kAuto;
  if (name == "cpu") return DeviceKind::kCpu;
  if (name == "cuda") return DeviceKind::kCuda;
  DDP_CHECK(false, "ddp: unknown device '", name, "'; use auto, cpu or cuda");
}

c10::Device device_for_local_rank(int local_rank, int cuda_device_count, DeviceOptions options) {
  DDP_CHECK(local_rank >= 0, "ddp: local rank must be non-negative, got ", local_rank);
  if (options.kind() == DeviceKind::kCpu) return c10::Device(c10::kCPU);
  if (cuda_device_count <= 0) {
    DDP_CHECK(options.kind() != DeviceKind::kCuda, "ddp: CUDA was asked for, but no CUDA device is ",
                "visible to this process (check CUDA_VISIBLE_DEVICES and the driver, and that torch was ",
                "built with CUDA); ask for the CPU or auto instead");
    return c10::Device(c10::kCPU);
  }
  if (local_rank >= cuda_device_count) {
    DDP_CHECK(options.share_devices(), "ddp: local rank ", local_rank, " has no GPU of its own: only ",
                cuda_device_count, " CUDA device(s) are visible (after CUDA_VISIBLE_DEVICES). Start at most ",
                cuda_device_count, " rank(s) per node (ddprun --nproc-per-node ", cuda_device_count,
                "), or pass DeviceOptions().share_devices(true) to put several ranks on one GPU (gloo only: ",
                "NCCL refuses two ranks on one device).");
    local_rank %= cuda_device_count;
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

int visible_cuda_devices() {
  // torch::cuda answers 0 when no CUDA build of torch is loaded, instead of
  // throwing, so this is safe on CPU-only machines and builds.
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

void set_current_device(const c10::Device& device) {
  if (!device.is_cuda()) return;
  DDP_CHECK(device.has_index(), "ddp: set_current_device needs a GPU index, got ", device.str());
  // The guard registry is libtorch_cpu's; libc10_cuda registers CUDA's
  // implementation when it is loaded, so no CUDA header is needed here.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
}

c10::Device init_device(const World& world, DeviceOptions options) {
  int count = options.kind() == DeviceKind::kCpu ? 0 : visible_cuda_devices();
  c10::Device device = device_for_local_rank(world.local_rank, count, options);
  set_current_device(device);
  return device;
}

}  // namespace ddp
