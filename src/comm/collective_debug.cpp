// ProcessGroup's checks on its collectives, apart from running them
// (process_group.cpp): the trace every collective enters (enter, track), the
// DDP_DEBUG=detail desync check, explain_stall after a failure, and the
// progress responder that answers other ranks' explain_stall and dumps
// stacks when a collective has waited half its timeout.

#include <ddp/process_group.h>

#include <ddp/error.h>
#include <ddp/launch_env.h>
#include <ddp/stack_dump.h>

#include "common/error_text.h"
#include "comm/process_group_impl.h"
#include "comm/stall_check.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

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
constexpr const char* kStallReadKey = "ddp/trace/read";
std::string progress_key(int rank) { return "ddp/trace/progress/" + std::to_string(rank); }

// What tells two ranks' collectives apart: the op, the tensor's dtype and
// shape, and the caller's tag (as the DDP_DEBUG=detail check compares them).
std::string fingerprint_of(const CollectiveRecord& r) {
  std::ostringstream text;
  text << r.op << ' ' << r.dtype << ' ' << at::IntArrayRef(r.shape) << ' ' << r.tag;
  std::string out = text.str();
  std::replace(out.begin(), out.end(), '\t', ' ');
  std::replace(out.begin(), out.end(), '\n', ' ');
  return out;
}

// Traces of groups that issued a send or recv. Such a transfer is numbered
// on its two ranks only, so later numbers need not line up across the group,
// and the early desync check draws no verdict from them (a stale pointer of a
// destroyed group only switches that check off for a new one).
std::mutex point_to_point_mutex;
std::unordered_set<const CollectiveTrace*> traces_with_point_to_point;

bool is_point_to_point(const std::string& op) { return op == "send" || op == "recv"; }

bool has_point_to_point(const CollectiveTrace& trace) {
  std::lock_guard<std::mutex> lock(point_to_point_mutex);
  return traces_with_point_to_point.count(&trace) != 0;
}

// How many of its newest collectives a rank publishes with its progress, for
// the others to compare with theirs number by number.
constexpr size_t kPublishedRecords = 32;

// "<entered> <completed> <p2p>\n<first unfinished>\n<last completed>\n" then one
// line per recent record: "<seq>\t<fingerprint>\t<description>". Each rank
// describes its collectives from its own trace.
std::string progress_of(const CollectiveTrace& trace) {
  const uint64_t entered = trace.last_entered();
  const uint64_t completed = trace.last_completed();
  auto pending = trace.find(completed + 1);
  auto done = trace.find(completed);
  std::string text = std::to_string(entered) + " " + std::to_string(completed) + " " +
                     (has_point_to_point(trace) ? "1" : "0") + "\n" +
                     (pending ? describe(*pending) : "") + "\n" +
                     (done ? describe(*done) : (completed ? "#" + std::to_string(completed) : "none"));
  for (const auto& r : trace.recent(kPublishedRecords)) {
    std::string description = describe(r);
    std::replace(description.begin(), description.end(), '\n', ' ');
    text += "\n" + std::to_string(r.seq) + "\t" + fingerprint_of(r) + "\t" + description;
  }
  return text;
}

struct PublishedRecord {
  uint64_t seq = 0;
  std::string fingerprint;
  std::string description;
};

struct Progress {
  uint64_t entered = 0;
  uint64_t completed = 0;
  std::string pending;
  std::string last_completed;
  bool point_to_point = false;  // it issued a send or recv (see traces_with_point_to_point)
  std::vector<PublishedRecord> records;
};

