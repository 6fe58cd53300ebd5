#include "common/shard_range.h"

#include <ddp/error.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace {

using ddp::detail::balanced_part;
using ddp::detail::clip;
using ddp::detail::padded_numel;
using ddp::detail::padded_shard;
using ddp::detail::ShardRange;

std::vector<ShardRange> padded_shards(int64_t numel, int64_t world) {
  std::vector<ShardRange> out;
  for (int64_t rank = 0; rank < world; ++rank) out.push_back(padded_shard(numel, world, rank));
  return out;
}

std::vector<ShardRange> balanced_parts(int64_t numel, int64_t world) {
  std::vector<ShardRange> out;
  for (int64_t rank = 0; rank < world; ++rank) out.push_back(balanced_part(numel, world, rank));
  return out;
}

std::vector<ShardRange> real_parts(int64_t numel, int64_t world) {
  std::vector<ShardRange> out;
  for (const ShardRange& shard : padded_shards(numel, world)) out.push_back(clip(shard, {0, numel}));
  return out;
}

// Each range starts where the one before ended, the first at 0 and the last
// ending at `total`: in rank order, no gap, no overlap.
void expect_tiles(const std::vector<ShardRange>& ranges, int64_t total) {
  int64_t next = 0;
  for (size_t rank = 0; rank < ranges.size(); ++rank) {
    EXPECT_EQ(ranges[rank].begin, next) << "rank " << rank;
    EXPECT_GE(ranges[rank].numel(), 0) << "rank " << rank;
    next = ranges[rank].end;
  }
  EXPECT_EQ(next, total);
}

TEST(ShardRange, PaddedNumelRoundsUpToTheWorldSize) {
  EXPECT_EQ(padded_numel(0, 4), 0);
  EXPECT_EQ(padded_numel(1, 4), 4);
  EXPECT_EQ(padded_numel(8, 4), 8);
  EXPECT_EQ(padded_numel(9, 4), 12);
  EXPECT_EQ(padded_numel(7, 1), 7);
}

TEST(ShardRange, PaddedShardsOfAnExactMultipleAreEqualAndUnpadded) {
  EXPECT_EQ(padded_shards(12, 3), (std::vector<ShardRange>{{0, 4}, {4, 8}, {8, 12}}));
}

TEST(ShardRange, LastPaddedShardIsShortOrEmptyOnRealElements) {
  // torch.chunk(arange(10), 4): 3, 3, 3, 1.
  EXPECT_EQ(padded_shards(10, 4), (std::vector<ShardRange>{{0, 3}, {3, 6}, {6, 9}, {9, 12}}));
  EXPECT_EQ(real_parts(10, 4), (std::vector<ShardRange>{{0, 3}, {3, 6}, {6, 9}, {9, 10}}));
  // 9 over 8 ranks: chunks of 2, so ranks 5, 6 and 7 hold only padding.
  const auto real = real_parts(9, 8);
  EXPECT_EQ(real[4], (ShardRange{8, 9}));
  for (int rank = 5; rank < 8; ++rank) EXPECT_TRUE(real[rank].empty()) << "rank " << rank;
}

TEST(ShardRange, FewerElementsThanRanks) {
  EXPECT_EQ(padded_shards(2, 4), (std::vector<ShardRange>{{0, 1}, {1, 2}, {2, 3}, {3, 4}}));
  EXPECT_EQ(real_parts(2, 4), (std::vector<ShardRange>{{0, 1}, {1, 2}, {2, 2}, {2, 2}}));
  EXPECT_EQ(balanced_parts(2, 4), (std::vector<ShardRange>{{0, 0}, {0, 1}, {1, 1}, {1, 2}}));
}

TEST(ShardRange, NoElementsGiveEveryRankAnEmptyRange) {
  for (const ShardRange& shard : padded_shards(0, 3)) EXPECT_EQ(shard, (ShardRange{0, 0}));
  for (const ShardRange& part : balanced_parts(0, 3)) EXPECT_EQ(part, (ShardRange{0, 0}));
}

