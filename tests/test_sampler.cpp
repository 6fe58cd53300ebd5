#include <ddp/distributed_sampler.h>

#include <gtest/gtest.h>
#include <support/subprocess.h>

#include "training/distributed_sampler_impl.h"

#include <set>
#include <sstream>

namespace {

TEST(DistributedSampler, MatchesPythonOnEveryCase) {
  auto result = ddp::testing::run_process(
      {DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tests/python/sampler_cases.py"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  std::istringstream lines(result.out);
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    auto colon = line.find(':');
    ASSERT_NE(colon, std::string::npos) << line;
    std::istringstream head(line.substr(0, colon));
    int64_t size, replicas, rank, shuffle, seed, drop_last, epoch;
    head >> size >> replicas >> rank >> shuffle >> seed >> drop_last >> epoch;
    std::vector<int64_t> expected;
    std::istringstream tail(line.substr(colon + 1));
    for (int64_t i; tail >> i;) expected.push_back(i);

    ddp::DistributedSampler sampler(size, ddp::SamplerOptions(replicas, rank)
                                              .shuffle(shuffle != 0)
                                              .seed(static_cast<uint64_t>(seed))
                                              .drop_last(drop_last != 0));
    sampler.set_epoch(epoch);
    ASSERT_EQ(sampler.indices(), expected) << "case " << line.substr(0, colon);
    ASSERT_EQ(sampler.num_samples(), static_cast<int64_t>(expected.size())) << line.substr(0, colon);
    ++cases;
  }
  EXPECT_GT(cases, 1000);
}

TEST(DistributedSampler, RanksPartitionThePaddedEpoch) {
  std::multiset<int64_t> seen;
  for (int64_t rank = 0; rank < 3; ++rank) {
    ddp::DistributedSampler sampler(10, ddp::SamplerOptions(3, rank).seed(3));
    sampler.set_epoch(2);
    auto mine = sampler.indices();
    EXPECT_EQ(mine.size(), 4u);
    seen.insert(mine.begin(), mine.end());
  }
  EXPECT_EQ(seen.size(), 12u);  // 10 samples padded to 12
  for (int64_t i = 0; i < 10; ++i) EXPECT_GE(seen.count(i), 1u);
}

// A job of 4 ranks stops after 3 batches of 4 per rank; the rest of the
// epoch, resumed on 2 ranks (and on 1), is what the first 48 samples left:
// together the two runs see every sample of the epoch exactly once.
TEST(DistributedSampler, ResumingAnEpochAtAnotherWorldSizeSeesEachSampleOnce) {
  const int64_t size = 142, batch = 4, steps = 3;
  for (int64_t later : {2, 1}) {
    std::multiset<int64_t> seen;
    int64_t samples_seen = -1;
    for (int64_t rank = 0; rank < 4; ++rank) {
      ddp::DistributedSampler sampler(size, ddp::SamplerOptions(4, rank).seed(7));
      sampler.set_epoch(5);
      sampler.reset();
      for (int64_t step = 0; step < steps; ++step) {
        const auto indices = sampler.next(batch);
        for (size_t index : *indices) seen.insert(static_cast<int64_t>(index));
      }
      samples_seen = sampler.samples_seen();
    }
    EXPECT_EQ(samples_seen, 4 * batch * steps);
    for (int64_t rank = 0; rank < later; ++rank) {
      ddp::DistributedSampler sampler(size, ddp::SamplerOptions(later, rank).seed(7));
      sampler.set_epoch(5);
      sampler.resume_epoch(samples_seen);
      sampler.reset();
      while (auto indices = sampler.next(batch)) {
        for (size_t index : *indices) seen.insert(static_cast<int64_t>(index));
      }
      EXPECT_EQ(sampler.samples_seen(), size) << "rank " << rank << " of " << later;
      // The pass after the resumed one is a whole epoch again.
      sampler.reset();
      EXPECT_EQ(sampler.samples_seen(), 0);
      EXPECT_EQ(sampler.indices(), ddp::distributed_sampler_indices(size, ddp::SamplerOptions(later, rank).seed(7), 5));
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(size)) << later << " ranks after 4";
    for (int64_t i = 0; i < size; ++i) EXPECT_EQ(seen.count(i), 1u) << i << ", " << later << " ranks after 4";
  }
  // The pure function with nothing seen is the whole epoch's.
  EXPECT_EQ(ddp::distributed_sampler_indices(10, ddp::SamplerOptions(3, 1), 2, 0),
            ddp::distributed_sampler_indices(10, ddp::SamplerOptions(3, 1), 2));
  ddp::DistributedSampler sampler(10, ddp::SamplerOptions(1, 0));
  EXPECT_THROW(sampler.resume_epoch(11), c10::Error);
}

TEST(DistributedSampler, SetEpochChangesTheShuffle) {
  ddp::DistributedSampler sampler(50, ddp::SamplerOptions(2, 0));
  auto first = sampler.indices();
  sampler.set_epoch(1);
  EXPECT_NE(sampler.indices(), first);
  sampler.set_epoch(0);
  EXPECT_EQ(sampler.indices(), first);
}

TEST(DistributedSampler, RejectsBadArguments) {
  EXPECT_THROW(ddp::DistributedSampler(10, ddp::SamplerOptions(2, 2)), c10::Error);
  EXPECT_THROW(ddp::DistributedSampler(10, ddp::SamplerOptions(0, 0)), c10::Error);
  EXPECT_THROW(ddp::DistributedSampler(-1, ddp::SamplerOptions(1, 0)), c10::Error);
}

TEST(MakeBatches, SplitsInOrderWithShortTail) {
  auto batches = ddp::make_batches({5, 6, 7, 8, 9}, 2);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0], (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(batches[2], (std::vector<int64_t>{9}));
  EXPECT_EQ(ddp::make_batches({5, 6, 7, 8, 9}, 2, /*drop_last=*/true).size(), 2u);
  EXPECT_THROW(ddp::make_batches({1}, 0), c10::Error);
}

}  // namespace
