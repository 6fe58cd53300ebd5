#pragma once

// Command line of digits_ddp: the training flags every example has
// (../common/training_flags.h), and --data.

#include "../common/training_flags.h"
#include "digits_data.h"

#include <iostream>
#include <string>

namespace digits {

struct Args : examples::TrainingFlags {
  std::string data = default_data_path();
  std::string comm_hook = "allreduce";  // or fp16, bf16, powersgd
  int64_t powersgd_rank = 4;
  int64_t powersgd_start = 10;  // plain all-reduce for this many steps first
};

// Declares every flag of digits_ddp on `app`, bound to `args`.
inline void add_flags(CLI::App& app, Args& args) {
  examples::add_training_flags(app, args, {"auto", "gloo", "mpi"},
                               "auto (gloo), gloo or mpi (ranks started by mpirun)");
  app.add_option("--data", args.data, "rows of 64 pixels (0..16) then a label (0..9), gzip'd\nor plain")
      ->type_name("FILE");
  app.add_option("--comm-hook", args.comm_hook, "how gradients travel: allreduce, fp16, bf16 or powersgd")
      ->type_name("NAME")
      ->check(examples::one_of("--comm-hook", {"allreduce", "fp16", "bf16", "powersgd"}));
  app.add_option("--powersgd-rank", args.powersgd_rank, "PowerSGD's matrix approximation rank")
      ->type_name("R")
      ->transform(examples::positive_integer("--powersgd-rank"));
  app.add_option("--powersgd-start", args.powersgd_start, "steps of plain all-reduce before PowerSGD compresses")
      ->type_name("N")
      ->transform(examples::non_negative_integer("--powersgd-start"));
}

inline void print_usage(const char* program) {
  Args defaults;
  examples::CommandLine command_line("Trains a convnet on the 8x8 handwritten digits.", program);
  add_flags(command_line, defaults);
  std::cerr << command_line.help();
}

/// The command line, or a UsageError that says what is wrong with it.
inline Args parse_args(int argc, char** argv) {
  Args args;
  examples::CommandLine command_line("Trains a convnet on the 8x8 handwritten digits.", argv[0]);
  add_flags(command_line, args);
  command_line.read(argc, argv);
  return args;
}

}  // namespace digits
