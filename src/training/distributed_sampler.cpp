#include <ddp/distributed_sampler.h>

#include <ddp/error.h>

#include "training/distributed_sampler_impl.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <string>

namespace ddp {
namespace {

int64_t samples_per_rank(int64_t dataset_size, const SamplerOptions& options) {
  int64_t n = options.num_replicas();
  if (options.drop_last() && dataset_size % n != 0) {
    // Python: math.ceil((len - num_replicas) / num_replicas), the largest
    // count every rank can have without padding.
    return (dataset_size - n + n - 1) / n;
  }
  return (dataset_size + n - 1) / n;
}

void validate(int64_t dataset_size, const SamplerOptions& options) {
  DDP_CHECK(dataset_size >= 0, "ddp: DistributedSampler got a negative dataset size ",
              dataset_size);
  DDP_CHECK(options.num_replicas() >= 1, "ddp: DistributedSampler needs num_replicas >= 1, got ",
              options.num_replicas());
  DDP_CHECK(options.rank() >= 0 && options.rank() < options.num_replicas(),
              "ddp: DistributedSampler rank ", options.rank(), " is outside [0, ",
              options.num_replicas(), ")");
}

}  // namespace

std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, const SamplerOptions& options,
                                                 int64_t epoch) {
  return distributed_sampler_indices(dataset_size, options, epoch, 0);
}

std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, const SamplerOptions& options,
                                                 int64_t epoch, int64_t samples_seen) {
  validate(dataset_size, options);
  DDP_CHECK(samples_seen >= 0, "ddp: DistributedSampler got a negative samples_seen ", samples_seen);
  std::vector<int64_t> order(static_cast<size_t>(dataset_size));
  if (options.shuffle()) {
    // The same generator and kernel as Python's torch.Generator().manual_seed
    // followed by torch.randperm, so the permutation is bit-identical.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed() + epoch);
    at::Tensor perm = at::randperm(dataset_size, generator, at::TensorOptions().dtype(at::kLong));
    const int64_t* data = perm.data_ptr<int64_t>();
    order.assign(data, data + dataset_size);
  } else {
    for (int64_t i = 0; i < dataset_size; ++i) order[static_cast<size_t>(i)] = i;
  }
  // The consumed prefix goes; the rest is split as a whole epoch would be.
  order.erase(order.begin(), order.begin() + std::min<int64_t>(samples_seen, dataset_size));
  const int64_t rest = static_cast<int64_t>(order.size());

  int64_t total = samples_per_rank(rest, options) * options.num_replicas();
  if (!options.drop_last() && rest > 0) {
    // Pad by cycling from the start, as Python does when the padding is
    // longer than the dataset itself.
    for (int64_t i = rest; i < total; ++i) order.push_back(order[static_cast<size_t>(i % rest)]);
  }
  order.resize(static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(total, static_cast<int64_t>(order.size())))));

  std::vector<int64_t> mine;
  for (int64_t i = options.rank(); i < static_cast<int64_t>(order.size()); i += options.num_replicas()) {
    mine.push_back(order[static_cast<size_t>(i)]);
  }
  return mine;
}

struct DistributedSampler::State {
  State(int64_t size, SamplerOptions opts) : dataset_size(size), options(opts) {}
  int64_t dataset_size;
  SamplerOptions options;
  int64_t num_samples = 0;
  int64_t epoch = 0;
  // Indices of the epoch's job-wide order consumed before this pass's split
  // (resume_epoch).
  int64_t epoch_start = 0;
  // The pass in progress: its indices and how many were handed out.
  std::vector<int64_t> order;
  int64_t position = 0;
  bool order_valid = false;
  // A position set by load() or set_position() survives the next reset().
  bool keep_position = false;

  void refresh() {
    order = distributed_sampler_indices(dataset_size, options, epoch, epoch_start);
    order_valid = true;
  }
};

DistributedSampler::DistributedSampler(int64_t dataset_size, SamplerOptions options)
    : state_(std::make_shared<State>(dataset_size, options)) {
  validate(dataset_size, options);
  state_->num_samples = samples_per_rank(dataset_size, options);
}

void DistributedSampler::set_epoch(int64_t epoch) {
  DDP_CHECK(epoch >= 0, "ddp: DistributedSampler::set_epoch needs an epoch >= 0, got ", epoch);
  if (epoch != state_->epoch) {
    state_->epoch = epoch;
    state_->order_valid = false;
    state_->position = 0;
    state_->epoch_start = 0;
    state_->keep_position = false;
  }
}

int64_t DistributedSampler::epoch() const { return state_->epoch; }

std::vector<int64_t> DistributedSampler::indices() const {
  return distributed_sampler_indices(state_->dataset_size, state_->options, state_->epoch);
}

int64_t DistributedSampler::num_samples() const { return state_->num_samples; }

const SamplerOptions& DistributedSampler::options() const { return state_->options; }

int64_t DistributedSampler::position() const { return state_->position; }

void DistributedSampler::set_position(int64_t position) {
  DDP_CHECK(position >= 0 && position <= state_->num_samples, "ddp: DistributedSampler::set_position(",
            position, ") is outside [0, ", state_->num_samples, "], this rank's samples per epoch");
  state_->position = position;
  state_->keep_position = true;
}

