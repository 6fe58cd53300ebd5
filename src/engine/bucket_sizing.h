#pragma once

// Internal to the library, not installed: how big DDP's buckets are. The caps
// the user's options give (PyTorch's first-bucket rule), and, when the user
// gives none, the cap fitted to the link after the first iteration. The rules
// are pure functions, unit-tested without processes; measure_link() is the
// one part that talks to the group.
//
// The fitted cap, and why. Communication that overlaps backward costs
// nothing; what a step pays is the communication still running when
// backward ends. So the cap is the one that minimises a model of that:
//  * backward makes gradients at a steady rate: a parameter's gradient is
//    ready at backward_s times the share of the gradient bytes visited up to
//    it, in the first iteration's order (the order the buckets are rebuilt
//    in);
//  * the buckets are compute_bucket_assignment()'s for that order and cap;
//    they are all-reduced one at a time in launch order, each starting when
//    it is ready and the one before it is done, and taking
//    latency_s + bytes * seconds_per_byte;
//  * exposed = when the last all-reduce ends - backward_s, plus latency_s
//    for every bucket after the first (each launch also costs the ranks'
//    CPUs, which on CPU ranks is backward's time);
//  * communication that keeps this rank's CPU busy (cpu_share of its time:
//    shared memory, loopback, a backend that works in the caller's thread)
//    does not hide behind a CPU backward, which needs those cores: that
//    share of every all-reduce counts as exposed, and only the rest runs in
//    the queue above. So a local link gets few large buckets.
// Candidates run from 1 to 256 MiB in steps of about 1.5x; the largest whose
// exposed time is within 2% (and one latency) of the least wins, since fewer
// buckets cost less than the model says. So a slow link with a long backward
// gets a few MiB (each bucket starts early and the last one is short), a
// fast link or a short backward (or no overlap, backward_s = 0) gets few
// large buckets, and a model smaller than the first bucket stays one bucket.

#include <ddp/process_group.h>

#include "engine/bucket_assignment.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <optional>
#include <vector>

namespace ddp::detail {

/// The caps to build buckets with, from DDPOptions's bucket_cap_mb and
/// first_bucket_cap_mb (either may be unset).
struct BucketCaps {
  size_t first_bytes = 0;
  size_t bytes = 0;
  /// No bucket_cap_mb: `bytes` is the first iteration's (25 MiB) and is to
  /// be fitted to the link when buckets are rebuilt.
  bool fit_to_link = false;
};

/// PyTorch's rules: bucket_cap_mb set makes it the cap of every bucket, the
/// first included, unless first_bucket_cap_mb is set too; unset, the first
/// bucket is 1 MiB and the rest 25 MiB until fitted. Rejects caps <= 0.
BucketCaps bucket_caps_of(std::optional<double> bucket_cap_mb, std::optional<double> first_bucket_cap_mb);

/// What the rule needs to know of the link and the backward pass.
struct LinkMeasurement {
  /// A small all-reduce, start to end.
  double latency_s = 0;
  /// A large all-reduce's time beyond its latency, per byte of the tensor.
  double seconds_per_byte = 0;
  /// From the first gradient ready to the last, in the first iteration; 0
  /// when buckets wait for the end of backward (overlap_with_backward off).
  double backward_s = 0;
  /// Share of a large all-reduce's time during which this process used a
  /// CPU (its CPU time over the wall time, at most 1); 0 for GPU tensors,
  /// whose backward does not run on the CPU.
  double cpu_share = 0;
};

/// The model's exposed communication (see the top of this file) for the
/// buckets `assignment` of `params` visited in `visit_order`.
double exposed_communication_s(const std::vector<BucketTensorInfo>& params, const std::vector<size_t>& visit_order,
                               const std::vector<std::vector<size_t>>& assignment, const LinkMeasurement& link);

/// The fitted cap in bytes of every bucket after the first (the first keeps
/// `first_bucket_cap_bytes`). A degenerate measurement (no bandwidth
/// figure, no gradients) gives PyTorch's 25 MiB.
size_t fit_bucket_cap_bytes(const std::vector<BucketTensorInfo>& params, const std::vector<size_t>& visit_order,
                            size_t first_bucket_cap_bytes, const LinkMeasurement& link);

/// Whether any cap the rule could choose changes the buckets: not when every
/// gradient fits in the first bucket (each cap then gives one bucket), so
/// the link need not be measured at all.
bool bucket_cap_matters(const std::vector<BucketTensorInfo>& params, const std::vector<size_t>& visit_order,
                        size_t first_bucket_cap_bytes);

/// Measures `group`'s all-reduce with tensors of `options` (a small one for
/// the latency, one of min(max(gradient_bytes, 64 KiB), 4 MiB) for the
/// bandwidth), adds `backward_s`, and returns the figures every rank agrees
/// on: each one's maximum over the ranks (the slowest rank sets the pace).
/// Collective.
LinkMeasurement measure_link(ProcessGroup& group, const at::TensorOptions& options, size_t gradient_bytes,
                             double backward_s);

/// Test seam: while set, measure_link takes these figures as this rank's
/// own instead of timing anything (the agreement across ranks still runs).
void set_link_measurement_for_testing(std::optional<LinkMeasurement> measurement);

}  // namespace ddp::detail
