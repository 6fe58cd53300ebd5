#include <ddp/collective_trace.h>

#include <ddp/error.h>

#include "common/json_text.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace ddp {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

thread_local std::string current_tag;

std::string size_text(int64_t bytes) {
  if (bytes >= (1 << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  if (bytes >= 1024) return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / 1024);
  return fmt::format("{} B", bytes);
}

const char* state_name(CollectiveRecord::State state) {
  switch (state) {
    case CollectiveRecord::State::kQueued: return "queued";
    case CollectiveRecord::State::kCompleted: return "completed";
    case CollectiveRecord::State::kFailed: return "failed";
  }
  return "?";
}

}  // namespace

std::string describe(const CollectiveRecord& record) {
  std::string text = "#" + std::to_string(record.seq) + " (" + record.op;
  if (!record.tag.empty()) text += ", " + record.tag;
  return text + ", " + size_text(record.bytes) + ")";
}

size_t CollectiveTrace::default_capacity() {
  if (const char* text = std::getenv("DDP_TRACE_SIZE")) {
    char* end = nullptr;
    long long n = std::strtoll(text, &end, 10);
    DDP_CHECK(end != text && *end == '\0' && n >= 1 && n <= 10000000, "ddp: DDP_TRACE_SIZE='", text,
              "' must be a number of records in [1, 10000000]");
    return static_cast<size_t>(n);
  }
  return 2000;
}

CollectiveTrace::CollectiveTrace(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}

uint64_t CollectiveTrace::begin(const char* op, const at::Tensor& tensor) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t seq = ++last_entered_;
  if (records_.size() < capacity_) {
    // Grow by doubling, but never past the capacity (vector's own growth
    // would reserve up to twice it).
    if (records_.size() == records_.capacity()) {
      records_.reserve(std::min(capacity_, std::max<size_t>(64, 2 * records_.size())));
    }
    records_.emplace_back();
  }
  CollectiveRecord& r = records_[index_of(seq)];
  r.seq = seq;
  r.op = op;
  if (tensor.defined()) {
    r.dtype = c10::toString(tensor.scalar_type());
    r.shape = tensor.sizes().vec();
    r.bytes = static_cast<int64_t>(tensor.numel() * tensor.element_size());
  } else {
    r.dtype.clear();
    r.shape.clear();
    r.bytes = 0;
  }
  r.tag = current_tag;
  r.queued_ns = now;
  r.started_ns = std::max(now, last_end_ns_);
  r.ended_ns = 0;
  r.state = CollectiveRecord::State::kQueued;
  return seq;
}

void CollectiveTrace::end(uint64_t seq, bool ok) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (seq == 0 || seq > last_entered_ || last_entered_ - seq >= records_.size()) return;  // overwritten
  CollectiveRecord& r = records_[index_of(seq)];
  if (r.seq != seq || r.state != CollectiveRecord::State::kQueued) return;
  r.ended_ns = now;
  r.state = ok ? CollectiveRecord::State::kCompleted : CollectiveRecord::State::kFailed;
  last_end_ns_ = std::max(last_end_ns_, now);
  // Advance past every collective that has now completed in order.
  while (last_completed_ < last_entered_) {
    const uint64_t next = last_completed_ + 1;
    if (last_entered_ - next >= records_.size()) {
      last_completed_ = next;  // fell out of the buffer long ago
      continue;
    }
    const CollectiveRecord& n = records_[index_of(next)];
    if (n.seq != next || n.state != CollectiveRecord::State::kCompleted) break;
    last_completed_ = next;
  }
}

uint64_t CollectiveTrace::last_entered() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_entered_;
}

uint64_t CollectiveTrace::last_completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_completed_;
}

std::optional<CollectiveRecord> CollectiveTrace::find(uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (seq == 0 || seq > last_entered_ || last_entered_ - seq >= records_.size()) return std::nullopt;
  const CollectiveRecord& r = records_[index_of(seq)];
  if (r.seq != seq) return std::nullopt;
  return r;
}

std::vector<CollectiveRecord> CollectiveTrace::recent(size_t count) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CollectiveRecord> out;
  const uint64_t held = std::min<uint64_t>(last_entered_, records_.size());
  const uint64_t n = std::min<uint64_t>(held, count);
  for (uint64_t seq = last_entered_ - n + 1; seq <= last_entered_ && n > 0; ++seq) {
    out.push_back(records_[index_of(seq)]);
  }
  return out;
}

std::string CollectiveTrace::json_lines(int rank) const {
  std::string out;
  for (const auto& r : recent(records_.size())) {
    // Compact, one record a line, in this key order: tools/trace/analyze_traces.py
    // and the tests read these lines.
    const detail::OrderedJson line = {
        {"rank", rank}, {"seq", r.seq}, {"op", r.op}, {"dtype", r.dtype}, {"shape", r.shape}, {"bytes", r.bytes},
        {"tag", r.tag}, {"queued_ns", r.queued_ns}, {"started_ns", r.started_ns}, {"ended_ns", r.ended_ns},
        {"state", state_name(r.state)},
    };
    out += detail::compact_json(line);
    out += '\n';
  }
  return out;
}

namespace {
std::mutex fallback_mutex;
std::string& fallback_dir() {
  static std::string dir;
  return dir;
}
}  // namespace

void set_trace_fallback_directory(const std::string& dir) {
  std::lock_guard<std::mutex> lock(fallback_mutex);
  fallback_dir() = dir;
}

std::string trace_fallback_directory() {
  std::lock_guard<std::mutex> lock(fallback_mutex);
  return fallback_dir();
}

CollectiveTag::CollectiveTag(std::string tag) : previous_(std::move(current_tag)) { current_tag = std::move(tag); }

CollectiveTag::~CollectiveTag() { current_tag = std::move(previous_); }

const std::string& CollectiveTag::current() { return current_tag; }

}  // namespace ddp