int64_t DistributedSampler::samples_seen() const {
  const auto& s = *state_;
  return std::min(s.dataset_size, s.epoch_start + s.position * s.options.num_replicas());
}

void DistributedSampler::resume_epoch(int64_t samples_seen) {
  DDP_CHECK(samples_seen >= 0 && samples_seen <= state_->dataset_size, "ddp: DistributedSampler::resume_epoch(",
            samples_seen, ") is outside [0, ", state_->dataset_size, "], the dataset's size");
  state_->epoch_start = samples_seen;
  state_->position = 0;
  state_->keep_position = true;
  state_->order_valid = false;
}

void DistributedSampler::reset(std::optional<size_t> new_size) {
  if (new_size && static_cast<int64_t>(*new_size) != state_->dataset_size) {
    state_->dataset_size = static_cast<int64_t>(*new_size);
    state_->num_samples = samples_per_rank(state_->dataset_size, state_->options);
    state_->keep_position = false;
  }
  if (!state_->keep_position) {
    state_->position = 0;
    state_->epoch_start = 0;
  }
  state_->keep_position = false;
  state_->refresh();
}

std::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (!state_->order_valid) state_->refresh();
  const int64_t total = static_cast<int64_t>(state_->order.size());
  if (state_->position >= total || batch_size == 0) return std::nullopt;
  const int64_t end = std::min<int64_t>(total, state_->position + static_cast<int64_t>(batch_size));
  std::vector<size_t> batch;
  batch.reserve(static_cast<size_t>(end - state_->position));
  for (int64_t i = state_->position; i < end; ++i) {
    batch.push_back(static_cast<size_t>(state_->order[static_cast<size_t>(i)]));
  }
  state_->position = end;
  return batch;
}

namespace {
at::Tensor scalar(int64_t value) { return at::full({}, value, at::kLong); }

int64_t read_scalar(torch::serialize::InputArchive& archive, const std::string& key) {
  at::Tensor t;
  DDP_CHECK(archive.try_read("ddp_sampler/" + key, t), "ddp: the archive holds no DistributedSampler state (",
            "no 'ddp_sampler/", key, "'); it was not written by ddp::DistributedSampler::save");
  return t.item<int64_t>();
}
}  // namespace

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  const auto& s = *state_;
  archive.write("ddp_sampler/epoch", scalar(s.epoch), /*is_buffer=*/true);
  archive.write("ddp_sampler/position", scalar(s.position), true);
  archive.write("ddp_sampler/epoch_start", scalar(s.epoch_start), true);
  archive.write("ddp_sampler/dataset_size", scalar(s.dataset_size), true);
  archive.write("ddp_sampler/num_replicas", scalar(s.options.num_replicas()), true);
  archive.write("ddp_sampler/rank", scalar(s.options.rank()), true);
  archive.write("ddp_sampler/shuffle", scalar(s.options.shuffle() ? 1 : 0), true);
  archive.write("ddp_sampler/seed", scalar(static_cast<int64_t>(s.options.seed())), true);
  archive.write("ddp_sampler/drop_last", scalar(s.options.drop_last() ? 1 : 0), true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  auto& s = *state_;
  auto expect = [&](const char* key, int64_t mine) {
    int64_t saved = read_scalar(archive, key);
    DDP_CHECK(saved == mine, "ddp: the saved DistributedSampler has ", key, "=", saved, " but this one has ",
              key, "=", mine, "; resume with the same dataset, world size and sampler options");
  };
  expect("dataset_size", s.dataset_size);
  expect("num_replicas", s.options.num_replicas());
  expect("rank", s.options.rank());
  expect("shuffle", s.options.shuffle() ? 1 : 0);
  expect("seed", static_cast<int64_t>(s.options.seed()));
  expect("drop_last", s.options.drop_last() ? 1 : 0);
  int64_t epoch = read_scalar(archive, "epoch");
  int64_t position = read_scalar(archive, "position");
  DDP_CHECK(epoch >= 0 && position >= 0 && position <= s.num_samples, "ddp: the saved DistributedSampler's ",
            "epoch ", epoch, " and position ", position, " are out of range (", s.num_samples,
            " samples per rank); the file is damaged");
  set_epoch(epoch);
  at::Tensor start;
  if (archive.try_read("ddp_sampler/epoch_start", start) && start.item<int64_t>() > 0) {
    resume_epoch(start.item<int64_t>());
  }
  set_position(position);
}

std::vector<std::vector<int64_t>> make_batches(const std::vector<int64_t>& indices,
                                               int64_t batch_size, bool drop_last) {
  DDP_CHECK(batch_size >= 1, "ddp: batch size must be at least 1, got ", batch_size);
  std::vector<std::vector<int64_t>> batches;
  for (size_t start = 0; start < indices.size(); start += static_cast<size_t>(batch_size)) {
    size_t end = std::min(indices.size(), start + static_cast<size_t>(batch_size));
    if (drop_last && end - start < static_cast<size_t>(batch_size)) break;
    batches.emplace_back(indices.begin() + static_cast<std::ptrdiff_t>(start),
                         indices.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return batches;
}

}  // namespace ddp
