// Linked into ft_worker only: sets FaultTolerance's vote seams
// (src/launch/test_seams.h) from the environment before main() runs, for
// tests/test_ft_vote.cpp:
//   FT_TEST_LOSE_VOTE_AT=S        on the worker with RANK=FT_TEST_LOSE_VOTE_RANK (default 1),
//                                 the group's answer to step S's vote is dropped once
//   FT_TEST_PUBLISH_DELAY_MS=MS   every other worker waits MS before publishing its last commit
#include "launch/test_seams.h"

#include <cstdlib>
#include <string>

namespace {

[[maybe_unused]] const bool seams_set = [] {
  const char* rank = std::getenv("RANK");
  const char* loser = std::getenv("FT_TEST_LOSE_VOTE_RANK");
  const bool is_loser = std::string(rank ? rank : "") == std::string(loser ? loser : "1");
  auto& seams = ddp::detail::test_seams();
  const char* at = std::getenv("FT_TEST_LOSE_VOTE_AT");
  if (at != nullptr && is_loser) seams.ft_vote_answer_lost_at_step = std::atoll(at);
  const char* ms = std::getenv("FT_TEST_PUBLISH_DELAY_MS");
  if (ms != nullptr && !is_loser) seams.ft_publish_commit_delay = std::chrono::milliseconds(std::atoll(ms));
  return true;
}();

}  // namespace
