// FaultTolerantSampler and its pure rule (fault_tolerant_window/slice), and
// the membership record's text form.

#include <ddp/fault_tolerance.h>

#include <ddp/distributed_sampler.h>
#include <ddp/error.h>

#include "fault/membership.h"

#include <algorithm>
#include <sstream>

namespace ddp {

std::vector<int64_t> fault_tolerant_window(const std::vector<int64_t>& order, int64_t cursor, int64_t batch_size,
                                           int members) {
  DDP_CHECK(members >= 1 && batch_size >= 1, "ddp: a fault-tolerant window needs members >= 1 and batch_size >= 1");
  const int64_t size = static_cast<int64_t>(order.size());
  const int64_t end = std::min<int64_t>(size, cursor + batch_size * members);
  std::vector<int64_t> window(order.begin() + std::min(cursor, size), order.begin() + end);
  // Every member needs at least one sample, or its backward would issue no
  // all-reduce and the others would wait for it.
  for (int64_t i = 0; static_cast<int64_t>(window.size()) < members && size > 0; ++i) {
    window.push_back(order[static_cast<size_t>(i % size)]);
  }
  return window;
}

std::vector<int64_t> fault_tolerant_slice(const std::vector<int64_t>& window, int rank, int members) {
  DDP_CHECK(rank >= 0 && rank < members, "ddp: rank ", rank, " is outside [0, ", members, ")");
  // Contiguous parts whose sizes differ by at most one, the larger first.
  const int64_t n = static_cast<int64_t>(window.size());
  const int64_t base = n / members, extra = n % members;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  const int64_t count = base + (rank < extra ? 1 : 0);
  return std::vector<int64_t>(window.begin() + begin, window.begin() + begin + count);
}

FaultTolerantSampler::FaultTolerantSampler(int64_t dataset_size, int64_t batch_size, uint64_t seed, bool shuffle)
    : dataset_size_(dataset_size), batch_size_(batch_size), seed_(seed), shuffle_(shuffle) {
  DDP_CHECK(dataset_size >= 1, "ddp: FaultTolerantSampler needs a non-empty dataset, got size ", dataset_size);
  DDP_CHECK(batch_size >= 1, "ddp: FaultTolerantSampler needs batch_size >= 1, got ", batch_size);
  set_position(0, 0);
}

void FaultTolerantSampler::set_position(int64_t epoch, int64_t cursor) {
  DDP_CHECK(epoch >= 0 && cursor >= 0 && cursor <= dataset_size_, "ddp: sampler position (epoch ", epoch, ", cursor ",
            cursor, ") is outside a dataset of ", dataset_size_);
  if (order_.empty() || epoch != epoch_) {
    // One replica's view of DistributedSampler's epoch: its whole permutation.
    order_ = distributed_sampler_indices(dataset_size_, SamplerOptions(1, 0).seed(seed_).shuffle(shuffle_), epoch);
  }
  epoch_ = epoch;
  cursor_ = cursor;
}

std::vector<int64_t> FaultTolerantSampler::window(int members) const {
  return fault_tolerant_window(order_, cursor_, batch_size_, members);
}

std::vector<int64_t> FaultTolerantSampler::batch(int rank, int members) const {
  return fault_tolerant_slice(window(members), rank, members);
}

void FaultTolerantSampler::advance(int members) {
  const int64_t next = cursor_ + batch_size_ * members;
  if (next >= dataset_size_) {
    set_position(epoch_ + 1, 0);
  } else {
    cursor_ = next;
  }
}

namespace detail {

int Membership::rank_of(const std::string& id) const {
  auto it = std::find(ids.begin(), ids.end(), id);
  return it == ids.end() ? -1 : static_cast<int>(it - ids.begin());
}

std::string encode_membership(const Membership& m) {
  std::string text = std::to_string(m.joined_upto) + "|" + std::to_string(m.carried) + "|";
  for (size_t i = 0; i < m.ids.size(); ++i) text += (i ? "," : "") + m.ids[i];
  return text;
}

Membership decode_membership(const std::string& text) {
  Membership m;
  const auto a = text.find('|');
  const auto b = a == std::string::npos ? a : text.find('|', a + 1);
  DDP_CHECK(b != std::string::npos, "ddp: fault-tolerance store holds a malformed membership '", text,
            "'; is another program using the same store?");
  m.joined_upto = std::stoll(text.substr(0, a));
  m.carried = std::stoi(text.substr(a + 1, b - a - 1));
  std::stringstream ids(text.substr(b + 1));
  for (std::string id; std::getline(ids, id, ',');) {
    if (!id.empty()) m.ids.push_back(id);
  }
  return m;
}

}  // namespace detail
}  // namespace ddp
