#pragma once

// The command line every training example shares (wine_single, wine_ddp,
// wine_sharded, digits_ddp): TOTAL_EPOCHS SAVE_EVERY, then the flags for the
// batch, the shuffle, checkpoints, metrics and the backend. Each program adds
// its own flags after these.

#include "command_line.h"

#include <cstdint>
#include <string>
#include <vector>

namespace examples {

struct TrainingFlags {
  int64_t total_epochs = 0;
  int64_t save_every = 0;
  int64_t batch_size = 32;
  uint64_t seed = 0;  // shuffle seed; epoch e shuffles with seed + e
  std::string checkpoint_dir = ".";
  bool resume = true;    // continue from the newest snapshot in checkpoint_dir
  std::string metrics;   // JSON lines per epoch; empty: none
  std::string backend = "auto";
};

/// Declares the positionals and flags of TrainingFlags on `app`, bound to
/// `flags`. `backends` are the --backend values the program takes, and
/// `backend_help` says what they mean there.
inline void add_training_flags(CLI::App& app, TrainingFlags& flags, const std::vector<std::string>& backends,
                               const std::string& backend_help) {
  app.add_option("TOTAL_EPOCHS", flags.total_epochs, "epochs to train (> 0)")
      ->required()
      ->transform(positive_integer("TOTAL_EPOCHS"));
  app.add_option("SAVE_EVERY", flags.save_every,
                 "write model_E.pt, and a snapshot to resume from, when\nE % SAVE_EVERY == 0 (> 0)")
      ->required()
      ->transform(positive_integer("SAVE_EVERY"));
  app.add_option("--batch-size", flags.batch_size, "samples per batch on each process")
      ->type_name("N")
      ->transform(positive_integer("--batch-size"));
  app.add_option("--seed", flags.seed, "shuffle seed; epoch E shuffles with N + E")
      ->type_name("N")
      ->transform(non_negative_integer("--seed"));
  app.add_option("--checkpoint-dir", flags.checkpoint_dir, "where checkpoints and snapshots go")->type_name("DIR");
  app.add_flag_callback(
      "--no-resume", [&flags] { flags.resume = false; },
      "ignore the snapshots in DIR (default: resume from the newest)");
  app.add_option("--metrics", flags.metrics, "write one JSON line per epoch to FILE, appended to when\nresuming")
      ->type_name("FILE")
      ->default_str("none");
  app.add_option("--backend", flags.backend, backend_help)->type_name("NAME")->check(one_of("--backend", backends));
}

}  // namespace examples
