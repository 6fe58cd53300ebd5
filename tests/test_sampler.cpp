#include <ddp/distributed_sampler.h>

#include <gtest/gtest.h>
#include <support/subprocess.h>

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
