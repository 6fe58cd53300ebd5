#pragma once

// What each rank's collectives were, for when a job hangs or ranks disagree.
// Every collective a ProcessGroup issues gets a sequence number and a record
// in a bounded ring buffer: the op, dtype, size, the caller's tag ("ddp
// bucket 2/3", "fsdp unit 5 all-gather", ...), when it was queued, when the
// backend could start it and when it ended. On a timeout or failure the
// ranks compare their last entered and last completed sequence numbers, so
// the error names who is behind and where; each rank writes its records as
// JSON lines (tools/trace/analyze_traces.py finds the first divergence).
//
//   { ddp::CollectiveTag tag("my eval all-reduce");  // names the collectives issued inside
//     group->all_reduce(metric); }

#include <ddp/export.h>
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ddp {

/// One collective as one rank saw it.
struct CollectiveRecord {
  enum class State { kQueued, kCompleted, kFailed };
  uint64_t seq = 0;       ///< 1, 2, 3, ... in issue order, the same on every rank of a healthy job
  std::string op;         ///< "all_reduce", "broadcast", ...
  std::string dtype;      ///< "Float", ...
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  std::string tag;        ///< the caller's CollectiveTag, or "" when none
  int64_t queued_ns = 0;  ///< wall clock (ns since the epoch) when issued
  /// When the backend could begin it: the later of queued and the previous
  /// collective's end (backends run a group's collectives in order).
  int64_t started_ns = 0;
  int64_t ended_ns = 0;   ///< 0 while it has not ended
  State state = State::kQueued;
};

/// "#532 (all_reduce, ddp bucket 2/3, 1.0 MiB)".
DDP_API std::string describe(const CollectiveRecord& record);

/// A rank's ring buffer of its last `capacity` collectives. Thread-safe:
/// backends complete collectives on their own threads. Records are allocated
/// as collectives are issued (about 200 bytes each), not up front: a large
/// DDP_TRACE_SIZE costs memory only in a job that issues that many.
class DDP_API CollectiveTrace {
 public:
  /// DDP_TRACE_SIZE from the environment, else 2000 records.
  static size_t default_capacity();

  explicit CollectiveTrace(size_t capacity = default_capacity());

  /// Records a collective being issued; returns its sequence number.
  uint64_t begin(const char* op, const at::Tensor& tensor);
  /// Marks `seq` ended, successfully or not.
  void end(uint64_t seq, bool ok);

  /// The newest sequence number issued (0 before the first).
  uint64_t last_entered() const;
  /// The newest sequence number up to which every collective completed.
  uint64_t last_completed() const;
  /// The record of `seq` if it is still in the buffer.
  std::optional<CollectiveRecord> find(uint64_t seq) const;
  /// The newest `count` records, oldest first.
  std::vector<CollectiveRecord> recent(size_t count) const;
  /// One JSON object per line, oldest first, each with this `rank`.
  std::string json_lines(int rank) const;

 private:
  size_t index_of(uint64_t seq) const { return static_cast<size_t>((seq - 1) % capacity_); }

  mutable std::mutex mutex_;
  size_t capacity_;
  std::vector<CollectiveRecord> records_;  // grows to capacity_, then wraps
  uint64_t last_entered_ = 0;
  uint64_t last_completed_ = 0;
  int64_t last_end_ns_ = 0;
};

/// Where traces go when neither DDP_TRACE_DIR nor DDP_LOG_DIR is set: the
/// snapshot directory, noted by SnapshotSaver and load_newest_snapshot.
DDP_API void set_trace_fallback_directory(const std::string& dir);
DDP_API std::string trace_fallback_directory();

/// While alive, collectives issued by this thread carry `tag` in the trace
/// (and in the desync check's fingerprint). Tags nest; the innermost wins.
class DDP_API CollectiveTag {
 public:
  explicit CollectiveTag(std::string tag);
  ~CollectiveTag();
  CollectiveTag(const CollectiveTag&) = delete;
  CollectiveTag& operator=(const CollectiveTag&) = delete;
  /// The innermost tag of this thread, or "".
  static const std::string& current();

 private:
  std::string previous_;
};

}  // namespace ddp
