#pragma once

// What rank 0 shows and records while training: a progress line (epoch, step,
// loss, samples/s, ETA) and one JSON line of metrics per epoch.
//
//   ddp::ProgressLine progress(total_epochs, steps_per_epoch);
//   ddp::MetricsWriter metrics(path);               // --metrics FILE
//   for (epoch ...) {
//     progress.start_epoch(epoch);
//     for (batch ...) { ...; progress.step(loss.item<double>(), global_batch_size); }
//     progress.end_epoch();
//     metrics.write({epoch, epoch_loss, accuracy, progress.epoch_samples_per_second(), progress.elapsed_seconds()});
//   }

#include <ddp/export.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace ddp {

using OutputStream = std::FILE*;  // one token, for TORCH_ARG

/// How the progress line is shown.
struct ProgressOptions {
  /// Where to draw; stdout by default.
  TORCH_ARG(OutputStream, stream) = stdout;
  /// Redraw in place with '\r' (a terminal), or print plain lines. Unset:
  /// decided by isatty(); DDP_PROGRESS=terminal|plain|off overrides.
  TORCH_ARG(std::optional<bool>, terminal) = std::nullopt;
  /// On a terminal, redraw at most this often.
  TORCH_ARG(std::chrono::milliseconds, redraw_interval) = std::chrono::milliseconds(200);
  /// Not on a terminal, print a plain line at most this often, so short runs
  /// print none and long ones leave a readable log.
  TORCH_ARG(std::chrono::milliseconds, plain_interval) = std::chrono::seconds(30);
  /// Show nothing (other ranks).
  TORCH_ARG(bool, enabled) = true;
};

/// Rank 0's progress display; see ProgressOptions for where and how.
class DDP_API ProgressLine {
 public:
  /// A run of `total_epochs` epochs of `steps_per_epoch` optimizer steps.
  ProgressLine(int64_t total_epochs, int64_t steps_per_epoch, ProgressOptions options = {});
  ~ProgressLine();

  /// `first_epoch` > 0 when resuming: the ETA counts only what is left.
  void start_epoch(int64_t epoch);
  /// One optimizer step over `samples` samples (all ranks together).
  void step(double loss, int64_t samples);
  /// Ends the epoch; on a terminal, clears the line so the caller's own
  /// per-epoch output starts on a clean line.
  void end_epoch();

  /// The current line, e.g. "epoch 3/100 | step 4/5 | loss 0.1234 | 1234 samples/s | ETA 0:12".
  std::string render() const;
  double samples_per_second() const;        ///< over the whole run so far
  double epoch_samples_per_second() const;  ///< over the current (or last) epoch
  double eta_seconds() const;      ///< until the last epoch ends, from the pace so far
  double elapsed_seconds() const;  ///< since the first start_epoch()

 private:
  void draw(bool force);
  using Clock = std::chrono::steady_clock;

  int64_t total_epochs_;
  int64_t steps_per_epoch_;
  ProgressOptions options_;
  bool terminal_ = false;
  bool visible_ = false;  // a line is drawn and not yet cleared
  Clock::time_point run_start_, epoch_start_, last_draw_;
  int64_t epoch_ = 0;
  int64_t first_epoch_ = -1;
  int64_t step_in_epoch_ = 0;
  int64_t steps_done_ = 0;  // since this process started
  int64_t samples_done_ = 0;
  int64_t epoch_samples_ = 0;
  double loss_sum_ = 0;     // this epoch
  double epoch_seconds_ = 0;
};

/// One epoch's record for --metrics files.
struct EpochMetrics {
  int64_t epoch = 0;
  double loss = 0;
  std::optional<double> test_accuracy;
  double samples_per_second = 0;
  double wall_time_seconds = 0;
};

/// Appends one JSON object per line to a file, flushed after each line:
///   {"epoch": 3, "loss": 0.1234, "test_accuracy": null, "samples_per_s": 1234.5, "wall_time_s": 1.25}
/// An empty path writes nothing, so callers need no special case. A loss or
/// rate that is NaN or infinite is written as null, which JSON readers accept.
class DDP_API MetricsWriter {
 public:
  /// Opens `path` (truncated, or appended to when resuming); throws naming
  /// the path if it cannot.
  explicit MetricsWriter(const std::string& path = "", bool append = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  /// Appends one line and flushes it.
  void write(const EpochMetrics& metrics);
  /// The line write() appends, without its newline.
  static std::string to_json(const EpochMetrics& metrics);

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace ddp
