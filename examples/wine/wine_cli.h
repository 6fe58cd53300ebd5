#pragma once

// Command line of the Wine examples, shared so that wine_single and wine_ddp
// differ only in what DDP itself asks of a program: the training flags every
// example has (../common/training_flags.h), and the Wine ones.

#include "../common/training_flags.h"

#include <iostream>
#include <string>

namespace wine {

struct Args : examples::TrainingFlags {
  std::string train_csv;
  std::string test_csv;
  std::string init_state;
  std::string on_nonfinite = "abort";  // or "skip" (wine_ddp, wine_sharded)
  std::string strategy = "ddp";        // ddp, zero1, fsdp-full, fsdp-grad-op, hsdp, hsdp-grad-op (wine_sharded)
  bool strategy_given = false;
  int64_t workers = 0;                 // data-loader worker threads (wine_ddp, wine_sharded)
  std::string device = "cpu";          // cpu, cuda or auto
  // wine_sharded's sharded snapshots: also every N steps (0: at epoch ends
  // only), the newest K kept; and each rank's samples, per step.
  int64_t snapshot_every_steps = 0;
  int64_t keep_snapshots = 2;
  std::string sample_log;
};

// Declares every flag of the Wine programs on `app`, bound to `args`.
inline void add_flags(CLI::App& app, Args& args) {
  examples::add_training_flags(
      app, args, {"auto", "gloo", "shm", "nccl", "mpi"},
      "auto (nccl for --device cuda, else shared memory when every\n"
      "rank is on one host, else gloo), gloo, shm, nccl, or\n"
      "mpi (ranks started by mpirun); wine_ddp and wine_sharded");
  // The spelling of the first releases.
  app.add_option("--batch_size", args.batch_size, "the same as --batch-size")
      ->type_name("N")
      ->transform(examples::positive_integer("--batch-size"));
  app.add_option("--train", args.train_csv,
                 "train on these rows instead of the shipped split\n"
                 "(rows: 13 features, then an integer label); needs --test")
      ->type_name("CSV")
      ->default_str("80% of the shipped data");
  app.add_option("--test", args.test_csv, "test on these rows; needs --train")
      ->type_name("CSV")
      ->default_str("the other 20%");
  app.add_option("--init", args.init_state, "start from a state dict saved by Python's torch.save")
      ->type_name("FILE")
      ->default_str("none");
  app.add_option("--on-nonfinite", args.on_nonfinite,
                 "when any rank's loss is NaN/inf: stop, or skip the step\non every rank (wine_ddp, wine_sharded)")
      ->type_name("abort|skip")
      ->check(examples::one_of("--on-nonfinite", {"abort", "skip"}));
  app.add_option("--workers", args.workers,
                 "data-loader worker threads; 0 loads in the training\nthread (wine_ddp, wine_sharded)")
      ->type_name("N")
      ->transform(examples::non_negative_integer("--workers"));
  app.add_option("--strategy", args.strategy,
                 "ddp, zero1 (Adam's state sharded), fsdp-full,\n"
                 "fsdp-grad-op (FullyShardedDataParallel), hsdp or\n"
                 "hsdp-grad-op (sharded within a node, replicated\n"
                 "across nodes); wine_sharded only")
      ->type_name("NAME")
      ->check(examples::one_of("--strategy",
                               {"ddp", "zero1", "fsdp-full", "fsdp-grad-op", "hsdp", "hsdp-grad-op"}));
  app.add_option("--device", args.device,
                 "the CPU, this rank's GPU (cuda:LOCAL_RANK; NCCL for\nwine_ddp), or the GPU when there is one")
      ->type_name("cpu|cuda|auto")
      ->check(examples::one_of("--device", {"cpu", "cuda", "auto"}));
  app.add_option("--snapshot-every-steps", args.snapshot_every_steps,
                 "also write a sharded snapshot every N optimizer steps,\nmid-epoch too (wine_sharded)")
      ->type_name("N")
      ->default_str("0: at epoch ends only")
      ->transform(examples::non_negative_integer("--snapshot-every-steps"));
  app.add_option("--keep-snapshots", args.keep_snapshots, "sharded snapshots kept, newest first; 0 keeps all\n(wine_sharded)")
      ->type_name("K")
      ->transform(examples::non_negative_integer("--keep-snapshots"));
  app.add_option("--sample-log", args.sample_log,
                 "each rank appends 'epoch step world index...' per step to\nPREFIX.rank<R> (wine_sharded)")
      ->type_name("PREFIX")
      ->default_str("none");
}

inline void print_usage(const char* program) {
  Args defaults;
  examples::CommandLine command_line("Trains the Wine classifier.", program);
  add_flags(command_line, defaults);
  std::cerr << command_line.help();
}

/// The command line, or a UsageError that says what is wrong with it.
inline Args parse_args(int argc, char** argv) {
  Args args;
  examples::CommandLine command_line("Trains the Wine classifier.", argv[0]);
  add_flags(command_line, args);
  command_line.read(argc, argv);
  args.strategy_given = command_line.count("--strategy") > 0;
  if (args.train_csv.empty() != args.test_csv.empty()) {
    throw examples::UsageError("--train and --test must be given together");
  }
  return args;
}

}  // namespace wine
