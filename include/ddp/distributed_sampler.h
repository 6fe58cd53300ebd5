#pragma once

// Splits a dataset's indices across the ranks of a job, yielding for the same
// arguments exactly what Python's torch.utils.data.distributed.DistributedSampler
// yields: a torch.randperm shuffle seeded with seed + epoch, padding to an
// evenly divisible total (or dropping the tail), then every num_replicas-th
// index starting at rank.
//
// It is a torch::data sampler, so it goes straight into LibTorch's loaders:
//
//   ddp::DistributedSampler sampler(dataset.size().value(),
//                                   ddp::SamplerOptions(group->size(), group->rank()));
//   auto loader = torch::data::make_data_loader(
//       dataset.map(torch::data::transforms::Stack<>()), sampler,
//       torch::data::DataLoaderOptions().batch_size(32).workers(2));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);        // reaches the loader's copy too
//     for (auto& batch : *loader) { ... }
//   }

#include <ddp/export.h>
#include <torch/arg.h>
#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

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
DDP_API std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, const SamplerOptions& options,
                                                         int64_t epoch);
/// The same for the rest of an epoch whose first `samples_seen` indices,
/// in the epoch's job-wide order (its permutation, before padding), the job
/// has consumed, at whatever world size: the rest is padded (or its tail
/// dropped) and split over options.num_replicas() as a whole epoch would
/// be. With samples_seen 0 it is the function above. When the rest divides
/// evenly, every index of the epoch is seen exactly once across the two
/// world sizes.
DDP_API std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, const SamplerOptions& options,
                                                         int64_t epoch, int64_t samples_seen);

/// A torch::data sampler over this rank's share of every epoch.
///
/// Copies share one state, as a ModuleHolder's copies share one module: the
/// loader takes a copy, and set_epoch() on yours changes what the loader's
/// next pass yields, as in Python. Without set_epoch() every epoch repeats
/// epoch 0's order (Python's behaviour too).
///
/// save()/load() (LibTorch's sampler serialisation, e.g. torch::save(sampler,
/// path)) keep the epoch and how many indices of it were handed out, so a
/// loader over a loaded sampler yields the rest of the interrupted epoch on
/// its next pass, then whole epochs again. With workers(n) the loader asks
/// for up to 2n batches ahead of the ones you consumed; save from a loader
/// with workers(0), or call set_position() with what you consumed.
class DDP_API DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  /// `dataset_size` may be 0 when a reset(size) will follow (a ChunkDataset
  /// does that with the chunk count).
  DistributedSampler(int64_t dataset_size, SamplerOptions options);

  /// The epoch whose order the next pass yields; every copy sees it.
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  /// All of this rank's indices for the current epoch.
  std::vector<int64_t> indices() const;
  /// How many indices each rank gets per epoch.
  int64_t num_samples() const;
  const SamplerOptions& options() const;

  /// Indices of the current epoch already handed out by next().
  int64_t position() const;
  /// Makes the next pass start `position` indices into the current epoch
  /// (for resuming at the same world size); later passes start at 0 again.
  void set_position(int64_t position);
  /// How many indices of the current epoch's job-wide order the job has
  /// consumed when every rank has consumed position() of its own (ranks
  /// that step together): what to save to resume at another world size.
  int64_t samples_seen() const;
  /// Makes the next pass yield the rest of the current epoch after the job
  /// consumed its first `samples_seen` (samples_seen() of a run at any world
  /// size), split anew over this sampler's ranks; later passes are whole
  /// epochs again. For resuming at another world size.
  void resume_epoch(int64_t samples_seen);

  /// torch::data: starts a pass over the current epoch. `new_size` changes
  /// the dataset size.
  void reset(std::optional<size_t> new_size = std::nullopt) override;
  /// torch::data: up to `batch_size` more indices, or nullopt at the end.
  std::optional<std::vector<size_t>> next(size_t batch_size) override;
  /// torch::data: writes the epoch, the position and the options.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// torch::data: restores what save() wrote; refuses a sampler of another
  /// dataset size, world size, rank or shuffle setting, naming the value.
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace ddp
