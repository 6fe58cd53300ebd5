// What a member reads from a peer's liveness connection (src/fault/socket_watch.h,
// LivenessInbound): the hello, beats in any pieces, and hostile bytes from whoever can reach
// the port. Torch-free, so `make sanitize` also runs it under AddressSanitizer and
// UndefinedBehaviorSanitizer.
#include "fault/socket_watch.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace {

using ddp::detail::LivenessInbound;

TEST(LivenessInbound, TheHelloNamesThePeerInAnyPiecesAndBeatsKeepItSo) {
  LivenessInbound in;
  const std::string stream = "hello node1-ab12/0/inc3\nb\nb\nb\n";
  for (char c : stream) ASSERT_TRUE(in.feed(&c, 1));
  EXPECT_EQ(in.who, "node1-ab12/0/inc3");
  EXPECT_TRUE(in.text.empty());
  ASSERT_TRUE(in.feed("b\nb", 3));
  EXPECT_EQ(in.text, "b");
  EXPECT_EQ(in.who, "node1-ab12/0/inc3");
}

TEST(LivenessInbound, ALineOverTheLimitDropsTheConnectionAndNothingIsKeptUnbounded) {
  LivenessInbound endless;
  const std::string chunk(1000, 'x');
  bool kept = true;
  for (int i = 0; i < 10 && kept; ++i) kept = endless.feed(chunk.data(), chunk.size());
  EXPECT_FALSE(kept) << "a line without end must not be buffered forever";

  LivenessInbound long_line;
  const std::string line = std::string(LivenessInbound::kMaxLine + 1, 'y') + "\n";
  EXPECT_FALSE(long_line.feed(line.data(), line.size()));

  // "hello " alone names nobody; binary bytes and NULs are only a sign of life.
  LivenessInbound odd;
  const char bytes[] = {'h', 'e', 'l', 'l', 'o', ' ', '\n', '\0', '\xff', '\n', 'b', '\n'};
  EXPECT_TRUE(odd.feed(bytes, sizeof bytes));
  EXPECT_TRUE(odd.who.empty());
}

TEST(LivenessInbound, RandomBytesInRandomPiecesNeverGrowItPastTheLimit) {
  std::mt19937 random(36);
  for (int round = 0; round < 200; ++round) {
    LivenessInbound in;
    for (int piece = 0; piece < 50; ++piece) {
      std::string bytes(random() % 3000, '\0');
      for (char& c : bytes) c = static_cast<char>(random() % 4 == 0 ? '\n' : random() % 256);
      if (!in.feed(bytes.data(), bytes.size())) break;
      ASSERT_LE(in.text.size(), LivenessInbound::kMaxLine);
      ASSERT_LE(in.who.size(), LivenessInbound::kMaxLine);
    }
  }
}

}  // namespace
