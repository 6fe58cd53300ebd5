#pragma once

// Internal: the one retention policy of SnapshotSaver (see the top of
// include/ddp/snapshot_saver.h), for both kinds of snapshot. Each kind
// lists what lies in its directory (snapshot.cpp: DIR/snapshot_<epoch>.pt;
// sharded_snapshot.cpp: DIR/sharded_step_<step>); which of them go is
// decided by snapshots_to_remove alone.

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace ddp::detail {

/// A snapshot in a saver's directory, as the retention policy sees it.
struct SnapshotOnDisk {
  std::string path;
  int64_t step = 0;   ///< optimizer steps taken, as recorded inside it
  int64_t epoch = -1;
  /// It validates, holds the model of the snapshot just written (the same
  /// names and shapes) and is no symbolic link.
  bool ours = false;
  /// This process resumed from it.
  bool resumed_from = false;
};

/// Whether `a` is further along than `b`: more steps, then a later epoch.
/// Never the file time: after one unreadable file once sent a run back to
/// epoch 0, the fresh epoch-0 snapshots were the most recently written.
inline bool further_along(const SnapshotOnDisk& a, const SnapshotOnDisk& b) {
  return std::tie(a.step, a.epoch) > std::tie(b.step, b.epoch);
}

/// The snapshot just written and the others in its directory.
struct SnapshotListing {
  SnapshotOnDisk written;
  std::vector<SnapshotOnDisk> others;
};

/// The paths of `listing.others` to remove so that the `keep` of this run's
/// snapshots furthest along remain, the one written always among them;
/// keep <= 0 removes none. Only `ours` count or go, and of them never one
/// that is not behind the one written, nor one `resumed_from`.
std::vector<std::string> snapshots_to_remove(const SnapshotListing& listing, int keep);

/// The DIR/snapshot_<epoch>.pt files beside `written`. Throws, naming it,
/// when `written` does not validate. (snapshot.cpp)
SnapshotListing list_snapshot_files(const std::string& dir, const std::string& written);
/// The DIR/sharded_step_<step> snapshots beside `written`, reading only
/// their headers. Throws, naming it, when `written` does not validate.
/// (sharded_snapshot.cpp)
SnapshotListing list_sharded_snapshots(const std::string& dir, const std::string& written);

/// `path` made absolute and canonical as far as it exists: the key of
/// directories claimed by savers and of snapshots resumed from.
std::string canonical_path(const std::string& path);
/// Whether this process resumed from `path` (see note_resumed_from).
bool resumed_from(const std::string& path);

}  // namespace ddp::detail
