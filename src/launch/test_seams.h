#pragma once

// Internal, never installed: hooks that let tests hold the library back at
// the moment a race would happen. Only test code sets them (in its own
// process, or in a rank process of support/ranks.h before the library
// runs); no environment variable, option or file reaches them, so nothing
// outside a test can steer a production program through them. All zero by
// default.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>

namespace ddp::detail {

struct TestSeams {
  /// An async SnapshotSaver's thread waits this long before each write, so a
  /// test can change the parameters or fill the queue while a save is
  /// pending. Read when a writer's thread starts.
  std::chrono::milliseconds async_snapshot_write_delay{0};
  /// Rank 0 waits this long before it commits a distributed checkpoint, with
  /// the directory's lock held, so that a second job's save surely meets it.
  std::chrono::milliseconds checkpoint_commit_delay{0};
  /// FaultTolerance: the group's answer to this member's vote of this step
  /// is dropped once (as if the group broke right after the vote was sent),
  /// so the member must learn the verdict from the store. -1: never.
  long long ft_vote_answer_lost_at_step = -1;
  /// FaultTolerance: a member waits this long before it publishes its last
  /// commit at the end of a generation (a slow store, a stalled watcher).
  std::chrono::milliseconds ft_publish_commit_delay{0};
  /// FaultTolerance: wraps each store connection the member opens (so a test
  /// can stall this member's store operations only), and is told when the
  /// member first sees a step fail. Unset: neither happens.
  std::function<c10::intrusive_ptr<c10d::Store>(c10::intrusive_ptr<c10d::Store>)> ft_wrap_store;
  std::function<void()> ft_on_failure_seen;
  /// FaultTolerantHSDP: called in should_commit() after the replica group
  /// agreed on letting joiners in and before this process's quorum votes
  /// (a test kills the process there, between its group's two quorums).
  std::function<void()> ft_hsdp_before_vote;
};

/// This process's seams. Defined in the library, not inline, so a test and
/// libddp.so share one instance.
TestSeams& test_seams();

}  // namespace ddp::detail
