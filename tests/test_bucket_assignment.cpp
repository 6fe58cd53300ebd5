#include "engine/bucket_assignment.h"
#include "sharding/zero_redundancy_optimizer_impl.h"

#include <c10/util/Exception.h>
#include <algorithm>
#include <gtest/gtest.h>

namespace {

ddp::detail::BucketTensorInfo floats(int64_t numel) { return {numel, c10::kFloat, c10::Device(c10::kCPU)}; }

constexpr size_t kMiB = 1024 * 1024;

TEST(BucketAssignment, SmallModelIsOneBucketInReverseOrder) {
  auto buckets = ddp::detail::compute_bucket_assignment({floats(10), floats(20), floats(30)}, kMiB, 25 * kMiB);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 1, 0}));
}

TEST(BucketAssignment, FirstBucketUsesTheSmallCap) {
  // 4 float tensors of 0.5 MiB each: the first bucket closes at 1 MiB (two
  // tensors), the rest fit under the 25 MiB cap.
  int64_t half_mib = static_cast<int64_t>(kMiB / 2 / sizeof(float));
  auto buckets = ddp::detail::compute_bucket_assignment(
      {floats(half_mib), floats(half_mib), floats(half_mib), floats(half_mib)}, kMiB, 25 * kMiB);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{3, 2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{1, 0}));
}

TEST(BucketAssignment, LaterBucketsCloseAtTheirCap) {
  // Caps of 8 bytes then 16 bytes over 4-byte floats: 2 tensors, then 4, 4.
  std::vector<ddp::detail::BucketTensorInfo> params(10, floats(1));
  auto buckets = ddp::detail::compute_bucket_assignment(params, 8, 16);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{9, 8}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{7, 6, 5, 4}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{3, 2, 1, 0}));
}

TEST(BucketAssignment, OneTensorLargerThanTheCapGetsItsOwnBucket) {
  auto buckets = ddp::detail::compute_bucket_assignment({floats(1), floats(1000), floats(1)}, 16, 16);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 1}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0}));
}

TEST(BucketAssignment, DtypesAndDevicesNeverShareABucket) {
  std::vector<ddp::detail::BucketTensorInfo> params = {
      floats(4), {4, c10::kDouble, c10::Device(c10::kCPU)}, floats(4),
      {4, c10::kFloat, c10::Device(c10::kCUDA, 0)}};
  auto buckets = ddp::detail::compute_bucket_assignment(params, kMiB, kMiB);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{3}));     // cuda:0 float
  EXPECT_EQ(buckets[1], (std::vector<size_t>{2, 0}));  // cpu float
  EXPECT_EQ(buckets[2], (std::vector<size_t>{1}));     // cpu double
}

TEST(BucketAssignment, NoParametersNoBuckets) {
  EXPECT_TRUE(ddp::detail::compute_bucket_assignment({}, kMiB, kMiB).empty());
}

TEST(BucketAssignment, EveryParameterExactlyOnce) {
  std::vector<ddp::detail::BucketTensorInfo> params;
  for (int i = 0; i < 50; ++i) params.push_back(floats(1 + (i * 37) % 200));
  auto buckets = ddp::detail::compute_bucket_assignment(params, 64, 256);
  std::vector<int> count(params.size(), 0);
  for (auto& bucket : buckets)
    for (size_t i : bucket) ++count[i];
  for (int c : count) EXPECT_EQ(c, 1);
}

}  // namespace

namespace {

TEST(BucketAssignment, FollowsAGivenReadyOrder) {
  std::vector<ddp::detail::BucketTensorInfo> params(6, floats(1));
  auto buckets = ddp::detail::compute_bucket_assignment(params, {4, 5, 0, 1, 2, 3}, 8, 16);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{4, 5}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0, 1, 2, 3}));
}

TEST(BucketAssignment, RejectsAnOrderThatIsNotAPermutation) {
  std::vector<ddp::detail::BucketTensorInfo> params(3, floats(1));
  EXPECT_THROW(ddp::detail::compute_bucket_assignment(params, {0, 0, 1}, 8, 16), c10::Error);
  EXPECT_THROW(ddp::detail::compute_bucket_assignment(params, {0, 1}, 8, 16), c10::Error);
}

}  // namespace

namespace {

TEST(ZeroPartition, BalancesBySizeLargestFirst) {
  // 1024 goes to rank 0; 320, 128, 32, 32, 4 then fill rank 1.
  auto owners = ddp::partition_parameters({320, 32, 1024, 32, 128, 4}, 2);
  EXPECT_EQ(owners, (std::vector<int>{1, 1, 0, 1, 1, 1}));
  auto three = ddp::partition_parameters({320, 32, 1024, 32, 128, 4}, 3);
  EXPECT_EQ(three, (std::vector<int>{1, 2, 0, 2, 2, 2}));
}

TEST(ZeroPartition, EveryParameterOnceAndLoadsClose) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 40; ++i) sizes.push_back(1 + (i * 7919) % 1000);
  auto owners = ddp::partition_parameters(sizes, 4);
  std::vector<int64_t> load(4, 0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_GE(owners[i], 0);
    ASSERT_LT(owners[i], 4);
    load[owners[i]] += sizes[i];
  }
  auto [lo, hi] = std::minmax_element(load.begin(), load.end());
  EXPECT_LE(*hi - *lo, 1000);  // never more than the largest single tensor apart
}

TEST(ZeroPartition, MoreRanksThanParametersLeavesSomeEmpty) {
  auto owners = ddp::partition_parameters({5, 3}, 4);
  EXPECT_EQ(owners, (std::vector<int>{0, 1}));
  EXPECT_THROW(ddp::partition_parameters({1}, 0), c10::Error);
}

}  // namespace
