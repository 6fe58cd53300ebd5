#include <ddp/progress.h>

#include <ddp/error.h>

#include "common/duration_text.h"
#include "common/json_text.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ddp {
namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The DDP_PROGRESS override: "terminal", "plain" or "off".
std::optional<std::string> progress_override() {
  const char* mode = std::getenv("DDP_PROGRESS");
  if (mode == nullptr || *mode == '\0') return std::nullopt;
  std::string m(mode);
  DDP_CHECK(m == "terminal" || m == "plain" || m == "off", "ddp: DDP_PROGRESS='", m,
              "' must be terminal, plain or off");
  return m;
}

}  // namespace

ProgressLine::ProgressLine(int64_t total_epochs, int64_t steps_per_epoch, ProgressOptions options)
    : total_epochs_(total_epochs), steps_per_epoch_(steps_per_epoch), options_(options) {
  DDP_CHECK(total_epochs > 0 && steps_per_epoch > 0, "ddp: ProgressLine needs positive epoch and step counts");
  auto mode = progress_override();
  if (mode && *mode == "off") options_.enabled(false);
  if (mode && *mode != "off") {
    terminal_ = *mode == "terminal";
  } else if (options_.terminal()) {
    terminal_ = *options_.terminal();
  } else {
    terminal_ = options_.stream() != nullptr && isatty(fileno(options_.stream()));
  }
  run_start_ = epoch_start_ = last_draw_ = Clock::now();
}

ProgressLine::~ProgressLine() {
  if (visible_ && options_.enabled()) std::fputs("\n", options_.stream());
}

void ProgressLine::start_epoch(int64_t epoch) {
  if (first_epoch_ < 0) {
    first_epoch_ = epoch;
    run_start_ = last_draw_ = Clock::now();
  }
  epoch_ = epoch;
  step_in_epoch_ = 0;
  epoch_samples_ = 0;
  loss_sum_ = 0;
  epoch_start_ = Clock::now();
}

void ProgressLine::step(double loss, int64_t samples) {
  ++step_in_epoch_;
  ++steps_done_;
  samples_done_ += samples;
  epoch_samples_ += samples;
  loss_sum_ += loss;
  epoch_seconds_ = seconds_between(epoch_start_, Clock::now());
  draw(false);
}

void ProgressLine::end_epoch() {
  epoch_seconds_ = seconds_between(epoch_start_, Clock::now());
  if (!options_.enabled()) return;
  if (terminal_ && visible_) {
    // Erase the line: the program's own epoch summary goes there.
    std::fputs("\r\033[2K", options_.stream());
    std::fflush(options_.stream());
    visible_ = false;
  }
}

double ProgressLine::elapsed_seconds() const { return seconds_between(run_start_, Clock::now()); }

double ProgressLine::samples_per_second() const {
  double t = elapsed_seconds();
  return t > 0 ? samples_done_ / t : 0;
}

double ProgressLine::epoch_samples_per_second() const {
  return epoch_seconds_ > 0 ? epoch_samples_ / epoch_seconds_ : 0;
}

double ProgressLine::eta_seconds() const {
  if (steps_done_ == 0) return NAN;
  int64_t total_steps_left =
      (total_epochs_ - epoch_ - 1) * steps_per_epoch_ + std::max<int64_t>(0, steps_per_epoch_ - step_in_epoch_);
  return elapsed_seconds() / static_cast<double>(steps_done_) * static_cast<double>(total_steps_left);
}

std::string ProgressLine::render() const {
  double loss = step_in_epoch_ > 0 ? loss_sum_ / static_cast<double>(step_in_epoch_) : NAN;
  return fmt::format("epoch {}/{} | step {}/{} | loss {:.4f} | {:.0f} samples/s | ETA {}", epoch_ + 1, total_epochs_,
                     step_in_epoch_, steps_per_epoch_, loss, samples_per_second(),
                     detail::format_duration(eta_seconds()));
}

void ProgressLine::draw(bool force) {
  if (!options_.enabled()) return;
  auto now = Clock::now();
  auto interval = terminal_ ? options_.redraw_interval() : options_.plain_interval();
  if (!force && now - last_draw_ < interval) return;
  last_draw_ = now;
  if (terminal_) {
    std::fprintf(options_.stream(), "\r\033[2K%s", render().c_str());
    visible_ = true;
  } else {
    std::fprintf(options_.stream(), "%s\n", render().c_str());
  }
  std::fflush(options_.stream());
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  if (path.empty()) return;
  // O_NOFOLLOW: in a shared run directory a link planted at the metrics
  // file's name would have the job write into whatever it points to.
  const int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
  const int fd = ::open(path.c_str(), flags, 0644);
  DDP_CHECK(fd >= 0 || errno != ELOOP, "ddp: refusing to write the metrics file '", path,
            "': it is a symbolic link; give the file's own path, or remove the link");
  DDP_CHECK(fd >= 0, "ddp: cannot open metrics file '", path, "': ", std::strerror(errno));
  file_ = ::fdopen(fd, append ? "a" : "w");
  if (file_ == nullptr) ::close(fd);
  DDP_CHECK(file_ != nullptr, "ddp: cannot open metrics file '", path, "': ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

std::string MetricsWriter::to_json(const EpochMetrics& m) {
  const detail::OrderedJson row = {
      {"epoch", m.epoch},
      {"loss", m.loss},
      {"test_accuracy", m.test_accuracy ? detail::OrderedJson(*m.test_accuracy) : detail::OrderedJson(nullptr)},
      {"samples_per_s", m.samples_per_second},
      {"wall_time_s", m.wall_time_seconds},
  };
  return detail::python_style_json(row);
}

void MetricsWriter::write(const EpochMetrics& metrics) {
  if (!file_) return;
  std::string line = to_json(metrics) + "\n";
  DDP_CHECK(std::fputs(line.c_str(), file_) >= 0 && std::fflush(file_) == 0, "ddp: writing metrics file '",
              path_, "' failed: ", std::strerror(errno));
}

}  // namespace ddp
