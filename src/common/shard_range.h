#pragma once

// Internal to src/: which elements of a flat buffer a rank owns. Every piece
// of ddp that splits a buffer across ranks asks here, so that FSDP's
// gathers, its state dicts, its full-state-dict reader and the distributed
// checkpoint can never disagree about a shard. Pure: no process group, no
// tensor; tests/test_shard_range.cpp checks them without processes.
//
// There are two rules because they serve two different needs:
//
// - padded_shard: FSDP's shards (also its optimizer state and gradients).
//   all_gather_into_tensor and reduce_scatter_tensor need equal parts, so
//   the flat tensor is padded to padded_numel() and each rank holds
//   padded_numel() / world elements. On the real elements this is
//   torch.chunk's rule, as DTensor's Shard(0) uses: ceil(numel / world)
//   each, in rank order, the last ranks short or empty.
// - balanced_part: what each rank writes, in a distributed checkpoint, of a
//   tensor that several ranks hold whole (buffers, DDP's and ZeRO's model,
//   NO_SHARD units, one HSDP shard across its replicas). Nothing is padded
//   on disk and no collective needs equal sizes, so the parts differ by at
//   most one element and no rank sits idle while another writes (the padded
//   rule leaves 3 of 8 ranks empty for 9 elements). Which rank writes which
//   bytes decides which file holds them: changing this rule would change
//   the files a save writes.

#include <ddp/error.h>

#include <algorithm>
#include <cstdint>

namespace ddp::detail {

/// Elements [begin, end) of a flat buffer.
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;

  int64_t numel() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool operator==(const ShardRange& other) const { return begin == other.begin && end == other.end; }
  bool operator!=(const ShardRange& other) const { return !(*this == other); }
};

/// The part of `range` that lies inside `within`. When none does, an empty
/// range at the nearest end of `within`, so that a rank's shards clipped to
/// the real elements still follow each other: the real elements of
/// padded_shard() are clip(shard, {0, numel}).
inline ShardRange clip(const ShardRange& range, const ShardRange& within) {
  const int64_t begin = std::clamp(range.begin, within.begin, within.end);
  return {begin, std::clamp(range.end, begin, within.end)};
}

inline void check_shard_arguments(int64_t numel, int64_t world_size, int64_t rank) {
  DDP_CHECK(world_size >= 1 && rank >= 0 && rank < world_size && numel >= 0, "ddp: internal error: no shard of ",
            numel, " elements for rank ", rank, " of ", world_size, " ranks; please report this");
}

/// `numel` rounded up to a multiple of `world_size`: FSDP's flat tensor.
inline int64_t padded_numel(int64_t numel, int64_t world_size) {
  check_shard_arguments(numel, world_size, 0);
  return (numel / world_size + (numel % world_size != 0 ? 1 : 0)) * world_size;
}

/// Rank `rank`'s FSDP shard of a flat tensor of `numel` real elements:
/// padded_numel(numel, world_size) / world_size elements, the ranks' shards
/// side by side. Its tail past `numel`, if any, is padding.
inline ShardRange padded_shard(int64_t numel, int64_t world_size, int64_t rank) {
  check_shard_arguments(numel, world_size, rank);
  const int64_t size = padded_numel(numel, world_size) / world_size;
  return {rank * size, (rank + 1) * size};
}

/// Rank `rank`'s part of `numel` elements that every rank holds:
/// [numel * rank / world_size, numel * (rank + 1) / world_size), computed
/// without forming numel * rank, so that it cannot overflow.
inline ShardRange balanced_part(int64_t numel, int64_t world_size, int64_t rank) {
  check_shard_arguments(numel, world_size, rank);
  const int64_t quotient = numel / world_size, remainder = numel % world_size;
  auto start = [&](int64_t r) { return quotient * r + remainder * r / world_size; };
  return {start(rank), start(rank + 1)};
}

}  // namespace ddp::detail
