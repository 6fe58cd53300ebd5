// Trains support/fsdp_trainers.h's model under one strategy and writes the
// full state dict, for the tests in which a launcher must start the program
// (mpirun in test_mpi.cpp, ddprun on the GPU in test_gpu.cpp); the FSDP tests
// themselves run the same code in-process (test_fsdp_strategies.cpp).
//
//   ddprun --standalone --nproc-per-node 2 fsdp_worker --strategy fsdp-full --out w.pt
//
// --device cuda [--backend gloo --share-devices yes] trains on the GPU.

#include "../support/fsdp_trainers.h"

#include <ddp/device.h>
#include <ddp/error_file.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  ddp::testing::TrainSpec spec;
  std::string out, device = "cpu", share_devices = "no", backend = "auto";
  CLI::App app{"Trains one strategy of support/fsdp_trainers.h and writes the full state dict."};
  app.add_option("--strategy", spec.strategy, "ddp, zero1, fsdp-full, fsdp-grad-op, ...")->capture_default_str();
  app.add_option("--out", out, "where rank 0 writes the state dict (none if empty)");
  app.add_option("--device", device, "cpu or cuda")->capture_default_str();
  app.add_option("--share-devices", share_devices, "yes: several ranks may share one GPU")->capture_default_str();
  app.add_option("--backend", backend, "auto, gloo, nccl or mpi")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    auto device_options =
        ddp::DeviceOptions().kind(ddp::parse_device_kind(device)).share_devices(share_devices == "yes");
    spec.device = ddp::init_device(ddp::world_from_env(), device_options);
    auto group = ddp::init_process_group(
        ddp::ProcessGroupOptions().device(spec.device).backend(ddp::parse_backend(backend)));
    auto result = ddp::testing::train(group, spec);
    if (group->rank() == 0 && !out.empty()) ddp::save_state_dict(result.state, out);
    group->barrier();
    std::printf("rank %d: fsdp_worker %s done\n", group->rank(), spec.strategy.c_str());
  } catch (const std::exception& e) {
    // Recorded for the launcher's root cause (TORCHELASTIC_ERROR_FILE).
    return ddp::report_failure(e);
  }
  return 0;
}
