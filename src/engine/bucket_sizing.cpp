#include "engine/bucket_sizing.h"

#include <ddp/collective_trace.h>
#include <ddp/error.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>

namespace ddp::detail {
namespace {

constexpr size_t kMiB = 1024 * 1024;
constexpr size_t kDefaultFirstBucketBytes = kMiB;   // PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES
constexpr size_t kDefaultBucketBytes = 25 * kMiB;  // PyTorch's bucket_cap_mb default
constexpr size_t kSmallestCap = kMiB;
constexpr size_t kLargestCap = 256 * kMiB;

std::optional<LinkMeasurement>& injected_measurement() {
  static std::optional<LinkMeasurement> injected;
  return injected;
}

size_t mib_to_bytes(double mib) { return static_cast<size_t>(mib * static_cast<double>(kMiB)); }

size_t bytes_of(const BucketTensorInfo& info) {
  return static_cast<size_t>(info.numel) * c10::elementSize(info.dtype);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Every thread of this process: the backend's own threads count.
double process_cpu_s() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Timing {
  double wall_s = INFINITY;
  double cpu_s = 0;
};

// The fastest of `repeats` all-reduces of `tensor` (the others were slowed by
// something else: a page fault, the other rank arriving late), with the CPU
// time this process spent in it.
Timing fastest_all_reduce(ProcessGroup& group, at::Tensor tensor, int repeats) {
  Timing best;
  for (int r = 0; r < repeats; ++r) {
    const double cpu_start = process_cpu_s();
    auto start = std::chrono::steady_clock::now();
    group.all_reduce(tensor);
    const double wall = seconds_since(start);
    if (wall < best.wall_s) best = {wall, process_cpu_s() - cpu_start};
  }
  return best;
}

}  // namespace

BucketCaps bucket_caps_of(std::optional<double> bucket_cap_mb, std::optional<double> first_bucket_cap_mb) {
  DDP_CHECK(!bucket_cap_mb || *bucket_cap_mb > 0, "ddp: DDPOptions::bucket_cap_mb must be positive, got ",
            *bucket_cap_mb, "; leave it unset to fit buckets to the link");
  DDP_CHECK(!first_bucket_cap_mb || *first_bucket_cap_mb > 0,
            "ddp: DDPOptions::first_bucket_cap_mb must be positive, got ", *first_bucket_cap_mb,
            "; leave it unset for PyTorch's rule");
  BucketCaps caps;
  caps.fit_to_link = !bucket_cap_mb;
  caps.bytes = bucket_cap_mb ? mib_to_bytes(*bucket_cap_mb) : kDefaultBucketBytes;
  if (first_bucket_cap_mb) {
    caps.first_bytes = mib_to_bytes(*first_bucket_cap_mb);
  } else {
    caps.first_bytes = bucket_cap_mb ? caps.bytes : kDefaultFirstBucketBytes;
  }
  return caps;
}

double exposed_communication_s(const std::vector<BucketTensorInfo>& params, const std::vector<size_t>& visit_order,
                               const std::vector<std::vector<size_t>>& assignment, const LinkMeasurement& link) {
  double total = 0;
  for (const auto& info : params) total += static_cast<double>(bytes_of(info));
  std::vector<double> ready_at(params.size(), 0.0);
  double visited = 0;
  for (size_t k : visit_order) {
    visited += static_cast<double>(bytes_of(params[k]));
    ready_at[k] = total > 0 ? link.backward_s * visited / total : 0.0;
  }
  const double on_cpu = std::clamp(link.cpu_share, 0.0, 1.0);
  double link_free_at = 0, cpu_bound = 0;
  for (const auto& bucket : assignment) {
    double ready = 0, bytes = 0;
    for (size_t k : bucket) {
      ready = std::max(ready, ready_at[k]);
      bytes += static_cast<double>(bytes_of(params[k]));
    }
    const double all_reduce_s = link.latency_s + bytes * link.seconds_per_byte;
    link_free_at = std::max(link_free_at, ready) + (1 - on_cpu) * all_reduce_s;
    cpu_bound += on_cpu * all_reduce_s;
  }
  const double launches_after_the_first = assignment.empty() ? 0.0 : static_cast<double>(assignment.size() - 1);
  return std::max(0.0, link_free_at - link.backward_s) + cpu_bound + launches_after_the_first * link.latency_s;
}

size_t fit_bucket_cap_bytes(const std::vector<BucketTensorInfo>& params, const std::vector<size_t>& visit_order,
                            size_t first_bucket_cap_bytes, const LinkMeasurement& link) {
  size_t total = 0;
  for (const auto& info : params) total += bytes_of(info);
  const bool usable = std::isfinite(link.latency_s) && std::isfinite(link.seconds_per_byte) &&
                      std::isfinite(link.backward_s) && std::isfinite(link.cpu_share) &&
                      link.seconds_per_byte > 0 && link.latency_s >= 0 && link.backward_s >= 0;
  if (total == 0 || !usable) return kDefaultBucketBytes;
  // About 1.5x apart: 1, 1.5, 2, 3, 4, 6, ... 192, 256 MiB.
  std::vector<size_t> candidates;
  for (size_t cap = kSmallestCap; cap <= kLargestCap; cap *= 2) {
    candidates.push_back(cap);
    if (cap < kLargestCap) candidates.push_back(cap * 3 / 2);
  }
  std::vector<double> exposed;
  for (size_t cap : candidates) {
    exposed.push_back(exposed_communication_s(
        params, visit_order, compute_bucket_assignment(params, visit_order, first_bucket_cap_bytes, cap), link));
  }
  const double least = *std::min_element(exposed.begin(), exposed.end());
  const double good_enough = least * 1.02 + link.latency_s;
  size_t chosen = candidates.front();
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (exposed[i] <= good_enough) chosen = candidates[i];
  }
  return chosen;
}

bool bucket_cap_matters(const std::vector<BucketTensorInfo>& params, const std::vector<size_t>& visit_order,
                        size_t first_bucket_cap_bytes) {
  return compute_bucket_assignment(params, visit_order, first_bucket_cap_bytes, kSmallestCap) !=
         compute_bucket_assignment(params, visit_order, first_bucket_cap_bytes, kLargestCap);
}

LinkMeasurement measure_link(ProcessGroup& group, const at::TensorOptions& options, size_t gradient_bytes,
                             double backward_s) {
  LinkMeasurement mine;
  if (injected_measurement()) {
    mine = *injected_measurement();
  } else {
    CollectiveTag tag("ddp bucket sizing probe");
    const size_t large_bytes = std::clamp<size_t>(gradient_bytes, 64 * 1024, 4 * kMiB);
    at::Tensor small = at::zeros({1024}, options.dtype(at::kFloat));
    at::Tensor large = at::zeros({static_cast<int64_t>(large_bytes / sizeof(float))}, options.dtype(at::kFloat));
    group.all_reduce(small);  // connections and buffers warm, untimed
    mine.latency_s = fastest_all_reduce(group, small, 5).wall_s;
    const Timing timed = fastest_all_reduce(group, large, 2);
    // A floor of 1 ns per GB: a bandwidth too high to measure still counts.
    mine.seconds_per_byte = std::max((timed.wall_s - mine.latency_s) / static_cast<double>(large_bytes), 1e-18);
    mine.backward_s = backward_s;
    mine.cpu_share = options.device().is_cpu() && timed.wall_s > 0 ? std::min(1.0, timed.cpu_s / timed.wall_s) : 0.0;
  }
  at::Tensor figures = at::empty({4}, at::kDouble);
  figures[0] = mine.latency_s;
  figures[1] = mine.seconds_per_byte;
  figures[2] = mine.backward_s;
  figures[3] = mine.cpu_share;
  at::Tensor sent = group.to_control(figures);
  {
    CollectiveTag tag("ddp bucket sizing figures");
    group.all_reduce(sent, c10d::ReduceOp::MAX);
  }
  figures = sent.cpu();
  const double* agreed = figures.data_ptr<double>();
  return {agreed[0], agreed[1], agreed[2], agreed[3]};
}

void set_link_measurement_for_testing(std::optional<LinkMeasurement> measurement) {
  injected_measurement() = measurement;
}

}  // namespace ddp::detail
