#pragma once

// Splits a dataset's indices across the ranks of a job, yielding for the same
// arguments exactly what Python's torch.utils.data.distributed.DistributedSampler
// yields: a torch.randperm shuffle seeded with seed + epoch, padding to an
// evenly divisible total (or dropping the tail), then every num_replicas-th
// index starting at rank.

#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace ddp {

/// Options for DistributedSampler; the defaults are Python's.
///
///   ddp::DistributedSampler sampler(dataset_size,
///       ddp::SamplerOptions(world.world_size, world.rank).seed(7));
struct SamplerOptions {
  SamplerOptions(int64_t num_replicas, int64_t rank) : num_replicas_(num_replicas), rank_(rank) {}
  /// Number of ranks the indices are split across.
  TORCH_ARG(int64_t, num_replicas);
  /// This rank, in [0, num_replicas).
  TORCH_ARG(int64_t, rank);
  /// Permute the indices each epoch.
  TORCH_ARG(bool, shuffle) = true;
  /// Base seed; the epoch's permutation is seeded with seed + epoch.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Drop the tail that does not divide evenly instead of padding by
  /// repeating indices from the start.
  TORCH_ARG(bool, drop_last) = false;
};

/// The indices one rank sees in one epoch. Pure: no state, no processes.
std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, const SamplerOptions& options,
                                                 int64_t epoch);

/// A sampler that remembers its epoch. Call set_epoch(epoch) at the start of
/// every epoch; without it every epoch sees the same order.
class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, SamplerOptions options);

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  /// The indices of this rank for the current epoch.
  std::vector<int64_t> indices() const;
  /// How many indices each rank gets per epoch.
  int64_t num_samples() const { return num_samples_; }
  /// num_samples() * num_replicas.
  int64_t total_size() const { return num_samples_ * options_.num_replicas(); }
  const SamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  SamplerOptions options_;
  int64_t num_samples_;
  int64_t epoch_ = 0;
};

/// Splits `indices` into consecutive batches of `batch_size`, the last one
/// possibly shorter unless `drop_last` (a DataLoader over a sampler).
std::vector<std::vector<int64_t>> make_batches(const std::vector<int64_t>& indices,
                                               int64_t batch_size, bool drop_last = false);

}  // namespace ddp
