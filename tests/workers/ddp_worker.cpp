// The ddp program for tests in which a launcher must start the ranks
// (ddprun, torchrun, ip netns exec): a tiny job that ends as the test needs.
// Tests that need no launcher run their ranks' code in the test file instead
// (support/ranks.h), and so does the MPI test (under mpirun).
//
//   ddp_worker ready          every rank joins, all-reduces a one and prints
//                             "READY rank R of N sum N"
//   ddp_worker throw --rank R rank R throws; the others block in collectives
//   ddp_worker stall          rank 1 stops itself (SIGSTOP) after joining;
//                             rank 0's next collective must time out

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