Progress parse_progress(const std::string& text) {
  Progress p;
  std::istringstream in(text);
  in >> p.entered >> p.completed;
  std::string line;
  std::getline(in, line);
  p.point_to_point = line.find('1') != std::string::npos;
  std::getline(in, p.pending);
  std::getline(in, p.last_completed);
  while (std::getline(in, line)) {
    const size_t tab1 = line.find('\t');
    const size_t tab2 = tab1 == std::string::npos ? tab1 : line.find('\t', tab1 + 1);
    if (tab2 == std::string::npos) continue;
    PublishedRecord r;
    try {
      r.seq = std::stoull(line.substr(0, tab1));
    } catch (const std::exception&) {
      continue;
    }
    r.fingerprint = line.substr(tab1 + 1, tab2 - tab1 - 1);
    r.description = line.substr(tab2 + 1);
    p.records.push_back(std::move(r));
  }
  return p;
}

// The first collective number at which `peer` issued something other than
// this rank did, from the records both still hold.
std::optional<std::pair<PublishedRecord, CollectiveRecord>> first_difference(const CollectiveTrace& mine,
                                                                             const Progress& peer) {
  for (const PublishedRecord& theirs : peer.records) {  // oldest first
    auto own = mine.find(theirs.seq);
    // A send on one rank is a recv on the other: never compared.
    const bool transfer = own && (is_point_to_point(own->op) ||
                                  is_point_to_point(theirs.fingerprint.substr(0, theirs.fingerprint.find(' '))));
    if (own && !transfer && fingerprint_of(*own) != theirs.fingerprint) return std::make_pair(theirs, *own);
  }
  return std::nullopt;
}

