// ProcessGroup's checks on its collectives, apart from running them
// (process_group.cpp): the trace every collective enters (enter, track), the
// DDP_DEBUG=detail desync check, explain_stall after a failure, and the
// progress responder that answers other ranks' explain_stall and dumps
// stacks when a collective has waited half its timeout.

#include <ddp/process_group.h>

#include <ddp/error.h>
#include <ddp/launch_env.h>
#include <ddp/stack_dump.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

namespace ddp {

DebugLevel default_debug_level() {
  for (const char* name : {"DDP_DEBUG", "TORCH_DISTRIBUTED_DEBUG"}) {
    if (const char* text = std::getenv(name); text && *text) {
      std::string value(text);
      std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
      if (value == "detail") return DebugLevel::kDetail;
      if (value == "off" || value == "info" || value == "0") return DebugLevel::kOff;
      DDP_CHECK(false, "ddp: ", name, "='", text, "' must be 'detail' or 'off'");
    }
  }
  return DebugLevel::kOff;
}

namespace detail {

struct ProgressResponder {
  std::atomic<bool> stop{false};
  std::thread thread;
  ~ProgressResponder() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
};

}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kStallRequestKey = "ddp/trace/request";
std::string progress_key(int rank) { return "ddp/trace/progress/" + std::to_string(rank); }

// "<entered> <completed>\n<first unfinished>\n<last completed>"
std::string progress_of(const CollectiveTrace& trace) {
  const uint64_t entered = trace.last_entered();
  const uint64_t completed = trace.last_completed();
  auto pending = trace.find(completed + 1);
  auto done = trace.find(completed);
  return std::to_string(entered) + " " + std::to_string(completed) + "\n" + (pending ? describe(*pending) : "") +
         "\n" + (done ? describe(*done) : (completed ? "#" + std::to_string(completed) : "none"));
}

struct Progress {
  uint64_t entered = 0;
  uint64_t completed = 0;
  std::string pending;
  std::string last_completed;
};

Progress parse_progress(const std::string& text) {
  Progress p;
  std::istringstream in(text);
  in >> p.entered >> p.completed;
  std::string line;
  std::getline(in, line);
  std::getline(in, p.pending);
  std::getline(in, p.last_completed);
  return p;
}

// trace_rank3.jsonl for the world's group; trace_group1_rank3.jsonl for
// subgroup 1, which numbers its own collectives: outside the analyser's
// trace_rank*.jsonl, which lines up one group's ranks (give it a group's
// files by name to compare those).
std::string trace_file_in(const std::string& dir, int rank, const std::string& group) {
  if (dir.empty()) return "";
  return dir + (group == "world" ? "" : "/trace_group" + group) + (group == "world" ? "/trace_rank" : "_rank") +
         std::to_string(rank) + ".jsonl";
}

bool write_text(const std::string& path, const std::string& text) {
  if (path.empty()) return false;
  std::ofstream out(path, std::ios::trunc);
  out << text;
  return static_cast<bool>(out);
}

}  // namespace

