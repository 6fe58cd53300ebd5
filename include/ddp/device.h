#pragma once

// Which device a rank trains on: its own GPU, counted by local rank, when
// CUDA is available, else the CPU. Uses libtorch_cpu's view of CUDA only
// (torch::cuda, the device guard registry), so libddp does not link
// torch_cuda to pick a device.
//
//   auto world = ddp::world_from_env();
//   c10::Device device = ddp::init_device(world);   // cuda:<local_rank> or cpu
//   auto group = ddp::init_process_group(ddp::ProcessGroupOptions().device(device));

#include <ddp/export.h>
#include <ddp/env.h>

#include <c10/core/Device.h>
#include <torch/arg.h>

#include <string>

namespace ddp {

/// Which kind of device to train on.
enum class DeviceKind {
  kAuto,  ///< this rank's GPU when CUDA is available, else the CPU
  kCpu,   ///< the CPU even when GPUs are visible
  kCuda,  ///< this rank's GPU; an error when CUDA is not available
};

/// "auto", "cpu" or "cuda"; throws on anything else.
DDP_API DeviceKind parse_device_kind(const std::string& name);

/// Options for device_for_local_rank and init_device.
///
///   ddp::DeviceOptions().kind(ddp::DeviceKind::kCuda).share_devices(true)
struct DeviceOptions {
  /// CPU, GPU, or whichever is available.
  TORCH_ARG(DeviceKind, kind) = DeviceKind::kAuto;
  /// With more local ranks than visible GPUs, let rank r use GPU
  /// r % device_count. Off, that is an error: two ranks on one GPU halve
  /// each other's speed and NCCL refuses them, so it must be asked for.
  TORCH_ARG(bool, share_devices) = false;
};

/// The device of local rank `local_rank` when `cuda_device_count` GPUs are
/// visible (after CUDA_VISIBLE_DEVICES, which the CUDA runtime applies):
/// cuda:<local_rank>, or the CPU when there are none and `options` allows it.
/// Pure, so it can be tested without GPUs.
DDP_API c10::Device device_for_local_rank(int local_rank, int cuda_device_count, DeviceOptions options = {});

/// The number of CUDA devices this process can use; 0 without CUDA (or
/// without a CUDA build of torch loaded).
DDP_API int visible_cuda_devices();

/// Picks this rank's device (device_for_local_rank over the visible GPUs)
/// and, for a GPU, makes it the current CUDA device, so that tensors,
/// streams and NCCL communicators of this rank all land on it.
DDP_API c10::Device init_device(const World& world, DeviceOptions options = {});

/// Makes `device` the current device of its type (a no-op for the CPU).
DDP_API void set_current_device(const c10::Device& device);

}  // namespace ddp