// Whether something accepts TCP connections at host:port within a second.
bool accepts_connections(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  bool accepted = false;
  for (addrinfo* a = found; a && !accepted; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      accepted = true;
    } else if (errno == EINPROGRESS) {
      pollfd wait_for{fd, POLLOUT, 0};
      int error = 0;
      socklen_t length = sizeof error;
      accepted = ::poll(&wait_for, 1, 1000) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 &&
                 error == 0;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return accepted;
}

// Asks every other rank for its progress: a new request number under the
// request key, which each rank's responder answers (and a rank in its own
// stall report answers itself) under its progress key, prefixed with the
// request number it answered. Waits at most `wait` for answers to this
// request or a later one; fills in the ranks not yet in `reports`.
void collect_progress(c10d::Store& store, const CollectiveTrace& trace, int rank,
                      std::vector<std::optional<Progress>>& reports, std::chrono::milliseconds wait) {
  const int64_t request = store.add(kStallRequestKey, 1);
  int64_t answered = 0;
  // This rank answers too, its own request and any later one while it waits
  // here: a peer stalled at the same moment may ask after this rank did, and
  // this rank's responder may be reconnecting just then.
  auto answer = [&](int64_t number) {
    const std::string mine = std::to_string(number) + "\n" + progress_of(trace);
    store.set(progress_key(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    answered = number;
  };
  answer(request);
  const auto deadline = Clock::now() + wait;
  std::vector<int> waiting;
  for (int r = 0; r < static_cast<int>(reports.size()); ++r) {
    if (r != rank && !reports[r]) waiting.push_back(r);
  }
  while (!waiting.empty() && Clock::now() < deadline) {
    const int64_t latest = store.add(kStallRequestKey, 0);
    if (latest > answered) answer(latest);
    std::vector<int> still;
    for (int r : waiting) {
      if (store.check({progress_key(r)})) {
        auto bytes = store.get(progress_key(r));
        const std::string text(bytes.begin(), bytes.end());
        const size_t newline = text.find('\n');
        int64_t answered = -1;
        try {
          answered = std::stoll(text.substr(0, newline));
        } catch (const std::exception&) {
        }
        if (newline != std::string::npos && answered >= request) {
          reports[r] = parse_progress(text.substr(newline + 1));
          continue;
        }
      }
      still.push_back(r);
    }
    waiting.swap(still);
    if (!waiting.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// What the early desync check (issued_other_collectives) last heard from the
// other ranks of a group, for the stall report that follows it: by then a
// peer that failed at the same check may have ended.
struct HeardReports {
  Clock::time_point when;
  std::vector<std::optional<Progress>> reports;
};
std::mutex heard_mutex;
std::unordered_map<const CollectiveTrace*, HeardReports> heard_reports;

// c10d's TCPStore logs a warning with the c10::Error's backtrace ("frame #")
// before it throws, when the store's host is gone. While ddp asks the store
// something that may fail so, and says so itself, c10's log level is raised
// to errors. Only c10's LOG(WARNING) is affected, for that moment; TORCH_WARN
// (the user's warnings, and torch's) goes through its own handler.
class QuietStoreWarnings {
 public:
  QuietStoreWarnings() {
    std::lock_guard<std::mutex> lock(mutex());
    if (depth()++ == 0) {
      saved() = FLAGS_caffe2_log_level;
      FLAGS_caffe2_log_level = std::max<int>(saved(), c10::GLOG_ERROR);
    }
  }
  ~QuietStoreWarnings() {
    std::lock_guard<std::mutex> lock(mutex());
    if (--depth() == 0) FLAGS_caffe2_log_level = saved();
  }
  QuietStoreWarnings(const QuietStoreWarnings&) = delete;
  QuietStoreWarnings& operator=(const QuietStoreWarnings&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static int& saved() {
    static int s = 0;
    return s;
  }
};

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
  if (!impl_->tracing_) return 0;
  if (is_point_to_point(op)) {
    std::lock_guard<std::mutex> lock(point_to_point_mutex);
    traces_with_point_to_point.insert(impl_->trace_.get());
  }
  const uint64_t seq = impl_->trace_->begin(op, tensor);
  // monitored_barrier has no desync check: it would wait for the very
  // ranks the barrier is to name.
  const bool collective = std::strcmp(op, "send") != 0 && std::strcmp(op, "recv") != 0 &&
                          std::strcmp(op, "monitored_barrier") != 0;
  if (collective && impl_->options_.debug() == DebugLevel::kDetail && impl_->world_.world_size > 1) {
    try {
      check_in_sync(seq, op, tensor);
    } catch (...) {
      impl_->trace_->end(seq, false);
      throw;
    }
  }
  return seq;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::track(uint64_t seq, c10::intrusive_ptr<c10d::Work> work) {
  if (seq == 0) return work;
  std::shared_ptr<CollectiveTrace> trace = impl_->trace_;
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
  opts.timeout = impl_->options_.timeout();
  // Straight to the backend: the check is not a collective of the program's.
  wait(impl_->backend_->allgather(outputs, inputs, opts), "the desync check's all_gather (DDP_DEBUG=detail)");
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
  return trace_file_in(dir, impl_->global_rank_, impl_->name_);
}

std::string ProcessGroup::write_trace() const {
  const std::string path = trace_path();
  return write_text(path, impl_->trace_->json_lines(impl_->global_rank_)) ? path : "";
}

void ProcessGroup::start_progress_responder() {
  if (!impl_->store_ || impl_->backend_kind_ == BackendKind::kMpi) return;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = impl_->store_->clone();  // its own connection: its polls never hold up the group's requests
  } catch (const std::exception&) {
    return;  // a store that cannot be cloned: stalls are explained by the failing ranks alone
  }
  impl_->responder_ = std::make_shared<detail::ProgressResponder>();
  auto* state = impl_->responder_.get();
  std::shared_ptr<CollectiveTrace> trace = impl_->trace_;
  const int rank = impl_->world_.rank;  // in this group: the progress keys are the group's
  const int global_rank = impl_->global_rank_;
  const std::string path = trace_path();
  const auto timeout = impl_->options_.timeout();
  const std::string master_addr = impl_->world_.master_addr;
  const int master_port = impl_->world_.master_port;
  state->thread = std::thread([state, store, trace, rank, global_rank, path, timeout, master_addr,
                               master_port]() mutable {
    uint64_t dumped_for = 0;
    std::string answered;
    int reconnects = 0;
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
      std::string request;
      try {
        QuietStoreWarnings quiet;
        if (store->check({kStallRequestKey})) {
          const auto bytes = store->get(kStallRequestKey);
          request.assign(bytes.begin(), bytes.end());
        }
      } catch (const std::exception&) {
        // The store is gone (rank 0 ended): nobody is left to ask. Or only
        // this connection was cut while the host lives on (seen after the
        // half-timeout stack dump): then a new one, a few times at most.
        const bool host_lives =
            !master_addr.empty() && reconnects < 3 && accepts_connections(master_addr, master_port);
        if (!host_lives) return;
        try {
          ++reconnects;
          store = store->clone();
        } catch (const std::exception&) {
          return;
        }
        continue;
      }
      // Each request once: the early desync check asks while the job may
      // still go on, a stall report when it is failing.
      if (!request.empty() && request != answered) {
        answered = request;
        try {
          QuietStoreWarnings quiet;
          const std::string text = request + "\n" + progress_of(*trace);
          store->set(progress_key(rank), std::vector<uint8_t>(text.begin(), text.end()));
        } catch (const std::exception&) {
        }
        write_text(path, trace->json_lines(global_rank));
      }
      for (int i = 0; i < 4 && !state->stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
}

std::string ProcessGroup::explain_stall(const std::string& cause) const {
  try {
    const std::string written = write_trace();
    const std::string wrote = written.empty() ? "" : " This rank's trace: " + written + ".";
    if (impl_->world_.world_size == 1 || !impl_->store_ || impl_->backend_kind_ == BackendKind::kMpi) {
      return wrote.substr(wrote.empty() ? 0 : 1);
    }
    // A subgroup numbers its own collectives: say which group's they are.
    const std::string on_group = impl_->name_ == "world" ? "" : " of process group " + impl_->name_;
    const uint64_t completed = impl_->trace_->last_completed();
    const uint64_t failed = completed + 1;
    auto record = impl_->trace_->find(failed);
    const std::string what = record ? describe(*record) : "#" + std::to_string(failed);
    // A peer whose connection closed is gone: waiting for its answer would
    // only delay this message (and the launcher may stop this rank first).
    if (cause.find("shared-memory peer") != std::string::npos) {  // backend_shm.cpp's word for it
      return "This rank is in collective " + what + "; a peer on this host died or stopped." + wrote;
    }
    for (const char* gone : {"onnection reset", "onnection closed", "roken pipe", "EOF"}) {
      if (cause.find(gone) != std::string::npos) {
        return "This rank is in collective " + what + "; a peer closed its connection (it died or left)." + wrote;
      }
    }

    QuietStoreWarnings quiet;  // a store whose host is gone: said once below, without frames
    std::vector<std::optional<Progress>> reports(impl_->world_.world_size);
    auto exchange = [&](c10d::Store& store) {
      // The others answer within about 0.2 s (their responders poll).
      collect_progress(store, *impl_->trace_, impl_->world_.rank, reports,
                       std::min<std::chrono::milliseconds>(impl_->options_.timeout(), std::chrono::seconds(2)));
      // Global rank 0 hosts the store (env://): were it to end with its own
      // report, a peer stalled in the same moment would find the store gone
      // and could not compare. So it stays until those peers, inside a
      // collective themselves, have read the reports too, for at most 2 s.
      store.add(kStallReadKey, 1);
      if (impl_->global_rank_ == 0) {
        int64_t readers = 1;
        for (const auto& p : reports) readers += p && p->completed < p->entered ? 1 : 0;
        const auto until = Clock::now() + std::chrono::seconds(2);
        while (store.add(kStallReadKey, 0) < readers && Clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
    };
    // What the early desync check heard just before, for the peers that
    // do not answer now (one that failed at the same check may have ended).
    auto fill_from_early_check = [&] {
      std::lock_guard<std::mutex> lock(heard_mutex);
      auto heard = heard_reports.find(impl_->trace_.get());
      if (heard == heard_reports.end() || Clock::now() - heard->second.when > std::chrono::seconds(5)) return false;
      bool any = false;
      for (size_t r = 0; r < reports.size() && r < heard->second.reports.size(); ++r) {
        if (!reports[r] && heard->second.reports[r]) reports[r] = heard->second.reports[r];
        any = any || reports[r].has_value();
      }
      return any;
    };
    try {
      try {
        exchange(*impl_->store_);
      } catch (const std::exception&) {
        // The group's connection to the store can be cut while its host
        // lives on (seen after the half-timeout stack dump). A new one, if
        // the host still accepts: c10d would otherwise retry connecting for
        // the whole timeout.
        const World& w = impl_->world_;
        if (!w.master_addr.empty() && !accepts_connections(w.master_addr, w.master_port)) throw;
        exchange(*impl_->store_->clone());
      }
    } catch (const std::exception&) {
      if (!fill_from_early_check()) throw;
    }
    fill_from_early_check();

    // Each rank's collectives as its own trace has them: a number two ranks
    // both passed says nothing unless they issued the same collective there.
    std::vector<std::string> findings;
    for (int r = 0; r < impl_->world_.world_size; ++r) {
      if (r == impl_->world_.rank) continue;
      if (!reports[r]) {
        findings.push_back(rank_label(r) +
                           " did not report its progress within 2 s: it is stopped, hung outside ddp, or dead");
        continue;
      }
      const Progress& p = *reports[r];
      const auto difference = first_difference(*impl_->trace_, p);
      if (difference) {
        const auto& [theirs, own] = *difference;
        findings.push_back(rank_label(r) + " issued " + theirs.description + " where this rank issued " +
                           describe(own) + ": the ranks issued different collectives (a desync" + on_group +
                           "). Every rank must call the same collectives in the same order; look for a call that "
                           "only some ranks make (a save, a log, an evaluation under `if (rank == 0)`), or set "
                           "DDP_DEBUG=detail, which stops at the first difference");
      }
      if (p.entered < failed) {
        findings.push_back(rank_label(r) + " never entered collective " + what + on_group +
                           "; its last completed collective is " + p.last_completed);
      } else if (p.completed < failed && !p.pending.empty() && record && p.pending != describe(*record)) {
        findings.push_back(rank_label(r) + " is in " + p.pending + " while this rank is in " + what +
                           (difference ? std::string()
                                       : ": the ranks issued different collectives (DDP_DEBUG=detail stops at the "
                                         "first difference)"));
      }
    }
    std::string text = "This rank is in collective " + what + on_group + ".";
    for (const auto& f : findings) text += " " + f + ".";
    if (findings.empty()) text += " Every other rank reported entering it too, with the same op, size and tag.";
    return text + wrote;
  } catch (const std::exception& e) {
    return "(the ranks' progress could not be compared: " + detail::message_of(e) +
           "; if rank 0, which hosts the store, has ended, its own error is the cause)";
  }
}

namespace detail {

bool issued_other_collectives(c10d::Store& store, const CollectiveTrace& trace, int rank, int world_size) {
  try {
    QuietStoreWarnings quiet;
    std::vector<std::optional<Progress>> reports(world_size);
    collect_progress(store, trace, rank, reports, std::chrono::seconds(2));
    {
      std::lock_guard<std::mutex> lock(heard_mutex);
      heard_reports[&trace] = HeardReports{Clock::now(), reports};
    }
    if (has_point_to_point(trace)) return false;
    for (const auto& report : reports) {
      if (report && !report->point_to_point && first_difference(trace, *report)) return true;
    }
  } catch (const std::exception&) {
    // No answer through the store: the collective's own timeout decides.
  }
  return false;
}

}  // namespace detail

std::string ProcessGroup::describe_or_number(uint64_t seq) const {
  auto record = impl_->trace_->find(seq);
  return record ? describe(*record) : "#" + std::to_string(seq);
}

}  // namespace ddp