uint64_t ProcessGroup::enter(const char* op, const at::Tensor& tensor) {
  if (!tracing_) return 0;
  const uint64_t seq = trace_->begin(op, tensor);
  // monitored_barrier has no desync check: it would wait for the very
  // ranks the barrier is to name.
  const bool collective = std::strcmp(op, "send") != 0 && std::strcmp(op, "recv") != 0 &&
                          std::strcmp(op, "monitored_barrier") != 0;
  if (collective && options_.debug() == DebugLevel::kDetail && world_.world_size > 1) {
    try {
      check_in_sync(seq, op, tensor);
    } catch (...) {
      trace_->end(seq, false);
      throw;
    }
  }
  return seq;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::track(uint64_t seq, c10::intrusive_ptr<c10d::Work> work) {
  if (seq == 0) return work;
  std::shared_ptr<CollectiveTrace> trace = trace_;
  try {
    work->getFuture()->addCallback([trace, seq](c10::ivalue::Future& done) { trace->end(seq, !done.hasError()); });
  } catch (const std::exception&) {
    // A backend's work without a future: its end stays unknown in the trace.
  }
  return work;
}

void ProcessGroup::check_in_sync(uint64_t seq, const char* op, const at::Tensor& tensor) {
  std::ostringstream fingerprint;
  fingerprint << op;
  if (tensor.defined()) fingerprint << " " << tensor.scalar_type() << " " << tensor.sizes();
  const std::string& tag = CollectiveTag::current();
  if (!tag.empty()) fingerprint << " tag '" << tag << "'";
  constexpr int64_t kBytes = 256;
  const std::string mine = fingerprint.str().substr(0, kBytes - 1);
  at::Tensor bytes = at::zeros({kBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> inputs{to_control(bytes)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = options_.timeout();
  // Straight to the backend: the check is not a collective of the program's.
  wait(backend_->allgather(outputs, inputs, opts), "the desync check's all_gather (DDP_DEBUG=detail)");
  std::vector<std::string> all;
  for (auto& t : outputs[0]) {
    at::Tensor cpu = t.cpu();
    all.emplace_back(static_cast<const char*>(cpu.data_ptr()));
  }
  for (int r = 1; r < size(); ++r) {
    DDP_CHECK(all[r] == all[0], "ddp: the ranks are out of step at collective #", seq, ": rank 0 issued ", all[0],
              " but rank ", r, " issued ", all[r],
              ". Every rank must call the same collectives in the same order (DDP_DEBUG=detail found this before "
              "the mismatched collective could hang or mix buffers).");
  }
}

std::string ProcessGroup::trace_path() const {
  std::string dir;
  if (const char* d = std::getenv("DDP_TRACE_DIR"); d && *d) {
    dir = d;
  } else if (const char* d2 = std::getenv(launch_env::kLogDir); d2 && *d2) {
    dir = d2;
  } else {
    dir = trace_fallback_directory();
  }
  return trace_file_in(dir, global_rank_, name_);
}

std::string ProcessGroup::write_trace() const {
  const std::string path = trace_path();
  return write_text(path, trace_->json_lines(global_rank_)) ? path : "";
}

void ProcessGroup::start_progress_responder() {
  if (!store_ || backend_kind_ == BackendKind::kMpi) return;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = store_->clone();  // its own connection: its polls never hold up the group's requests
  } catch (const std::exception&) {
    return;  // a store that cannot be cloned: stalls are explained by the failing ranks alone
  }
  responder_ = std::make_shared<detail::ProgressResponder>();
  auto* state = responder_.get();
  std::shared_ptr<CollectiveTrace> trace = trace_;
  const int rank = world_.rank;  // in this group: the progress keys are the group's
  const int global_rank = global_rank_;
  const std::string path = trace_path();
  const auto timeout = options_.timeout();
  state->thread = std::thread([state, store, trace, rank, global_rank, path, timeout] {
    uint64_t dumped_for = 0;
    while (!state->stop) {
      // A collective waiting half its timeout: show every thread's stack
      // once, while there is still time to look at the live process.
      const uint64_t pending = trace->last_completed() + 1;
      if (pending <= trace->last_entered() && pending != dumped_for) {
        if (auto record = trace->find(pending); record && record->state == CollectiveRecord::State::kQueued) {
          const auto now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count();
          const auto waited = std::chrono::nanoseconds(now_ns - record->queued_ns);
          if (waited > timeout / 2 && timeout >= std::chrono::seconds(2)) {
            dumped_for = pending;
            dump_stacks("rank " + std::to_string(global_rank) + "'s collective " + describe(*record) + " has waited " +
                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()) +
                        " ms, half its timeout");
          }
        }
      }
      bool asked = false;
      try {
        asked = store->check({kStallRequestKey});
      } catch (const std::exception&) {
        // The store is gone (rank 0 ended): nobody is left to ask.
        return;
      }
      if (asked) {
        try {
          const std::string text = progress_of(*trace);
          store->set(progress_key(rank), std::vector<uint8_t>(text.begin(), text.end()));
        } catch (const std::exception&) {
        }
        write_text(path, trace->json_lines(global_rank));
        return;
      }
      for (int i = 0; i < 4 && !state->stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
}

std::string ProcessGroup::explain_stall(const std::string& cause) const {
  try {
    const std::string written = write_trace();
    const std::string wrote = written.empty() ? "" : " This rank's trace: " + written + ".";
    if (world_.world_size == 1 || !store_ || backend_kind_ == BackendKind::kMpi) return wrote.substr(wrote.empty() ? 0 : 1);
    // A subgroup numbers its own collectives: say which group's they are.
    const std::string on_group = name_ == "world" ? "" : " of process group " + name_;
    const uint64_t completed = trace_->last_completed();
    const uint64_t failed = completed + 1;
    auto record = trace_->find(failed);
    const std::string what = record ? describe(*record) : "#" + std::to_string(failed);
    // A peer whose connection closed is gone: waiting for its answer would
    // only delay this message (and the launcher may stop this rank first).
    for (const char* gone : {"onnection reset", "onnection closed", "roken pipe", "EOF"}) {
      if (cause.find(gone) != std::string::npos) {
        return "This rank is in collective " + what + "; a peer closed its connection (it died or left)." + wrote;
      }
    }

    const std::string mine = progress_of(*trace_);
    store_->set(progress_key(world_.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    store_->set(kStallRequestKey, std::vector<uint8_t>{'1'});
    // The others answer within about 0.2 s (their responders poll).
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.timeout(), std::chrono::seconds(2));
    std::vector<int> waiting;
    for (int r = 0; r < world_.world_size; ++r) {
      if (r != world_.rank) waiting.push_back(r);
    }
    std::vector<std::optional<Progress>> reports(world_.world_size);
    while (!waiting.empty() && Clock::now() < deadline) {
      std::vector<int> still;
      for (int r : waiting) {
        if (store_->check({progress_key(r)})) {
          auto bytes = store_->get(progress_key(r));
          reports[r] = parse_progress(std::string(bytes.begin(), bytes.end()));
        } else {
          still.push_back(r);
        }
      }
      waiting.swap(still);
      if (!waiting.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }

    std::vector<std::string> findings;
    for (int r = 0; r < world_.world_size; ++r) {
      if (r == world_.rank) continue;
      if (!reports[r]) {
        findings.push_back(rank_label(r) +
                           " did not report its progress within 2 s: it is stopped, hung outside ddp, or dead");
        continue;
      }
      const Progress& p = *reports[r];
      if (p.entered < failed) {
        std::string last = p.completed == completed ? describe_or_number(completed) : p.last_completed;
        findings.push_back(rank_label(r) + " never entered collective " + what + on_group +
                           "; its last completed collective is " + last);
      } else if (p.completed < failed && !p.pending.empty() && record && p.pending != describe(*record)) {
        findings.push_back(rank_label(r) + " is in " + p.pending + " while this rank is in " + what +
                           ": the ranks issued different collectives (DDP_DEBUG=detail stops at the first difference)");
      }
    }
    std::string text = "This rank is in collective " + what + on_group + ".";
    for (const auto& f : findings) text += " " + f + ".";
    if (findings.empty()) text += " Every other rank reported entering it too.";
    return text + wrote;
  } catch (const std::exception& e) {
    return std::string("(the ranks' progress could not be compared: ") + e.what() + ")";
  }
}

std::string ProcessGroup::describe_or_number(uint64_t seq) const {
  auto record = trace_->find(seq);
  return record ? describe(*record) : "#" + std::to_string(seq);
}

}  // namespace ddp
