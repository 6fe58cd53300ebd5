#include <ddp/distributed_sampler.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

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
  TORCH_CHECK(dataset_size >= 0, "ddp: DistributedSampler got a negative dataset size ",
              dataset_size);
  TORCH_CHECK(options.num_replicas() >= 1, "ddp: DistributedSampler needs num_replicas >= 1, got ",
              options.num_replicas());
  TORCH_CHECK(options.rank() >= 0 && options.rank() < options.num_replicas(),
              "ddp: DistributedSampler rank ", options.rank(), " is outside [0, ",
              options.num_replicas(), ")");
}

}  // namespace

std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, const SamplerOptions& options,
                                                 int64_t epoch) {
  validate(dataset_size, options);
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

  int64_t total = samples_per_rank(dataset_size, options) * options.num_replicas();
  if (!options.drop_last() && dataset_size > 0) {
    // Pad by cycling from the start, as Python does when the padding is
    // longer than the dataset itself.
    for (int64_t i = dataset_size; i < total; ++i) order.push_back(order[static_cast<size_t>(i % dataset_size)]);
  }
  order.resize(static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(total, static_cast<int64_t>(order.size())))));

  std::vector<int64_t> mine;
  for (int64_t i = options.rank(); i < static_cast<int64_t>(order.size()); i += options.num_replicas()) {
    mine.push_back(order[static_cast<size_t>(i)]);
  }
  return mine;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, SamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  validate(dataset_size, options);
  num_samples_ = samples_per_rank(dataset_size, options);
}

std::vector<int64_t> DistributedSampler::indices() const {
  return distributed_sampler_indices(dataset_size_, options_, epoch_);
}

std::vector<std::vector<int64_t>> make_batches(const std::vector<int64_t>& indices,
                                               int64_t batch_size, bool drop_last) {
  TORCH_CHECK(batch_size >= 1, "ddp: batch size must be at least 1, got ", batch_size);
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
