#pragma once

// Command line of the Wine examples, shared so that wine_single and wine_ddp
// differ only in what DDP itself asks of a program.

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

namespace wine {

struct Args {
  int64_t total_epochs = 0;
  int64_t save_every = 0;
  int64_t batch_size = 32;
  uint64_t seed = 0;  // shuffle seed; epoch e shuffles with seed + e
  std::string train_csv;
  std::string test_csv;
  std::string init_state;
  std::string checkpoint_dir = ".";
  bool resume = true;  // continue from the newest snapshot in checkpoint_dir
  std::string on_nonfinite = "abort";  // or "skip" (wine_ddp)
  std::string metrics;                 // JSON lines per epoch (wine_ddp)
  std::string strategy = "ddp";        // ddp, zero1, fsdp-full, fsdp-grad-op (wine_sharded)
  bool strategy_given = false;
  int64_t workers = 0;                 // data-loader worker threads (wine_ddp, wine_sharded)
  std::string device = "cpu";          // cpu, cuda or auto
  std::string backend = "auto";        // auto, gloo, nccl or mpi (wine_ddp, wine_sharded)
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void print_usage(const char* program) {
  std::cerr << "usage: " << program << " TOTAL_EPOCHS SAVE_EVERY [options]\n"
            << "  TOTAL_EPOCHS           epochs to train (> 0)\n"
            << "  SAVE_EVERY             write model_E.pt when E % SAVE_EVERY == 0 (> 0)\n"
            << "  --batch-size N         samples per batch on each process (default 32)\n"
            << "  --seed N               shuffle seed; epoch E uses N + E (default 0)\n"
            << "  --train CSV --test CSV use these files instead of the shipped split\n"
            << "                         (rows: 13 features, then an integer label)\n"
            << "  --init FILE            start from a state dict saved by Python's torch.save\n"
            << "  --checkpoint-dir DIR   where checkpoints and snapshots go (default .)\n"
            << "  --no-resume            ignore snapshots in DIR (default: resume from the newest)\n"
            << "  --on-nonfinite abort|skip  when any rank's loss is NaN/inf: stop, or skip the\n"
            << "                         step on every rank (default abort; wine_ddp only)\n"
            << "  --metrics FILE         write one JSON line per epoch to FILE (wine_ddp only;\n"
            << "                         default none)\n"
            << "  --workers N            data-loader worker threads (default 0: load in the training\n"
            << "                         thread; wine_ddp and wine_sharded)\n"
            << "  --strategy NAME        ddp (default), zero1 (Adam's state sharded), fsdp-full or\n"
            << "                         fsdp-grad-op (FullyShardedDataParallel; wine_sharded only)\n"
            << "  --backend NAME         auto (default: nccl for --device cuda, else gloo), gloo, nccl, or\n"
            << "                         mpi (ranks started by mpirun; wine_ddp and wine_sharded)\n"
            << "  --device cpu|cuda|auto train on the CPU (default), on this rank's GPU (cuda:LOCAL_RANK,\n"
            << "                         NCCL for wine_ddp), or on the GPU when there is one\n"
            << "  -h, --help             show this help\n";
}

inline int64_t parse_positive(const std::string& what, const std::string& text) {
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0') throw UsageError(what + " must be an integer, got '" + text + "'");
  if (value <= 0) throw UsageError(what + " must be positive, got " + text);
  return value;
}

inline Args parse_args(int argc, char** argv) {
  Args args;
  int positional = 0;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      print_usage(argv[0]);
      std::exit(0);
    } else if (arg == "--batch-size" || arg == "--batch_size") {
      args.batch_size = parse_positive("--batch-size", value());
    } else if (arg == "--seed") {
      std::string text = value();
      char* end = nullptr;
      args.seed = std::strtoull(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0') throw UsageError("--seed must be a non-negative integer, got '" + text + "'");
    } else if (arg == "--train") {
      args.train_csv = value();
    } else if (arg == "--test") {
      args.test_csv = value();
    } else if (arg == "--init") {
      args.init_state = value();
    } else if (arg == "--checkpoint-dir") {
      args.checkpoint_dir = value();
    } else if (arg == "--no-resume") {
      args.resume = false;
    } else if (arg == "--metrics") {
      args.metrics = value();
    } else if (arg == "--strategy") {
      std::string strategy = value();
      if (strategy != "ddp" && strategy != "zero1" && strategy != "fsdp-full" && strategy != "fsdp-grad-op") {
        throw UsageError("--strategy must be ddp, zero1, fsdp-full or fsdp-grad-op, got '" + strategy + "'");
      }
      args.strategy = strategy;
      args.strategy_given = true;
    } else if (arg == "--workers") {
      std::string text = value();
      args.workers = text == "0" ? 0 : parse_positive("--workers", text);
    } else if (arg == "--device") {
      std::string device = value();
      if (device != "cpu" && device != "cuda" && device != "auto") {
        throw UsageError("--device must be cpu, cuda or auto, got '" + device + "'");
      }
      args.device = device;
    } else if (arg == "--backend") {
      std::string backend = value();
      if (backend != "auto" && backend != "gloo" && backend != "nccl" && backend != "mpi") {
        throw UsageError("--backend must be auto, gloo, nccl or mpi, got '" + backend + "'");
      }
      args.backend = backend;
    } else if (arg == "--on-nonfinite") {
      std::string policy = value();
      if (policy != "abort" && policy != "skip") throw UsageError("--on-nonfinite must be abort or skip, got '" + policy + "'");
      args.on_nonfinite = policy;
    } else if (arg.size() > 1 && arg[0] == '-' && !std::isdigit(static_cast<unsigned char>(arg[1]))) {
      throw UsageError("unknown option " + arg);
    } else if (positional == 0) {
      args.total_epochs = parse_positive("TOTAL_EPOCHS", arg);
      ++positional;
    } else if (positional == 1) {
      args.save_every = parse_positive("SAVE_EVERY", arg);
      ++positional;
    } else {
      throw UsageError("unexpected argument '" + arg + "'");
    }
  }
  if (positional < 2) throw UsageError("TOTAL_EPOCHS and SAVE_EVERY are required");
  if (args.train_csv.empty() != args.test_csv.empty()) {
    throw UsageError("--train and --test must be given together");
  }
  return args;
}

}  // namespace wine