TEST(ShardRange, OneRankHoldsEverything) {
  EXPECT_EQ(padded_shard(7, 1, 0), (ShardRange{0, 7}));
  EXPECT_EQ(balanced_part(7, 1, 0), (ShardRange{0, 7}));
  EXPECT_EQ(padded_shard(0, 1, 0), (ShardRange{0, 0}));
}

TEST(ShardRange, BalancedPartsDifferByAtMostOneElement) {
  // The padded rule would give 2, 2, 2, 2, 1, 0, 0, 0.
  EXPECT_EQ(balanced_parts(9, 8),
            (std::vector<ShardRange>{{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}, {7, 9}}));
  EXPECT_EQ(balanced_parts(10, 4), (std::vector<ShardRange>{{0, 2}, {2, 5}, {5, 7}, {7, 10}}));
}

TEST(ShardRange, EveryRuleTilesTheBufferInRankOrder) {
  for (int64_t world = 1; world <= 17; ++world) {
    for (int64_t numel = 0; numel <= 3 * world + 5; ++numel) {
      SCOPED_TRACE(testing::Message() << numel << " elements over " << world << " ranks");
      const int64_t padded = padded_numel(numel, world);
      EXPECT_GE(padded, numel);
      EXPECT_LT(padded - numel, world);
      EXPECT_EQ(padded % world, 0);
      const auto shards = padded_shards(numel, world);
      expect_tiles(shards, padded);
      for (const ShardRange& shard : shards) EXPECT_EQ(shard.numel(), padded / world);
      expect_tiles(real_parts(numel, world), numel);
      const auto parts = balanced_parts(numel, world);
      expect_tiles(parts, numel);
      for (const ShardRange& part : parts) {
        EXPECT_GE(part.numel(), numel / world);
        EXPECT_LE(part.numel(), numel / world + 1);
      }
    }
  }
}

// Which rank writes which bytes decides a distributed checkpoint's files:
// the rule must be the one that wrote every checkpoint so far,
// [numel * rank / world, numel * (rank + 1) / world).
TEST(ShardRange, BalancedPartIsTheCheckpointsEstablishedRule) {
  for (int64_t world = 1; world <= 33; ++world) {
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{63}, int64_t{64}, int64_t{1000003},
                          int64_t{1} << 40}) {
      for (int64_t rank = 0; rank < world; ++rank) {
        EXPECT_EQ(balanced_part(numel, world, rank), (ShardRange{numel * rank / world, numel * (rank + 1) / world}))
            << numel << " elements, rank " << rank << " of " << world;
      }
    }
  }
}

TEST(ShardRange, BalancedPartOfAHugeBufferDoesNotOverflow) {
  const int64_t huge = std::numeric_limits<int64_t>::max() - 1;
  const ShardRange last = balanced_part(huge, 1024, 1023);
  EXPECT_EQ(last.end, huge);
  EXPECT_GT(last.begin, 0);
}

TEST(ShardRange, ClipKeepsThePartInsideAndPlacesAnEmptyOneAtTheNearestEnd) {
  EXPECT_EQ(clip({0, 4}, {2, 9}), (ShardRange{2, 4}));
  EXPECT_EQ(clip({2, 9}, {0, 4}), (ShardRange{2, 4}));
  EXPECT_EQ(clip({3, 5}, {0, 9}), (ShardRange{3, 5}));
  EXPECT_EQ(clip({0, 4}, {4, 9}), (ShardRange{4, 4}));
  EXPECT_EQ(clip({10, 12}, {0, 9}), (ShardRange{9, 9}));
  EXPECT_EQ(clip({0, 3}, {5, 9}), (ShardRange{5, 5}));
  EXPECT_TRUE(clip({10, 12}, {0, 9}).empty());
}

TEST(ShardRange, BadArgumentsAreRefused) {
  EXPECT_THROW(padded_shard(4, 0, 0), ddp::Error);
  EXPECT_THROW(padded_shard(4, 2, 2), ddp::Error);
  EXPECT_THROW(balanced_part(4, 2, -1), ddp::Error);
  EXPECT_THROW(padded_numel(-1, 2), ddp::Error);
}

}  // namespace
