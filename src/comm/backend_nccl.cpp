// NCCL process groups for CUDA tensors. Compiled with NCCL support when the
// CUDA toolkit and nccl.h are found at configure time (DDP_WITH_NCCL).
#include <ddp/error.h>
#include "comm/backends.h"

#ifdef DDP_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ddp::detail {

bool nccl_available() {
#ifdef DDP_WITH_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world, const c10::Device& device,
                                                    std::chrono::milliseconds timeout) {
#ifdef DDP_WITH_NCCL
  DDP_CHECK(device.is_cuda() && device.has_index(), "ddp: the NCCL backend needs a CUDA device with an index, got ",
              device.str());
  c10::cuda::set_device(device.index());
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, world.rank, world.world_size, options);
  // Tells the backend which GPU is this rank's, so a barrier (or any call
  // before the first collective) does not have to guess it from the rank.
  backend->setBoundDeviceId(device);
  return backend;
#else
  DDP_CHECK(false, "ddp: this build of ddp has no NCCL support (no CUDA toolkit or nccl.h was ",
              "found when it was configured); use the gloo backend or rebuild with CUDA");
#endif
}

}  // namespace ddp::detail
