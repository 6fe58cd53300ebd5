#pragma once

// Command line of digits_ddp.

#include "digits_data.h"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

namespace digits {

struct Args {
  int64_t total_epochs = 0;
  int64_t save_every = 0;
  int64_t batch_size = 32;
  uint64_t seed = 0;  // shuffle seed; epoch e shuffles with seed + e
  std::string checkpoint_dir = ".";
  bool resume = true;  // continue from the newest snapshot in checkpoint_dir
  std::string metrics;  // empty: no metrics file
  std::string data = default_data_path();
  std::string backend = "auto";  // auto, gloo or mpi
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void print_usage(const char* program) {
  std::cerr << "usage: " << program << " TOTAL_EPOCHS SAVE_EVERY [options]\n"
            << "  TOTAL_EPOCHS           epochs to train (> 0)\n"
            << "  SAVE_EVERY             write model_E.pt and a snapshot when E % SAVE_EVERY == 0 (> 0)\n"
            << "  --batch-size N         samples per batch on each process (default 32)\n"
            << "  --seed N               shuffle seed; epoch E uses N + E (default 0)\n"
            << "  --checkpoint-dir DIR   where checkpoints and snapshots go (default .)\n"
            << "  --no-resume            ignore snapshots in DIR (default: resume from the newest)\n"
            << "  --backend NAME         auto (default: gloo), gloo or mpi (ranks started by mpirun)\n"
            << "  --metrics FILE         write one JSON line per epoch to FILE, appended to when\n"
            << "                         resuming (default none)\n"
            << "  --data FILE            rows of 64 pixels (0..16) then a label (0..9), gzip'd or\n"
            << "                         plain (default " << default_data_path() << ")\n"
            << "  -h, --help             show this help\n";
}

inline int64_t parse_positive(const std::string& what, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) {
    throw UsageError(what + " must be an integer, got '" + text + "'");
  }
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
    } else if (arg == "--batch-size") {
      args.batch_size = parse_positive("--batch-size", value());
    } else if (arg == "--seed") {
      std::string text = value();
      char* end = nullptr;
      errno = 0;
      args.seed = std::strtoull(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || text[0] == '-' || errno == ERANGE) {
        throw UsageError("--seed must be a non-negative integer, got '" + text + "'");
      }
    } else if (arg == "--checkpoint-dir") {
      args.checkpoint_dir = value();
    } else if (arg == "--no-resume") {
      args.resume = false;
    } else if (arg == "--metrics") {
      args.metrics = value();
    } else if (arg == "--backend") {
      args.backend = value();
      if (args.backend != "auto" && args.backend != "gloo" && args.backend != "mpi") {
        throw UsageError("--backend must be auto, gloo or mpi, got '" + args.backend + "'");
      }
    } else if (arg == "--data") {
      args.data = value();
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
  return args;
}

}  // namespace digits
