#include <ddp/bucket_assignment.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace {

ddp::BucketTensorInfo floats(int64_t numel) { return {numel, c10::kFloat, c10::Device(c10::kCPU)}; }

constexpr size_t kMiB = 1024 * 1024;

TEST(BucketAssignment, SmallModelIsOneBucketInReverseOrder) {
  auto buckets = ddp::compute_bucket_assignment({floats(10), floats(20), floats(30)}, kMiB, 25 * kMiB);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 1, 0}));
}

TEST(BucketAssignment, FirstBucketUsesTheSmallCap) {
  // 4 float tensors of 0.5 MiB each: the first bucket closes at 1 MiB (two
  // tensors), the rest fit under the 25 MiB cap.
  int64_t half_mib = static_cast<int64_t>(kMiB / 2 / sizeof(float));
  auto buckets = ddp::compute_bucket_assignment(
      {floats(half_mib), floats(half_mib), floats(half_mib), floats(half_mib)}, kMiB, 25 * kMiB);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{3, 2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{1, 0}));
}

TEST(BucketAssignment, LaterBucketsCloseAtTheirCap) {
  // Caps of 8 bytes then 16 bytes over 4-byte floats: 2 tensors, then 4, 4.
  std::vector<ddp::BucketTensorInfo> params(10, floats(1));
  auto buckets = ddp::compute_bucket_assignment(params, 8, 16);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{9, 8}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{7, 6, 5, 4}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{3, 2, 1, 0}));
}

TEST(BucketAssignment, OneTensorLargerThanTheCapGetsItsOwnBucket) {
  auto buckets = ddp::compute_bucket_assignment({floats(1), floats(1000), floats(1)}, 16, 16);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 1}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0}));
}

TEST(BucketAssignment, DtypesAndDevicesNeverShareABucket) {
  std::vector<ddp::BucketTensorInfo> params = {
      floats(4), {4, c10::kDouble, c10::Device(c10::kCPU)}, floats(4),
      {4, c10::kFloat, c10::Device(c10::kCUDA, 0)}};
  auto buckets = ddp::compute_bucket_assignment(params, kMiB, kMiB);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{3}));     // cuda:0 float
  EXPECT_EQ(buckets[1], (std::vector<size_t>{2, 0}));  // cpu float
  EXPECT_EQ(buckets[2], (std::vector<size_t>{1}));     // cpu double
}

TEST(BucketAssignment, NoParametersNoBuckets) {
  EXPECT_TRUE(ddp::compute_bucket_assignment({}, kMiB, kMiB).empty());
}

TEST(BucketAssignment, EveryParameterExactlyOnce) {
  std::vector<ddp::BucketTensorInfo> params;
  for (int i = 0; i < 50; ++i) params.push_back(floats(1 + (i * 37) % 200));
  auto buckets = ddp::compute_bucket_assignment(params, 64, 256);
  std::vector<int> count(params.size(), 0);
  for (auto& bucket : buckets)
    for (size_t i : bucket) ++count[i];
  for (int c : count) EXPECT_EQ(c, 1);
}

}  // namespace

namespace {

TEST(BucketAssignment, FollowsAGivenReadyOrder) {
  std::vector<ddp::BucketTensorInfo> params(6, floats(1));
  auto buckets = ddp::compute_bucket_assignment(params, {4, 5, 0, 1, 2, 3}, 8, 16);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{4, 5}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0, 1, 2, 3}));
}

TEST(BucketAssignment, RejectsAnOrderThatIsNotAPermutation) {
  std::vector<ddp::BucketTensorInfo> params(3, floats(1));
  EXPECT_THROW(ddp::compute_bucket_assignment(params, {0, 0, 1}, 8, 16), c10::Error);
  EXPECT_THROW(ddp::compute_bucket_assignment(params, {0, 1}, 8, 16), c10::Error);
}

}  // namespace
