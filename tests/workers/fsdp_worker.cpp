// Trains support/fsdp_trainers.h's model under one strategy and writes the
// full state dict, for the tests in which a launcher must start the program
// (mpirun in test_mpi.cpp, ddprun on the GPU in test_gpu.cpp); the FSDP tests
// themselves run the same code in-process (test_fsdp_strategies.cpp).
//
//   ddprun --standalone --nproc-per-node 2 fsdp_worker --strategy fsdp-full --out w.pt
//
// --device cuda [--backend gloo --share-devices yes] trains on the GPU.

#include "worker_flags.h"

#include "../support/fsdp_trainers.h"

#include <ddp/device.h>
#include <ddp/error_file.h>

#include <cstdio>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  using worker::flag;
  try {
    ddp::testing::TrainSpec spec;
    spec.strategy = flag(argc, argv, "--strategy", "ddp");
    const std::string out = flag(argc, argv, "--out");
    auto device_options = ddp::DeviceOptions()
                              .kind(ddp::parse_device_kind(flag(argc, argv, "--device", "cpu")))
                              .share_devices(flag(argc, argv, "--share-devices", "no") == "yes");
    spec.device = ddp::init_device(ddp::world_from_env(), device_options);
    auto group = ddp::init_process_group(ddp::ProcessGroupOptions().device(spec.device).backend(
        ddp::parse_backend(flag(argc, argv, "--backend", "auto"))));
    auto result = ddp::testing::train(group, spec);
    if (group->rank() == 0 && !out.empty()) ddp::save_state_dict(result.state, out);
    group->barrier();
    std::printf("rank %d: fsdp_worker %s done\n", group->rank(), spec.strategy.c_str());
  } catch (const c10::Error& e) {
    ddp::record_error(e);  // for the launcher's root cause (TORCHELASTIC_ERROR_FILE)
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    ddp::record_error(e);
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
