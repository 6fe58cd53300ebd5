// The ddp program for tests in which a launcher must start the ranks
// (ddprun, torchrun, mpirun, ip netns exec): a tiny job that ends as the test
// needs. Tests that need no launcher run their ranks' code in the test file
// instead (support/ranks.h).
//
//   ddp_worker ready          every rank joins, all-reduces a one and prints
//                             "READY rank R of N sum N"
//   ddp_worker throw --rank R rank R throws; the others block in collectives
//   ddp_worker stall          rank 1 stops itself (SIGSTOP) after joining;
//                             rank 0's next collective must time out
//   ddp_worker train --strategy S --out FILE
//                             trains support/fsdp_trainers.h's model under S
//                             (ddp, zero1, fsdp-full, ...) and rank 0 writes
//                             the full state dict; --device cuda [--backend
//                             gloo --share-devices yes] on the GPU. The FSDP
//                             tests run the same code in-process.

#include "../support/fsdp_trainers.h"

#include <ddp/device.h>
#include <ddp/error_file.h>
#include <ddp/process_group.h>

#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace {

void ready() {
  auto group = ddp::init_process_group();
  at::Tensor one = at::ones({1});
  group->all_reduce(one);
  std::printf("READY rank %d of %d sum %g\n", group->rank(), group->size(), one.item<double>());
  group->barrier();
}

[[noreturn]] void throw_on_rank(int failing) {
  auto group = ddp::init_process_group();
  if (group->rank() == failing) throw std::runtime_error("deliberate failure on rank " + std::to_string(failing));
  // The others block in collectives that can never complete.
  for (;;) {
    at::Tensor t = at::ones({1});
    group->all_reduce(t);
  }
}

void stall() {
  auto group = ddp::init_process_group();
  group->barrier();
  if (group->rank() == 1) std::raise(SIGSTOP);
  at::Tensor t = at::ones({4});
  group->all_reduce(t);
  std::printf("NO TIMEOUT\n");
}

struct TrainFlags {
  ddp::testing::TrainSpec spec;
  std::string out, device = "cpu", share_devices = "no", backend = "auto";
};

void train(const TrainFlags& flags) {
  ddp::testing::TrainSpec spec = flags.spec;
  auto device_options =
      ddp::DeviceOptions().kind(ddp::parse_device_kind(flags.device)).share_devices(flags.share_devices == "yes");
  spec.device = ddp::init_device(ddp::world_from_env(), device_options);
  auto group = ddp::init_process_group(
      ddp::ProcessGroupOptions().device(spec.device).backend(ddp::parse_backend(flags.backend)));
  auto result = ddp::testing::train(group, spec);
  if (group->rank() == 0 && !flags.out.empty()) ddp::save_state_dict(result.state, flags.out);
  group->barrier();
  std::printf("rank %d: train %s done\n", group->rank(), spec.strategy.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"A ddp job for launcher tests; each scenario prints a marker line."};
  app.require_subcommand(1);
  app.add_subcommand("ready", "every rank joins, all-reduces a one and prints READY")->callback(ready);
  int failing_rank = 1;
  app.add_subcommand("throw", "one rank throws; the others block in collectives")
      ->callback([&] { throw_on_rank(failing_rank); })
      ->add_option("--rank", failing_rank, "the rank that throws")
      ->capture_default_str();
  app.add_subcommand("stall", "rank 1 stops itself after joining; rank 0's next collective times out")
      ->callback(stall);
  TrainFlags train_flags;
  CLI::App* training = app.add_subcommand("train", "trains one strategy and writes the full state dict");
  training->callback([&] { train(train_flags); });
  training->add_option("--strategy", train_flags.spec.strategy, "ddp, zero1, fsdp-full, fsdp-grad-op, fsdp-no-shard")
      ->capture_default_str();
  training->add_option("--out", train_flags.out, "where rank 0 writes the state dict (none if empty)");
  training->add_option("--device", train_flags.device, "cpu or cuda")->capture_default_str();
  training->add_option("--share-devices", train_flags.share_devices, "yes: several ranks may share one GPU")
      ->capture_default_str();
  training->add_option("--backend", train_flags.backend, "auto, gloo, nccl or mpi")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
  return 0;
}
