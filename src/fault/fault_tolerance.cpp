// FaultTolerance: the quorum, the per-step vote, recovery and healing.
//
// The store's keys (all under "ft/"):
//   gen                   the newest generation whose membership is decided
//   q/<g>/m               generation g's membership (membership.h), written once by compareSet
//   q/<g>/a/<id>          <id> came to form generation g
//   q/<g>/dead/<id>       <id>'s connections hung up (crash) or it left, before it came
//   abort/<g>             generation g failed: every member drops its group
//   pg/<g>/...            the Gloo group of generation g; socks/<g>/<id> its members' socket addresses
//   s/<g>/<step>/v        a step's verdict, written only when a member's vote over the
//                         group failed (should_commit): the rare path
//   join_seq, join/<k>    joiners, in order of arrival; hb/<id> a joiner's heartbeats (a
//                         member's beats go over its liveness connections)
//
// A step is attempted at most once per generation (a failure ends the
// generation), so (generation, step) names an attempt.

#include <ddp/fault_tolerance.h>

#include <ddp/error.h>

#include "comm/backends.h"
#include "fault/ft_store.h"
#include "fault/heal_state.h"
#include "fault/membership.h"
#include "fault/socket_watch.h"
#include "launch/test_seams.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/Functions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ddp {
namespace {

using Clock = std::chrono::steady_clock;
using detail::Membership;

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::string(value) : fallback;
}

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// The CPU's default generator, which a skipped step must leave as it found
// it and a joiner receives.
at::Generator cpu_generator() { return at::detail::getDefaultCPUGenerator(); }

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string ids_text(const std::vector<std::string>& ids) {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) text += (i ? ", " : "") + ids[i];
  return text;
}

// Keys.
std::string k_gen() { return "ft/gen"; }
std::string k_members(int64_t g) { return "ft/q/" + std::to_string(g) + "/m"; }
std::string k_arrived(int64_t g, const std::string& id) { return "ft/q/" + std::to_string(g) + "/a/" + id; }
std::string k_dead(int64_t g, const std::string& id) { return "ft/q/" + std::to_string(g) + "/dead/" + id; }
std::string k_abort(int64_t g) { return "ft/abort/" + std::to_string(g); }
std::string k_socks(int64_t g, const std::string& id) { return "ft/socks/" + std::to_string(g) + "/" + id; }
std::string k_verdict(int64_t g, int64_t s) { return "ft/s/" + std::to_string(g) + "/" + std::to_string(s) + "/v"; }
std::string k_join_seq() { return "ft/join_seq"; }
std::string k_join(int64_t k) { return "ft/join/" + std::to_string(k); }
std::string k_heartbeat(const std::string& id) { return "ft/hb/" + id; }
std::string k_live(const std::string& id) { return "ft/live/" + id; }

// The host of the store's first endpoint: every replica reaches it, so the
// local address towards it is one the others can reach.
std::string store_host(const std::string& spec) {
  std::string rest = spec.substr(spec.find("://") == std::string::npos ? 0 : spec.find("://") + 3);
  rest = rest.substr(0, rest.find_first_of(",/"));
  return rest.substr(0, rest.rfind(':'));
}

// One generation: its membership and its Gloo group.
struct Generation {
  int64_t g = 0;
  Membership membership;
  int rank = -1;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<detail::TrackedSocket> sockets;
  bool aborted = false;  // guarded by Impl::mutex_
  std::map<std::string, std::string> id_of_address;  // filled on the first hang-up
  int size() const { return static_cast<int>(membership.ids.size()); }
};

// A bucket's all-reduce in flight: its future completes once, with the
// average, or with the bucket untouched when the step failed (the step is
// then skipped, so the value does not matter, and the reduced tensor is the
// hook's own: an abandoned operation can never write into the bucket).
struct PendingBucket {
  c10::intrusive_ptr<c10::ivalue::Future> out = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  at::Tensor result;
  at::Tensor fallback;
  Clock::time_point issued = Clock::now();
  std::atomic<bool> done{false};
  void finish(bool ok) {
    if (done.exchange(true)) return;
    out->markCompleted(ok ? result : fallback);
  }
  /// Once `out` is ready: whether the operation completed (else it failed or was given back).
  bool completed() const { return out->value().toTensor().unsafeGetTensorImpl() == result.unsafeGetTensorImpl(); }
};

enum class Reconfigure { kNone, kFailure, kJoin };

}  // namespace

constexpr double kFaultTolerantBucketMb = 2.0;

bool fault_tolerance_requested() { return env_or("DDP_FAULT_TOLERANCE", "0") == "1"; }

FaultToleranceOptions::FaultToleranceOptions() {
  store_ = env_or("DDP_FT_STORE", "");
  replica_id_ = env_or("DDP_FT_REPLICA_ID", "");
  if (const char* n = std::getenv("DDP_FT_INITIAL_REPLICAS"); n && *n) initial_replicas_ = std::atoi(n);
  if (const char* d = std::getenv("DDP_FT_DEADLINE_MS"); d && *d) {
    deadline_ = std::chrono::milliseconds(std::atoll(d));
  }
  if (const char* k = std::getenv("DDP_FT_HEAL_SENDERS"); k && *k) heal_senders_ = std::atoi(k);
}

struct FaultTolerance::Impl {
  FaultToleranceOptions options;
  std::string id;
  c10::intrusive_ptr<c10d::Store> store;    // the training thread's connection
  c10::intrusive_ptr<c10d::Store> wstore;   // the watcher's own
  std::shared_ptr<ProcessGroup> local;

  std::shared_ptr<torch::nn::Module> module;
  torch::optim::Optimizer* optimizer = nullptr;
  FaultTolerantSampler* sampler = nullptr;
  std::vector<std::pair<std::function<void(torch::serialize::OutputArchive&)>,
                        std::function<void(torch::serialize::InputArchive&)>>>
      extra_state;

  // Shared with the watcher and Gloo's callback threads.
  mutable std::mutex mutex;
  std::shared_ptr<Generation> current;
  std::vector<std::shared_ptr<PendingBucket>> pending;
  bool step_failed = false;
  std::string failure_cause;
  Clock::time_point failure_time;
  bool wake = false;
  std::condition_variable wake_cv;
  // Heartbeats seen in the store: value and when it last changed, per
  // replica watched. A joiner's only, and a member's until its beats come
  // over its liveness connection (`beats`).
  std::map<std::string, std::pair<std::string, Clock::time_point>> heartbeats;
  std::set<std::string> watched;
  // When each peer's beat last came over its liveness connection.
  std::map<std::string, Clock::time_point> beats;

  // Liveness connections (socket_watch.h), one each way between every two
  // members: this member's to each peer's listener (live_out) carries
  // "hello <id>" once, then a beat "b" every heartbeat interval; the
  // peers' to this one (live_in) are read for theirs. Beats travel there,
  // not through the store: over etcd a store heartbeat was a raft commit on
  // every member ten times a second per worker (a third of a core in the
  // churn benchmark), and a stalled store stopped them all at once, so that
  // healthy members took each other for hung. The beater thread sends,
  // receives, accepts and watches hang-ups; the watcher only connects (it
  // looks the address up in the store). Guarded by live_mutex.
  struct Inbound {
    int fd = -1;
    detail::LivenessInbound lines;
  };
  std::mutex live_mutex;
  int live_listener = -1;
  std::map<std::string, int> live_out;
  std::vector<Inbound> live_in;
  std::set<std::string> live_tried;  // the watcher's only
  std::set<std::string> exited;  // peers whose liveness connection hung up; guarded by mutex
  std::thread beater;
  // Since when this member has had a connection to every other member of
  // its generation (the watcher's only): a heartbeat_timeout later its
  // beats have reached them all, and it stops writing them to the store.
  std::optional<Clock::time_point> connected_to_all_since;

  std::atomic<int64_t> join_seq_seen{0};
  std::atomic<int64_t> joined_upto{0};
  std::atomic<int64_t> current_step{0};
  std::atomic<int64_t> current_gen{0};
  std::atomic<bool> hold{false};
  std::atomic<bool> stop{false};
  std::atomic<bool> destroyed{false};  // the FaultTolerance is gone; only hooks hold this

  // The vote (should_commit). Guarded by `mutex`. Once this member has sent
  // its vote of (vote_gen, vote_step) over the group, another member may
  // have committed that step on the group's answer, so this one must never
  // declare it skipped on its own (abort_generation).
  int64_t vote_gen = -1;
  int64_t vote_step = -1;
  // This member's last step committed on the group's answer, published to
  // the store when the generation ends, for a member whose own vote failed
  // and who asks the store (should_commit's rare path).
  struct LastCommit {
    int64_t g = -1;
    int64_t step = -1;
    std::string verdict;
    bool publishing = false;
    bool published = false;
  } last_commit;
  std::condition_variable published_cv;
  // Set when a published commit found "skip" already decided: this member
  // applied a step the others dropped, and must leave (start_step throws).
  std::atomic<bool> diverged{false};
  std::thread watcher;

  // Groups to destroy off the training thread (one stuck in a send to a dead
  // peer only returns at its timeout).
  std::mutex reap_mutex;
  std::condition_variable reap_cv;
  std::deque<std::shared_ptr<Generation>> to_reap;
  std::thread reaper;

  bool joined = false;
  bool left = false;
  Reconfigure reconfigure = Reconfigure::kNone;
  int64_t step = 0;
  at::Tensor rng_before_step;
  Clock::time_point step_started;
  // should_commit() committed this step and skip_committed_step() may still
  // drop it; the managed sampler's position before it advanced.
  bool committed_unconfirmed = false;
  std::pair<int64_t, int64_t> sampler_before_step{0, 0};
  // The managed module's buffers (broadcast_buffers), and what they were at
  // the start of the step's attempt, packed as heal_state.h packs a shard.
  detail::HealTensors step_buffers;
  at::Tensor step_buffers_at_start;
  FaultToleranceStats stats;
  int64_t store_ops = 0;
  int64_t store_ops_counted_steps = 0;
  std::vector<std::string> keys_of_old_generations;
  // The store's endpoints as "ip:port": the connections of its clients (the
  // etcd client's HTTP connections open and close on any thread, while a
  // group is made too) are never a group's.
  std::set<std::string> store_addresses;
  // The last heal, for the log lines: bytes from each sender (on a joiner),
  // the joiner's time to receive it all, and what this member sent.
  std::vector<std::pair<std::string, int64_t>> healed_from;
  double heal_transfer_ms = 0;
  int64_t heal_bytes_sent_now = 0;

  const bool debug = env_or("DDP_FT_DEBUG", "0") == "1";

  explicit Impl(FaultToleranceOptions o) : options(std::move(o)) {}

  // ---- the watcher -----------------------------------------------------------

  void start_threads() {
    watcher = std::thread([this] { watch(); });
    reaper = std::thread([this] { reap(); });
    beater = std::thread([this] { beat(); });
  }

  void stop_threads() {
    stop = true;
    {
      std::lock_guard<std::mutex> lock(mutex);
      wake = true;
    }
    wake_cv.notify_all();
    reap_cv.notify_all();
    if (watcher.joinable()) watcher.join();
    if (reaper.joinable()) reaper.join();
    if (beater.joinable()) beater.join();
  }

  void note_failure(int64_t g, const std::string& cause) {
    if (const auto& seen = detail::test_seams().ft_on_failure_seen) seen();
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!current || current->g != g || step_failed) return;
      step_failed = true;
      failure_cause = cause;
      failure_time = Clock::now();
      wake = true;
    }
    wake_cv.notify_all();
  }

  bool has_exited(const std::string& who) {
    std::lock_guard<std::mutex> lock(mutex);
    return exited.count(who) > 0;
  }

  // Connects to the members not connected yet, and says hello on each new
  // connection. Whether this member still needs to write its heartbeat to
  // the store: until its beats have had time to reach every other member.
  bool watch_liveness(const std::shared_ptr<Generation>& gen) {
    // New sockets only while no group is being made (its sockets are found
    // by diffing); never wait for that, which can take a deadline.
    std::unique_lock<std::mutex> tracking(detail::socket_tracking_mutex(), std::try_to_lock);
    if (tracking.owns_lock() && gen) {
      for (const auto& who : gen->membership.ids) {
        if (who == id || live_tried.count(who) || !wstore->check({k_live(who)})) continue;
        live_tried.insert(who);
        const int fd = detail::connect_for_liveness(text_of(wstore->get(k_live(who))));
        if (fd < 0) continue;
        const std::string hello = "hello " + id + "\n";
        (void)::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        std::lock_guard<std::mutex> live(live_mutex);
        live_out[who] = fd;
      }
    }
    tracking.unlock();
    bool all = gen != nullptr;
    {
      std::lock_guard<std::mutex> live(live_mutex);
      for (const auto& who : gen ? gen->membership.ids : std::vector<std::string>{}) {
        all = all && (who == id || live_out.count(who) > 0);
      }
    }
    if (!all) {
      connected_to_all_since.reset();
      return true;
    }
    if (!connected_to_all_since) connected_to_all_since = Clock::now();
    return Clock::now() - *connected_to_all_since < options.heartbeat_timeout();
  }

  // The beater thread: beats on every outgoing connection each heartbeat
  // interval, and reads the incoming ones. It never touches the store, so a
  // stalled store never stops this member's beats.
  void beat() {
    auto next_beat = Clock::now();
    char buffer[4096];
    while (!stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const auto now = Clock::now();
      std::vector<std::string> seen, gone;
      {
        std::lock_guard<std::mutex> live(live_mutex);
        {
          std::unique_lock<std::mutex> tracking(detail::socket_tracking_mutex(), std::try_to_lock);
          if (tracking.owns_lock()) {
            for (int fd : detail::accept_pending(live_listener)) live_in.push_back(Inbound{fd, {}});
          }
        }
        if (now >= next_beat) {
          next_beat = now + options.heartbeat_interval();
          for (const auto& [who, fd] : live_out) (void)::send(fd, "b\n", 2, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        for (auto it = live_in.begin(); it != live_in.end();) {
          bool closed = false, heard = false;
          // A bounded read per round: a flooding connection cannot hold the beats back.
          for (int reads = 0; !closed && reads < 16; ++reads) {
            const ssize_t n = ::recv(it->fd, buffer, sizeof buffer, MSG_DONTWAIT);
            if (n > 0) {
              heard = true;
              closed = !it->lines.feed(buffer, static_cast<size_t>(n));  // not a peer of this job
              continue;
            }
            closed = n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
            break;
          }
          // Any line counts: a beat, or the hello that starts the clock.
          if (heard && !it->lines.who.empty()) seen.push_back(it->lines.who);
          if (closed) {
            ::close(it->fd);
            it = live_in.erase(it);
          } else {
            ++it;
          }
        }
        for (auto it = live_out.begin(); it != live_out.end();) {
          if (detail::peer_hung_up(it->second)) {
            gone.push_back(it->first);
            ::close(it->second);
            it = live_out.erase(it);
          } else {
            ++it;
          }
        }
      }
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& who : gone) exited.insert(who);
      for (const auto& who : seen) beats[who] = now;
    }
  }

  void close_liveness() {
    std::lock_guard<std::mutex> live(live_mutex);
    for (auto& [who, fd] : live_out) ::close(fd);
    for (const auto& in : live_in) ::close(in.fd);
    if (live_listener >= 0) ::close(live_listener);
    live_out.clear();
    live_in.clear();
    live_listener = -1;
  }

  bool heartbeat_stale(const std::string& who) {
    std::lock_guard<std::mutex> lock(mutex);
    watched.insert(who);
    const auto now = Clock::now();
    if (auto b = beats.find(who); b != beats.end()) return now - b->second > options.heartbeat_timeout();
    auto it = heartbeats.find(who);
    if (it == heartbeats.end()) return false;  // not seen yet: the watcher looks within one interval
    return Clock::now() - it->second.second > options.heartbeat_timeout();
  }

  static constexpr std::chrono::milliseconds kAbortPoll{250};

  void watch() {
    int64_t beat = 0;
    auto next_beat = Clock::now();
    auto next_abort_poll = Clock::now();
    bool store_beat = true;
    while (!stop) {
      std::shared_ptr<Generation> gen;
      bool failed = false;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake_cv.wait_for(lock, std::chrono::milliseconds(10), [&] { return stop.load() || wake; });
        wake = false;
        if (stop) break;
        gen = current;
        failed = step_failed;
      }
      try {
        if (Clock::now() >= next_beat) {
          next_beat = Clock::now() + options.heartbeat_interval();
          if (store_beat) wstore->set(k_heartbeat(id), bytes_of(std::to_string(++beat)));
          // One read (join() counts itself in before it needs a member's
          // vote, so a missing key only means no joiner yet).
          join_seq_seen = wstore->add(k_join_seq(), 0);
          std::set<std::string> ids;
          {
            std::lock_guard<std::mutex> lock(mutex);
            for (const auto& who : watched) {
              if (beats.count(who) == 0) ids.insert(who);  // beats come over its connection instead
            }
          }
          for (const auto& who : ids) {
            if (who == id || !wstore->check({k_heartbeat(who)})) continue;
            std::string value = text_of(wstore->get(k_heartbeat(who)));
            std::lock_guard<std::mutex> lock(mutex);
            auto it = heartbeats.find(who);
            if (it == heartbeats.end() || it->second.first != value) heartbeats[who] = {value, Clock::now()};
          }
        }
        store_beat = watch_liveness(gen);
        bool aborted = false;
        {
          std::lock_guard<std::mutex> lock(mutex);
          aborted = !gen || gen->aborted;
        }
        if (!aborted) {
          auto hung_up = detail::hung_up_peers(gen->sockets);
          if (failed && hung_up.empty()) {
            // A connection error seen by Gloo can come before the socket
            // shows its hang-up here: look again briefly, so the crashed peer
            // is named now rather than after its heartbeat times out.
            std::string cause;
            {
              std::lock_guard<std::mutex> lock(mutex);
              cause = failure_cause;
            }
            for (int i = 0; i < 10 && hung_up.empty() && cause.find("imed out") == std::string::npos; ++i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(2));
              hung_up = detail::hung_up_peers(gen->sockets);
            }
          }
          if (!hung_up.empty() && !failed) {
            // Gloo closes its pairs on its own timeout too: give the failing
            // operation's error (which says "Timed out") time to arrive first.
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          if (!hung_up.empty()) {
            abort_generation(*wstore, gen, "crash: connection closed", hung_up);
          } else if (overdue()) {
            abort_generation(*wstore, gen, "deadline: a collective did not finish in " +
                                               std::to_string(options.deadline().count()) + " ms", {});
          } else if (failed) {
            abort_generation(*wstore, gen, "", {});
          } else if (Clock::now() >= next_abort_poll) {
            // A backstop: an abort shuts the group's sockets, which the
            // members see at once above; over etcd each poll is a request.
            next_abort_poll = Clock::now() + kAbortPoll;
            if (wstore->check({k_abort(gen->g)})) abort_generation(*wstore, gen, "another member failed", {});
          }
        }
      } catch (const std::exception& e) {
        // The store is out of reach for now; the training thread's own calls
        // report it. Back off so a dead store does not spin.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }

  // The step deadline: a bucket's all-reduce outstanding for longer. It is
  // enforced here, not by Gloo's timeout, because Gloo closes every pair of
  // a group that timed out before this member could say it is alive (see
  // abort_generation), and the others would take that for a crash.
  bool overdue() {
    std::lock_guard<std::mutex> lock(mutex);
    const auto now = Clock::now();
    for (const auto& p : pending) {
      if (!p->done && now - p->issued > options.deadline()) return true;
    }
    return false;
  }

  // Which member a hung-up peer address belongs to: each member published
  // the local addresses of its group's sockets.
  std::string member_at(c10d::Store& s, Generation& gen, const std::string& address) {
    if (gen.id_of_address.empty()) {
      for (const auto& who : gen.membership.ids) {
        if (who == id || !s.check({k_socks(gen.g, who)})) continue;
        std::stringstream in(text_of(s.get(k_socks(gen.g, who))));
        for (std::string a; in >> a;) gen.id_of_address[a] = who;
      }
    }
    auto it = gen.id_of_address.find(address);
    return it == gen.id_of_address.end() ? "" : it->second;
  }

  // Generation `gen` failed: say so to every member (abort/<g>), mark the
  // peers that hung up without coming to the next quorum as crashed, come
  // to the next quorum, shut the group's sockets (pending operations fail at
  // once) and give the pending buckets back. The arrival is written before
  // the sockets close, so no member takes this one's hang-up for a crash.
  void abort_generation(c10d::Store& s, const std::shared_ptr<Generation>& gen, const std::string& cause,
                        const std::vector<std::string>& hung_up) {
    if (debug) {
      std::string peers;
      for (const auto& a : hung_up) peers += a + " ";
      std::fprintf(stderr, "ddp: ft debug: %s aborts generation %lld: %s [%s]\n", id.c_str(),
                   static_cast<long long>(gen->g), cause.c_str(), peers.c_str());
    }
    if (const auto& seen = detail::test_seams().ft_on_failure_seen) seen();
    publish_last_commit(s, gen->g);
    if (diverged) leave_diverged(s, gen->g);
    bool voted;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (gen->aborted) return;
      voted = vote_gen == gen->g && vote_step == current_step.load();
    }
    const int64_t next = gen->g + 1;
    bool timed_out = cause.find("imed out") != std::string::npos;
    const bool ahead = diverged;
    {
      std::lock_guard<std::mutex> lock(mutex);
      timed_out = timed_out || failure_cause.find("imed out") != std::string::npos;
    }
    // After this member's own timeout Gloo closes the pairs itself: their
    // closing says nothing about the peers, which the heartbeats judge.
    for (const auto& address : timed_out ? std::vector<std::string>{} : hung_up) {
      std::string who = member_at(s, *gen, address);
      // compareSet: a member that left cleanly said so first.
      if (!who.empty() && !s.check({k_arrived(next, who)})) s.compareSet(k_dead(next, who), {}, bytes_of("crash"));
    }
    if (!ahead) s.set(k_arrived(next, id), bytes_of("1"));
    s.set(k_abort(gen->g), bytes_of("1"));
    // A member waiting for the verdict of the step in flight learns it now,
    // unless this member voted on it: then only the group's answer decides.
    if (!voted) s.compareSet(k_verdict(gen->g, current_step.load()), {}, bytes_of("S"));
    std::vector<std::shared_ptr<PendingBucket>> give_back;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (gen->aborted) return;
      gen->aborted = true;
      if (current == gen && !step_failed) {
        step_failed = true;
        failure_cause = cause;
        failure_time = Clock::now();
      } else if (current == gen && failure_cause.empty()) {
        failure_cause = cause;
      }
      give_back.swap(pending);
    }
    detail::shutdown_sockets(gen->sockets);
    for (auto& p : give_back) p->finish(false);
  }

  // Tells a member whose vote over generation g failed what this member
  // decided on the group's answer. compareSet: if that member found no
  // answer in time and wrote "skip", this member applied a step that the
  // others dropped, and must leave the job (start_step throws FencedOut).
  // Returns once the commit is published (by this call or by another
  // thread's), so `diverged` is known before this member takes part in a
  // new generation.
  void publish_last_commit(c10d::Store& s, int64_t g) {
    LastCommit c;
    {
      std::unique_lock<std::mutex> lock(mutex);
      if (last_commit.g != g) return;
      if (last_commit.publishing) {
        const int64_t step_published = last_commit.step;
        published_cv.wait(lock, [&] { return last_commit.published || last_commit.step != step_published; });
        return;
      }
      if (last_commit.published) return;
      last_commit.publishing = true;
      c = last_commit;
    }
    bool agreed = false;
    try {
      std::this_thread::sleep_for(detail::test_seams().ft_publish_commit_delay);
      agreed = text_of(s.compareSet(k_verdict(c.g, c.step), {}, bytes_of(c.verdict))) == c.verdict;
    } catch (...) {
      // Unpublished: a member waiting for it decides "skip" after the
      // grace, so this member must take itself for a step ahead.
    }
    if (!agreed) diverged = true;
    {
      std::lock_guard<std::mutex> lock(mutex);
      // A later commit of the same generation may have replaced it meanwhile: that one is unpublished.
      if (last_commit.g == c.g && last_commit.step == c.step) last_commit.published = true;
    }
    published_cv.notify_all();
  }

  // A member a step ahead of the job leaves generation `g` as one that left
  // cleanly, so nobody waits for it to come to the next quorum.
  void leave_diverged(c10d::Store& s, int64_t g) {
    s.compareSet(k_dead(g + 1, id), {}, bytes_of("left"));
    s.set(k_abort(g), bytes_of("1"));
  }

  void throw_if_diverged() {
    if (!diverged) return;
    throw FencedOut(c10::str("ddp: replica ", id, " committed step ", last_commit.step, " of generation ",
                             last_commit.g, " on the group's answer, but a member whose vote failed found no answer "
                             "within ", vote_grace().count(), " ms and the step was skipped: this replica's state is "
                             "one step ahead of the job's. Exit and let the launcher restart it (it heals from a "
                             "live member)"));
  }

  // How long a member whose vote failed waits for one that got the group's
  // answer to publish it (publish_last_commit, on that member's watcher, at
  // most one poll after the generation's end) before deciding "skip".
  std::chrono::milliseconds vote_grace() const {
    return std::min(options.deadline(), std::max(std::chrono::milliseconds(500), 5 * options.heartbeat_interval()));
  }

  // The step's vote: one small all-reduce over the group, after every bucket
  // of this member finished. It completes only with every member's vote in,
  // and a member votes only once all its buckets finished, so completing it
  // is the proof that the step's gradients are whole everywhere: "commit".
  // No store operation on this path. Its second entry lets joiners in when
  // every member asks to (a member holding them never does). A member whose
  // vote failed (the group broke during the vote) cannot tell whether
  // another got the answer, and asks the store.
  std::string vote(const std::shared_ptr<Generation>& gen, const std::shared_ptr<PendingBucket>& p) {
    all_reduce_into(*gen, p);
    p->out->wait();
    bool answered = p->completed();
    if (answered && detail::test_seams().ft_vote_answer_lost_at_step == step) {
      detail::test_seams().ft_vote_answer_lost_at_step = -1;
      answered = false;
      note_failure(gen->g, "collective failed: the vote's answer was dropped (test seam)");
    }
    if (answered) {
      const std::string verdict = p->result[1].item<int64_t>() == gen->size() ? "CJ" : "C";
      std::lock_guard<std::mutex> lock(mutex);
      last_commit = LastCommit{gen->g, step, verdict, false, false};
      return verdict;
    }
    const std::string key = k_verdict(gen->g, step);
    keys_of_old_generations.push_back(key);
    store_ops += 2;
    try {
      store->wait({key}, vote_grace());
      return text_of(store->get(key));
    } catch (const FencedOut&) {
      throw;
    } catch (const std::exception&) {
      // Nobody published an answer: nobody got one (or its member missed
      // the grace, and leaves on finding "skip").
      return text_of(store->compareSet(key, {}, bytes_of("S")));
    }
  }

  void reap() {
    while (true) {
      std::shared_ptr<Generation> gen;
      {
        std::unique_lock<std::mutex> lock(reap_mutex);
        reap_cv.wait(lock, [&] { return stop.load() || !to_reap.empty(); });
        if (to_reap.empty()) return;
        gen = std::move(to_reap.front());
        to_reap.pop_front();
      }
      gen.reset();  // joins the group's threads, possibly after its timeout
    }
  }

  void retire(std::shared_ptr<Generation> gen) {
    {
      std::lock_guard<std::mutex> lock(reap_mutex);
      to_reap.push_back(std::move(gen));
    }
    reap_cv.notify_all();
  }

  // ---- the hook --------------------------------------------------------------

  c10::intrusive_ptr<c10::ivalue::Future> run_bucket(GradBucket& bucket) {
    auto p = std::make_shared<PendingBucket>();
    p->fallback = bucket.buffer();
    std::shared_ptr<Generation> gen;
    {
      std::lock_guard<std::mutex> lock(mutex);
      gen = current;
      if (!gen || gen->aborted || step_failed) {
        p->finish(false);
        return p->out;
      }
      pending.push_back(p);
    }
    // Averaged over the members that contribute: divided before the sum, as
    // DDP does, so a sum of averages cannot overflow. A spare sends zeros:
    // adding them changes no bit of the participants' sum.
    p->result = gen->rank < participants(*gen) ? bucket.buffer().div(participants(*gen)) : at::zeros_like(bucket.buffer());
    all_reduce_into(*gen, p);
    return p->out;
  }

  // Sums p->result over `gen`'s members; a failure marks the step failed
  // rather than throwing, and either way `p` is finished once.
  void all_reduce_into(Generation& gen, const std::shared_ptr<PendingBucket>& p) {
    collective_into(gen, p, [&](std::vector<at::Tensor>& tensors) { return gen.backend->allreduce(tensors); });
  }

  // Replaces p->result with rank 0's on `gen`'s members, as all_reduce_into sums.
  void broadcast_into(Generation& gen, const std::shared_ptr<PendingBucket>& p) {
    collective_into(gen, p, [&](std::vector<at::Tensor>& tensors) {
      c10d::BroadcastOptions o;
      o.rootRank = 0;
      return gen.backend->broadcast(tensors, o);
    });
  }

  template <typename Issue>
  void collective_into(Generation& gen, const std::shared_ptr<PendingBucket>& p, Issue issue) {
    try {
      std::vector<at::Tensor> tensors{p->result};
      auto work = issue(tensors);
      const int64_t g = gen.g;
      work->getFuture()->addCallback([this, p, g](c10::ivalue::Future& f) {
        if (f.hasError()) note_failure(g, "collective failed: " + f.tryRetrieveErrorMessage());
        p->finish(!f.hasError());
      });
    } catch (const std::exception& e) {
      note_failure(gen.g, std::string("collective failed: ") + e.what());
      p->finish(false);
    }
  }

  // A whole tensor summed over the step's members, for compositions that
  // synchronise something other than DDP's buckets (DiLoCo's pseudo-gradient).
  // The group may be abandoned with the operation in flight, so it sums a
  // copy and writes back only what completed.
  bool sum_now(at::Tensor& tensor) {
    auto p = std::make_shared<PendingBucket>();
    p->fallback = tensor;
    std::shared_ptr<Generation> gen;
    {
      std::lock_guard<std::mutex> lock(mutex);
      gen = current;
      if (!gen || gen->aborted || step_failed) return false;
      pending.push_back(p);
    }
    p->result = tensor.detach().clone();
    all_reduce_into(*gen, p);
    p->out->wait();
    const bool ok = p->completed();
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!ok || gen->aborted || step_failed) return false;
    }
    tensor.detach().copy_(p->result);
    return true;
  }

  // Rank 0's buffers on every member at the step boundary: DDP's
  // broadcast_buffers, which on the one-process local group does nothing.
  // All of them go as one shard of bytes, packed as a heal packs its share
  // (whatever their dtypes, so integer buffers such as num_batches_tracked
  // arrive exact, and a member with other buffers is refused by the
  // shard's fingerprint): one collective per step. Like sum_now, it
  // receives into a tensor of its own and writes back only what completed,
  // since the group may be abandoned with the operation in flight; a
  // failure fails the step (skipped by every member), and the deadline
  // bounds it as it bounds a bucket (it is in `pending`). What the step
  // starts from is kept, for a skip to restore.
  void broadcast_buffers() {
    step_buffers_at_start = at::Tensor();
    if (!options.broadcast_buffers() || !module) return;
    step_buffers = detail::module_buffers(*module);
    if (step_buffers.tensors.empty()) return;
    const std::vector<int> everything_from_rank0(step_buffers.tensors.size(), 0);
    step_buffers_at_start = detail::pack_shard(step_buffers, everything_from_rank0, 0);
    auto p = std::make_shared<PendingBucket>();
    p->fallback = at::empty({0}, at::kByte);
    std::shared_ptr<Generation> gen;
    {
      std::lock_guard<std::mutex> lock(mutex);
      gen = current;
      if (!gen || gen->aborted || step_failed || gen->size() == 1) return;
      pending.push_back(p);
    }
    // Rank 0 sends its own (never written to); the others receive into a copy.
    p->result = gen->rank == 0 ? step_buffers_at_start : at::empty_like(step_buffers_at_start);
    broadcast_into(*gen, p);
    p->out->wait();
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!p->completed() || gen->aborted || step_failed) return;
    }
    if (gen->rank == 0) return;
    step_buffers_at_start = p->result;
    detail::unpack_shard(step_buffers_at_start, step_buffers, everything_from_rank0, 0, gen->membership.ids[0]);
  }

  // A skipped step leaves the buffers as it found them (after its
  // broadcast), as it leaves the weights and the random generator: its
  // forward updated BatchNorm's statistics with a batch that is redone.
  void restore_buffers() {
    if (!step_buffers_at_start.defined()) return;
    detail::unpack_shard(step_buffers_at_start, step_buffers, std::vector<int>(step_buffers.tensors.size(), 0), 0,
                         id);
  }

  // How many of `gen`'s members take part in each step's average: all, or
  // the first fixed_size (the rest are spares).
  int participants(const Generation& gen) const {
    return options.fixed_size() > 0 ? std::min(gen.size(), options.fixed_size()) : gen.size();
  }

  // Skipped by every member: the generation is over; whoever has not yet
  // dropped it does so now, so nobody waits on it. Its verdict keys (this
  // step's, and the last commit's that a member may have published) go with it.
  void drop_step(const std::shared_ptr<Generation>& gen, const std::string& cause) {
    keys_of_old_generations.push_back(k_verdict(gen->g, step));
    if (step > 0) keys_of_old_generations.push_back(k_verdict(gen->g, step - 1));
    abort_generation(*store, gen, cause, {});
    stats.skipped_steps += 1;
    stats.seconds_lost += ms_since(step_started) / 1000.0;
    cpu_generator().set_state(rng_before_step);
    restore_buffers();
    reconfigure = Reconfigure::kFailure;
  }

  // ---- generations -----------------------------------------------------------

  // The joiners registered after `after`, in order, up to the first gap.
  std::vector<std::pair<int64_t, std::string>> joiners_after(int64_t after) {
    std::vector<std::pair<int64_t, std::string>> found;
    if (!store->check({k_join_seq()})) return found;
    const int64_t last = store->add(k_join_seq(), 0);
    for (int64_t k = after + 1; k <= last; ++k) {
      if (!store->check({k_join(k)})) break;
      found.emplace_back(k, text_of(store->get(k_join(k))));
    }
    return found;
  }

  // Decides generation `next`'s membership with the other members, or reads
  // it when another member decided first. `previous` is the last
  // generation's membership (empty for the first quorum).
  Membership decide(int64_t next, const Membership& previous, bool first_quorum) {
    const auto started = Clock::now();
    store->set(k_arrived(next, id), bytes_of("1"));
    for (const auto& who : previous.ids) {
      std::lock_guard<std::mutex> lock(mutex);
      watched.insert(who);
    }
    while (true) {
      if (store->check({k_members(next)})) return detail::decode_membership(text_of(store->get(k_members(next))));
      if (store->check({k_gen()}) && std::stoll(text_of(store->get(k_gen()))) >= next &&
          !store->check({k_members(next)})) {
        // Decided and already cleaned up: this member is long gone.
        throw FencedOut(c10::str("ddp: replica ", id, " was fenced out: the other members formed generation ", next,
                                 " and moved on without it (it missed the ", options.deadline().count(),
                                 " ms deadline: hung or cut off). Exit and let the launcher restart it, or make a "
                                 "new FaultTolerance to rejoin"));
      }
      const bool late = Clock::now() - started > options.deadline();
      bool decided = true;
      std::vector<std::string> members;
      for (const auto& who : previous.ids) {
        if (who == id || store->check({k_arrived(next, who)})) {
          members.push_back(who);
        } else if (has_exited(who)) {
          // Its process is gone (its liveness connection closed), even if
          // its group's sockets were already shut when they hung up.
          store->compareSet(k_dead(next, who), {}, bytes_of("crash"));
        } else if (!(store->check({k_dead(next, who)}) || heartbeat_stale(who) || late)) {
          decided = false;
        }
      }
      Membership m;
      m.carried = static_cast<int>(members.size());
      m.joined_upto = previous.joined_upto;
      if (!hold || first_quorum) {
        for (const auto& [k, who] : joiners_after(previous.joined_upto)) {
          m.joined_upto = k;
          if (!heartbeat_stale(who)) members.push_back(who);
        }
      }
      // The first quorum waits for initial_replicas up to the join timeout,
      // then goes on with min_replicas; later ones need min_replicas.
      const bool timed_out = Clock::now() - started > options.join_timeout();
      const int wanted = first_quorum && !timed_out ? options.initial_replicas() : options.min_replicas();
      if (static_cast<int>(members.size()) < wanted) {
        DDP_CHECK(!timed_out, "ddp: only ", members.size(), " replica(s) came to the quorum within ",
                  options.join_timeout().count(), " ms (", ids_text(members), "); ", wanted,
                  " are needed (min_replicas). Start more workers or lower it");
        decided = false;
      }
      if (decided && first_quorum && m.carried == 0 && std::find(members.begin(), members.end(), id) == members.end()) {
        decided = false;  // this joiner's own registration is not visible yet
      }
      if (decided) {
        m.ids = members;
        auto winner = store->compareSet(k_members(next), {}, bytes_of(detail::encode_membership(m)));
        return detail::decode_membership(text_of(winner));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  // Makes generation g's Gloo group (always Gloo, made here explicitly: its
  // sockets are what an abort shuts down) on a fresh store prefix. The one
  // place a group is made, so that torch's reconfigure API can replace it.
  std::shared_ptr<Generation> make_generation(int64_t g, const Membership& m) {
    auto gen = std::make_shared<Generation>();
    gen->g = g;
    gen->membership = m;
    gen->rank = m.rank_of(id);
    World world;
    world.rank = gen->rank;
    world.world_size = gen->size();
    world.local_world_size = std::max(1, std::atoi(env_or("LOCAL_WORLD_SIZE", "1").c_str()));
    world.master_addr = env_or("MASTER_ADDR", "127.0.0.1");
    world.master_port = std::atoi(env_or("MASTER_PORT", "0").c_str());
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("ft/pg/" + std::to_string(g), store);
    {
      std::lock_guard<std::mutex> lock(detail::socket_tracking_mutex());
      auto before = detail::open_sockets();
      // Gloo's own timeout only bounds what the deadline cannot abort (a
      // send to a peer that died before receiving): see overdue().
      gen->backend = detail::make_gloo_backend(prefixed, world, options.deadline() * 2 + std::chrono::seconds(5));
      gen->sockets = detail::without_peers(detail::connected_sockets_since(before), store_addresses);
    }
    std::string addresses;
    for (const auto& s : gen->sockets) addresses += s.local + " ";
    store->set(k_socks(g, id), bytes_of(addresses));
    for (const auto& who : m.ids) {
      for (const auto& key : {k_arrived(g, who), k_dead(g, who), k_socks(g, who)}) keys_of_old_generations.push_back(key);
      // Gloo's own keys: "<device>/<rank>" under the group's prefix.
      keys_of_old_generations.push_back("ft/pg/" + std::to_string(g) + "/0/" + std::to_string(m.rank_of(who)));
    }
    keys_of_old_generations.push_back(k_members(g));
    keys_of_old_generations.push_back(k_abort(g));
    return gen;
  }

  // ---- state for joiners -----------------------------------------------------

  // What one member sends besides the tensors: the step, the random
  // generator, the sampler's position, the extra state, and the optimizer's
  // archive with placeholders where its tensors go (`held` names them).
  std::string save_meta(torch::serialize::OutputArchive& optimizer_skeleton, const detail::HealTensors& held) {
    torch::serialize::OutputArchive archive;
    archive.write("ft/step", at::scalar_tensor(step, at::kLong));
    archive.write("ft/rng", cpu_generator().get_state());
    if (sampler) {
      archive.write("ft/sampler/epoch", at::scalar_tensor(sampler->epoch(), at::kLong));
      archive.write("ft/sampler/cursor", at::scalar_tensor(sampler->cursor(), at::kLong));
      archive.write("ft/sampler/shape",
                    at::tensor({sampler->dataset_size(), sampler->batch_size(), static_cast<int64_t>(sampler->seed())},
                               at::kLong));
    }
    if (optimizer) {
      c10::List<std::string> names, paths;
      for (size_t i = 0; i < held.names.size(); ++i) {
        if (held.raw_paths[i].empty()) continue;
        names.push_back(held.names[i]);
        paths.push_back(held.raw_paths[i]);
      }
      archive.write("heal/names", c10::IValue(names));
      archive.write("heal/paths", c10::IValue(paths));
      archive.write("optimizer", optimizer_skeleton);
    }
    for (size_t i = 0; i < extra_state.size(); ++i) {
      torch::serialize::OutputArchive sub;
      extra_state[i].first(sub);
      archive.write("extra/" + std::to_string(i), sub);
    }
    std::ostringstream out;
    archive.save_to(out);
    return out.str();
  }

  static std::vector<std::string> strings_of(const c10::IValue& list) {
    std::vector<std::string> v;
    for (const auto& e : list.toListRef()) v.push_back(e.toStringRef());
    return v;
  }

  // The members that held the state before this generation (its first
  // `carried`; the first quorum's rank 0) send it to every joiner over the
  // new group. Each tensor comes from one of `senders` of them, by a plan
  // that balances the bytes (heal_state.h), all at once; rank 0 also sends
  // the rest of the state. Every holder has the same bits, so the joiner's
  // state is bit for bit what a single sender would have given it.
  void heal(Generation& gen) {
    heal_bytes_sent_now = 0;
    const int holders = std::max(1, gen.membership.carried);
    if (holders >= gen.size()) return;
    const int senders =
        options.heal_senders() > 0 ? std::min(holders, options.heal_senders()) : holders;
    auto wait = [&](const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
      DDP_PEER_CHECK(work->wait(options.deadline()), "ddp: healing a joiner failed: ", what);
    };
    if (gen.rank < senders) {
      torch::serialize::OutputArchive skeleton;
      const detail::HealTensors held =
          detail::list_heal_tensors(module.get(), optimizer, gen.rank == 0 ? &skeleton : nullptr);
      const std::vector<int> plan = detail::assign_to_senders(held.bytes(), senders);
      at::Tensor shard = detail::pack_shard(held, plan, gen.rank);
      at::Tensor size, meta;
      if (gen.rank == 0) {
        const std::string blob = save_meta(skeleton, held);
        size = at::scalar_tensor(static_cast<int64_t>(blob.size()), at::kLong).reshape({1});
        meta = at::empty({static_cast<int64_t>(blob.size())}, at::kByte);
        std::memcpy(meta.data_ptr(), blob.data(), blob.size());
      }
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      std::vector<std::vector<at::Tensor>> buffers;  // alive until the sends finish
      buffers.reserve(3 * static_cast<size_t>(gen.size()));
      for (int r = holders; r < gen.size(); ++r) {
        if (gen.rank == 0) {
          buffers.push_back({size});
          works.push_back(gen.backend->send(buffers.back(), r, 1));
          buffers.push_back({meta});
          works.push_back(gen.backend->send(buffers.back(), r, 2));
          heal_bytes_sent_now += meta.numel();
        }
        buffers.push_back({shard});
        works.push_back(gen.backend->send(buffers.back(), r, 3));
        heal_bytes_sent_now += shard.numel();
      }
      for (const auto& w : works) wait(w, "sending the state to a joiner");
      stats.heal_bytes_sent += heal_bytes_sent_now;
    } else if (gen.rank >= holders) {
      const auto started = Clock::now();
      at::Tensor size = at::zeros({1}, at::kLong);
      std::vector<at::Tensor> a{size};
      wait(gen.backend->recv(a, 0, 1), "receiving the state's size from rank 0");
      at::Tensor meta = at::empty({size.item<int64_t>()}, at::kByte);
      std::vector<at::Tensor> b{meta};
      wait(gen.backend->recv(b, 0, 2), "receiving the state from rank 0");
      torch::serialize::InputArchive archive;
      archive.load_from(static_cast<const char*>(meta.data_ptr()), static_cast<size_t>(meta.numel()));

      torch::serialize::InputArchive optimizer_skeleton;
      std::vector<std::string> names, paths;
      if (optimizer) {
        archive.read("optimizer", optimizer_skeleton);
        c10::IValue v;
        archive.read("heal/names", v);
        names = strings_of(v);
        archive.read("heal/paths", v);
        paths = strings_of(v);
      }
      detail::HealTensors into =
          detail::joiner_heal_tensors(module.get(), optimizer ? &optimizer_skeleton : nullptr, names, paths);
      const std::vector<int> plan = detail::assign_to_senders(into.bytes(), senders);
      std::vector<std::vector<at::Tensor>> shards;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      shards.reserve(static_cast<size_t>(senders));
      for (int s = 0; s < senders; ++s) {
        shards.push_back({at::empty({detail::shard_bytes(into, plan, s)}, at::kByte)});
        works.push_back(gen.backend->recv(shards.back(), s, 3));
      }
      healed_from.clear();
      for (int s = 0; s < senders; ++s) {
        wait(works[static_cast<size_t>(s)], "receiving the state's tensors from a live member");
        detail::unpack_shard(shards[static_cast<size_t>(s)][0], into, plan, s, gen.membership.ids[static_cast<size_t>(s)]);
        healed_from.emplace_back(gen.membership.ids[static_cast<size_t>(s)],
                                 shards[static_cast<size_t>(s)][0].numel() + (s == 0 ? meta.numel() : 0));
        stats.heal_bytes_received += healed_from.back().second;
      }
      load_meta(archive);
      // The skeleton now holds the received tensors.
      if (optimizer) optimizer->load(optimizer_skeleton);
      heal_transfer_ms = ms_since(started);
    }
  }

  void load_meta(torch::serialize::InputArchive& archive) {
    // Each read into a fresh tensor: reading into a defined one resizes it in place.
    at::Tensor saved_step, rng;
    archive.read("ft/step", saved_step);
    step = saved_step.item<int64_t>();
    current_step = step;
    archive.read("ft/rng", rng);
    cpu_generator().set_state(rng);
    if (sampler) {
      at::Tensor epoch, cursor;
      archive.read("ft/sampler/epoch", epoch);
      archive.read("ft/sampler/cursor", cursor);
      // A sampler of another seed walks another permutation: the members'
      // slices of a window would overlap and miss samples, silently.
      at::Tensor shape;
      archive.read("ft/sampler/shape", shape);
      const std::vector<int64_t> theirs(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + 3);
      const std::vector<int64_t> mine{sampler->dataset_size(), sampler->batch_size(),
                                      static_cast<int64_t>(sampler->seed())};
      DDP_CHECK(theirs == mine, "ddp: this joiner's FaultTolerantSampler (dataset size ", mine[0], ", batch size ",
                mine[1], ", seed ", mine[2], ") differs from the job's (", theirs[0], ", ", theirs[1], ", ", theirs[2],
                "); every replica must make its sampler with the job's dataset, batch size and seed");
      sampler->set_position(epoch.item<int64_t>(), cursor.item<int64_t>());
    }
    for (size_t i = 0; i < extra_state.size(); ++i) {
      torch::serialize::InputArchive sub;
      archive.read("extra/" + std::to_string(i), sub);
      extra_state[i].second(sub);
    }
  }

  // Forms generations from `next` on until one is made and healed: a member
  // that dies while a group is being made fails that generation too.
  // False only for the first quorum, when it was formed without this
  // process (which then waits to be let in as a joiner).
  bool form(int64_t next, Membership previous, bool first_quorum, const std::string& why) {
    const auto started = failure_time_or_now();
    const std::vector<std::string> before = previous.ids;
    while (true) {
      Membership m = decide(next, previous, first_quorum);
      if (m.rank_of(id) < 0 && first_quorum) return false;
      if (m.rank_of(id) < 0) {
        throw FencedOut(c10::str("ddp: replica ", id, " was fenced out: generation ", next, " was formed without it (",
                                 ids_text(m.ids), ") because it missed the ", options.deadline().count(),
                                 " ms deadline (hung or cut off). Exit and let the launcher restart it, or make "
                                 "a new FaultTolerance to rejoin"));
      }
      store->compareSet(k_gen(), next == 1 ? std::vector<uint8_t>{} : bytes_of(std::to_string(next - 1)),
                        bytes_of(std::to_string(next)));
      // What this round wrote about the previous members and the joiners it
      // consumed goes two generations later (delete_old_keys).
      for (const auto& who : previous.ids) {
        keys_of_old_generations.push_back(k_arrived(next, who));
        keys_of_old_generations.push_back(k_dead(next, who));
        if (m.rank_of(who) < 0) {
          keys_of_old_generations.push_back(k_heartbeat(who) + "/" + std::to_string(next));
          keys_of_old_generations.push_back(k_live(who) + "/" + std::to_string(next));
        }
      }
      for (int64_t k = previous.joined_upto + 1; k <= m.joined_upto; ++k) {
        keys_of_old_generations.push_back(k_join(k) + "/" + std::to_string(next));
      }
      std::shared_ptr<Generation> gen;
      try {
        gen = make_generation(next, m);
        {
          std::lock_guard<std::mutex> lock(mutex);
          current = gen;
          step_failed = false;
          failure_cause.clear();
          pending.clear();
          for (const auto& who : m.ids) watched.insert(who);
        }
        current_gen = next;
        joined_upto = m.joined_upto;
        heal(*gen);
      } catch (const FencedOut&) {
        throw;
      } catch (const std::exception& e) {
        // Someone died while the group was made or the state sent: this
        // generation fails as a step would.
        if (debug) std::fprintf(stderr, "ddp: ft debug: generation %lld failed: %s\n", static_cast<long long>(next), e.what());
        store->set(k_arrived(next + 1, id), bytes_of("1"));
        store->set(k_abort(next), bytes_of("1"));
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (gen) gen->aborted = true;
          current = nullptr;
        }
        if (gen) {
          detail::shutdown_sockets(gen->sockets);
          retire(gen);
        }
        previous = m;
        first_quorum = false;
        ++next;
        continue;
      }
      const double recovered_ms = ms_since(started);
      if (!before.empty() || !first_quorum) {
        stats.membership_changes += 1;
        stats.last_recovery_ms = recovered_ms;
        stats.seconds_lost += recovered_ms / 1000.0;
        log_change(before, m, why, recovered_ms);
      }
      if (gen->rank == 0) delete_old_keys(next);
      return true;
    }
  }

  Clock::time_point failure_time_or_now() {
    std::lock_guard<std::mutex> lock(mutex);
    return step_failed ? failure_time : Clock::now();
  }

  // What member `rank` of `before` held in the step in flight: the cursor
  // has not moved past it, so the survivors' next windows redo it. Named so
  // that a run's log accounts for every sample.
  std::string in_flight_samples(const std::vector<std::string>& before, int rank) {
    if (!sampler) return "";
    const int n = static_cast<int>(before.size());
    const std::vector<int64_t> mine = fault_tolerant_slice(sampler->window(n), rank, n);
    std::string list;
    const size_t shown = std::min<size_t>(mine.size(), 64);
    for (size_t i = 0; i < shown; ++i) list += (i ? "," : "") + std::to_string(mine[i]);
    if (shown < mine.size()) list += ",... (" + std::to_string(mine.size()) + " in all)";
    return "; in flight at step " + std::to_string(step) + " (epoch " + std::to_string(sampler->epoch()) + "), " +
           before[static_cast<size_t>(rank)] + "'s samples " + list + " are redone by the survivors";
  }

  void log_change(const std::vector<std::string>& before, const Membership& m, const std::string& why,
                  double recovered_ms) {
    if (!options.log_membership()) return;
    const int64_t g = current_gen.load();
    std::string what;
    for (const auto& who : before) {
      if (m.rank_of(who) >= 0) continue;
      std::string cause;
      if (store->check({k_dead(g, who)})) {
        cause = text_of(store->get(k_dead(g, who))) == "left" ? "left cleanly" : "crash: connection closed";
      } else if (heartbeat_stale(who)) {
        cause = "deadline: no heartbeat for " + std::to_string(options.heartbeat_timeout().count()) + " ms (hung)";
      } else {
        cause = "partition: alive but missed the " + std::to_string(options.deadline().count()) + " ms deadline";
      }
      what += (what.empty() ? "" : "; ") + ("replica " + who + " left (" + cause + ")");
    }
    for (const auto& who : m.ids) {
      if (std::find(before.begin(), before.end(), who) == before.end() && who != id) {
        what += (what.empty() ? "" : "; ") + ("replica " + who + " joined");
      }
    }
    if (what.empty()) what = why;
    std::string tail;
    for (size_t r = 0; r < before.size(); ++r) {
      if (m.rank_of(before[r]) < 0) tail += in_flight_samples(before, static_cast<int>(r));
    }
    if (heal_bytes_sent_now > 0) tail += "; sent " + std::to_string(heal_bytes_sent_now) + " bytes of state";
    std::string spares;
    if (options.fixed_size() > 0) {
      const size_t taking_part = std::min(m.ids.size(), static_cast<size_t>(options.fixed_size()));
      spares = " (" + std::to_string(taking_part) + " taking part, " + std::to_string(m.ids.size() - taking_part) +
               " spare)";
    }
    std::fprintf(stderr, "ddp: membership: %s at step %lld; recovered in %.0f ms; %zu -> %zu replicas%s%s\n",
                 what.c_str(), static_cast<long long>(step), recovered_ms, before.size(), m.ids.size(),
                 spares.c_str(), tail.c_str());
    std::fflush(stderr);
  }

  // Keys of generations before the previous one: every member that could
  // still read them has moved on.
  void delete_old_keys(int64_t g) {
    std::vector<std::string> keep;
    const std::string newer1 = "/" + std::to_string(g) + "/", newer2 = "/" + std::to_string(g - 1) + "/";
    for (const auto& key : keys_of_old_generations) {
      // Keys without a generation of their own (heartbeats, joiners) carry
      // it after a last "/<g>" here, which the deletion drops.
      const bool tagged =
          key.rfind("ft/hb/", 0) == 0 || key.rfind("ft/join/", 0) == 0 || key.rfind("ft/live/", 0) == 0;
      const std::string probe = tagged ? key.substr(key.rfind('/')) + "/" : key;
      const bool recent = probe.find(newer1) != std::string::npos || probe.find(newer2) != std::string::npos ||
                          key == k_abort(g) || key == k_abort(g - 1);
      if (recent) {
        keep.push_back(key);
      } else {
        store->deleteKey(tagged ? key.substr(0, key.rfind('/')) : key);
      }
    }
    keys_of_old_generations.swap(keep);
  }

  void join() {
    std::signal(SIGPIPE, SIG_IGN);  // Gloo writes with writev and does not suppress it
    const int64_t k = store->add(k_join_seq(), 1);
    store->set(k_join(k), bytes_of(id));
    const auto started = Clock::now();
    while (true) {
      if (!store->check({k_gen()})) {
        Membership none;
        if (form(1, none, /*first_quorum=*/true, "first quorum")) break;
        continue;
      }
      const int64_t g = std::stoll(text_of(store->get(k_gen())));
      if (store->check({k_members(g)})) {
        Membership m = detail::decode_membership(text_of(store->get(k_members(g))));
        if (m.rank_of(id) >= 0) {
          // Let in: the members of g make its group now, and send the state.
          try {
            adopt(g, m);
          } catch (const std::exception& e) {
            // Without the state this replica cannot be a member; the others
            // drop generation g and go on without it.
            store->compareSet(k_dead(g + 1, id), {}, bytes_of("left"));
            store->set(k_abort(g), bytes_of("1"));
            DDP_PEER_CHECK(false, "ddp: replica ", id, " was let into generation ", g,
                           " but could not join its group or receive the state (", e.what(),
                           "); a member died meanwhile. Restart this worker to try again");
          }
          break;
        }
      }
      DDP_CHECK(Clock::now() - started < options.join_timeout(), "ddp: replica ", id, " was not let into the job within ",
                options.join_timeout().count(), " ms; are the members training (they let joiners in at a step "
                "boundary)?");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    joined = true;
  }

  // A joiner whose admission into generation g was decided by the members.
  void adopt(int64_t g, const Membership& m) {
    const auto started = Clock::now();
    std::shared_ptr<Generation> gen = make_generation(g, m);
    {
      std::lock_guard<std::mutex> lock(mutex);
      current = gen;
      step_failed = false;
      for (const auto& who : m.ids) watched.insert(who);
    }
    current_gen = g;
    joined_upto = m.joined_upto;
    heal(*gen);
    if (options.log_membership()) {
      std::string from;
      for (const auto& [who, bytes] : healed_from) {
        from += (from.empty() ? "" : ", ") + who + " (" + std::to_string(bytes) + " bytes)";
      }
      std::fprintf(stderr, "ddp: membership: replica %s joined at step %lld, healed from %s in %.0f ms "
                   "(state received in %.1f ms); %d replicas\n",
                   id.c_str(), static_cast<long long>(step), from.c_str(), ms_since(started), heal_transfer_ms,
                   gen->size());
      std::fflush(stderr);
    }
  }

  void reconfigure_now(const std::string& why) {
    std::shared_ptr<Generation> old;
    {
      std::lock_guard<std::mutex> lock(mutex);
      old = current;
    }
    DDP_CHECK(old, "ddp: fault tolerance has no generation to leave");
    publish_last_commit(*store, old->g);
    if (diverged) {
      leave_diverged(*store, old->g);
      return;  // start_step throws
    }
    keys_of_old_generations.push_back(k_verdict(old->g, step - 1));
    // Come to the next quorum before closing anything (see abort_generation).
    store->set(k_arrived(old->g + 1, id), bytes_of("1"));
    std::vector<std::shared_ptr<PendingBucket>> give_back;
    {
      std::lock_guard<std::mutex> lock(mutex);
      old->aborted = true;
      give_back.swap(pending);
    }
    detail::shutdown_sockets(old->sockets);
    for (auto& p : give_back) p->finish(false);
    retire(old);
    form(old->g + 1, old->membership, false, why);
    reconfigure = Reconfigure::kNone;
  }
};

FaultTolerance::FaultTolerance(FaultToleranceOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {
  auto& o = impl_->options;
  DDP_CHECK(!o.store().empty(), "ddp: fault tolerance needs a store: set DDP_FT_STORE (ddprun --fault-tolerance does) ",
            "or FaultToleranceOptions::store");
  DDP_CHECK(!o.replica_id().empty() && o.replica_id().find_first_of(",| ") == std::string::npos,
            "ddp: fault tolerance needs a replica id without ',', '|' or spaces (DDP_FT_REPLICA_ID or "
            "FaultToleranceOptions::replica_id), got '", o.replica_id(), "'");
  DDP_CHECK(o.deadline().count() > 0 && o.heartbeat_interval().count() > 0 &&
                o.heartbeat_timeout() > o.heartbeat_interval(),
            "ddp: fault tolerance needs a positive deadline and a heartbeat timeout longer than its interval");
  DDP_CHECK(o.initial_replicas() >= 1 && o.min_replicas() >= 1, "ddp: initial_replicas and min_replicas must be >= 1");
  DDP_CHECK(o.fixed_size() >= 0, "ddp: FaultToleranceOptions::fixed_size must be >= 0 (0: every member takes part), got ",
            o.fixed_size());
  // Fewer members than the fixed size would shrink the global batch: the group waits for a joiner.
  if (o.fixed_size() > 0 && o.min_replicas() < o.fixed_size()) o.min_replicas(o.fixed_size());
  DDP_CHECK(o.heal_senders() >= 0, "ddp: heal_senders must be >= 0 (0: every member that holds the state), got ",
            o.heal_senders());
  std::signal(SIGPIPE, SIG_IGN);  // Gloo's writev does not suppress it: a dead peer must not kill a survivor
  impl_->id = o.replica_id();
  impl_->store = detail::open_ft_store(o.store(), o.deadline());
  impl_->wstore = detail::open_ft_store(o.store(), o.deadline());
  if (!o.scope().empty()) {
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(o.scope(), impl_->store);
    impl_->wstore = c10::make_intrusive<c10d::PrefixStore>(o.scope(), impl_->wstore);
  }
  if (const auto& wrap = detail::test_seams().ft_wrap_store) {
    impl_->store = wrap(impl_->store);
    impl_->wstore = wrap(impl_->wstore);
  }
  impl_->store_addresses = detail::ft_store_addresses(o.store());
  {
    std::string address;
    std::lock_guard<std::mutex> tracking(detail::socket_tracking_mutex());
    impl_->live_listener =
        detail::listen_for_liveness(detail::local_address_towards(store_host(o.store())), address);
    if (impl_->live_listener >= 0) impl_->store->set(k_live(impl_->id), bytes_of(address));
  }
  impl_->start_threads();
}

FaultTolerance::~FaultTolerance() {
  impl_->stop_threads();
  std::shared_ptr<Generation> gen;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    gen = std::move(impl_->current);
  }
  gen.reset();
  while (!impl_->to_reap.empty()) impl_->to_reap.pop_front();
  impl_->close_liveness();
  // A DDP model may keep a hook, and with it this Impl, alive: what the hook would need goes
  // now, and the hook says so if it runs.
  impl_->destroyed = true;
  impl_->module.reset();
  impl_->optimizer = nullptr;
  impl_->sampler = nullptr;
  impl_->extra_state.clear();
  impl_->store.reset();
  impl_->wstore.reset();
  impl_->local.reset();
}

std::shared_ptr<ProcessGroup> FaultTolerance::local_group() {
  if (!impl_->local) {
    World world;  // this process alone
    world.master_addr = "127.0.0.1";
    std::lock_guard<std::mutex> lock(detail::socket_tracking_mutex());
    impl_->local = ProcessGroup::create(world, ProcessGroupOptions()
                                                   .backend(BackendKind::kGloo)
                                                   .init_method("env://")
                                                   .install_stack_dump_handler(false)
                                                   .install_terminate_handler(false));
  }
  return impl_->local;
}

namespace {
class FaultTolerantHook : public CommHook {
 public:
  explicit FaultTolerantHook(std::function<c10::intrusive_ptr<c10::ivalue::Future>(GradBucket&)> run)
      : run_(std::move(run)) {}
  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& /*local*/, GradBucket& bucket) override {
    DDP_CHECK(!bucket.scatters(), "ddp: the fault-tolerant hook all-reduces DDP buckets; FSDP is not supported");
    return run_(bucket);
  }

 private:
  std::function<c10::intrusive_ptr<c10::ivalue::Future>(GradBucket&)> run_;
};
}  // namespace

std::shared_ptr<CommHook> FaultTolerance::comm_hook() {
  std::shared_ptr<Impl> impl = impl_;
  return std::make_shared<FaultTolerantHook>([impl](GradBucket& b) {
    DDP_CHECK(!impl->destroyed, "ddp: the fault-tolerant hook ran after its FaultTolerance (replica '", impl->id,
              "') was destroyed; keep the FaultTolerance alive as long as the DDP model built with its "
              "comm_hook() or ddp_options()");
    return impl->run_bucket(b);
  });
}

DDPOptions FaultTolerance::ddp_options(DDPOptions base) {
  // Buckets are never rebuilt here, so never fitted to the link either: without a cap they
  // would stay at 25 MiB, and a model of a few buckets' size would all-reduce after backward
  // with nothing to overlap (docs/fault_tolerance.md, "Buckets"). A small fixed cap, alike on
  // every member and joiner, overlaps as the fitted one does.
  if (!base.bucket_cap_mb()) base.bucket_cap_mb(kFaultTolerantBucketMb);
  return base.comm_hook(comm_hook()).rebuild_buckets(false);
}

void FaultTolerance::manage(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer* optimizer,
                            FaultTolerantSampler* sampler) {
  impl_->module = std::move(module);
  impl_->optimizer = optimizer;
  impl_->sampler = sampler;
}

void FaultTolerance::manage_state(std::function<void(torch::serialize::OutputArchive&)> save,
                                  std::function<void(torch::serialize::InputArchive&)> load) {
  impl_->extra_state.emplace_back(std::move(save), std::move(load));
}

void FaultTolerance::start_step() {
  auto& d = *impl_;
  DDP_CHECK(!d.left, "ddp: this replica left the job; make a new FaultTolerance to rejoin");
  d.throw_if_diverged();
  if (!d.joined) {
    d.join();
  }
  while (true) {
    bool aborted;
    {
      std::lock_guard<std::mutex> lock(d.mutex);
      aborted = !d.current || d.current->aborted;
    }
    if (d.reconfigure == Reconfigure::kNone && !aborted) break;
    d.reconfigure_now(d.reconfigure == Reconfigure::kJoin ? "joiners let in" : "the last step failed");
    d.throw_if_diverged();
  }
  {
    // The last step's buckets are all done: backward waited for them.
    std::lock_guard<std::mutex> lock(d.mutex);
    d.pending.clear();
  }
  d.committed_unconfirmed = false;
  d.rng_before_step = cpu_generator().get_state();
  d.step_started = Clock::now();
  d.current_step = d.step;
  // After any heal, under this step's deadline and counted in its time.
  d.broadcast_buffers();
}

bool FaultTolerance::all_reduce_sum(at::Tensor& tensor) {
  auto& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    DDP_CHECK(d.current, "ddp: FaultTolerance::all_reduce_sum() before start_step(); call it between start_step() and "
                         "should_commit()");
  }
  return d.sum_now(tensor);
}

bool FaultTolerance::should_commit() {
  auto& d = *impl_;
  std::shared_ptr<Generation> gen;
  bool ok;
  std::string cause;
  auto ballot = std::make_shared<PendingBucket>();
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    gen = d.current;
    ok = gen && !gen->aborted && !d.step_failed;
    cause = d.failure_cause;
    if (ok) {
      // Voting and the watcher's abort exclude each other here: see vote_gen.
      const bool let_in = !d.hold && d.join_seq_seen.load() > d.joined_upto.load();
      ballot->result = at::tensor({int64_t{1}, int64_t{let_in ? 1 : 0}}, at::kLong);
      ballot->fallback = at::zeros({2}, at::kLong);
      d.vote_gen = gen->g;
      d.vote_step = d.step;
      d.pending.push_back(ballot);  // under the deadline, and given back by an abort
    }
  }
  DDP_CHECK(gen, "ddp: should_commit() before start_step()");
  std::string verdict;
  int64_t ops = 0;
  try {
    if (ok) {
      verdict = d.vote(gen, ballot);
    } else {
      // This member's vote was never sent, so nobody can have committed the step.
      verdict = text_of(d.store->compareSet(k_verdict(gen->g, d.step), {}, bytes_of("S")));
      ++ops;
    }
  } catch (const FencedOut&) {
    throw;
  } catch (const std::exception& e) {
    DDP_PEER_CHECK(false, "ddp: the fault-tolerance store stopped answering during the vote of step ", d.step, ": ",
                   e.what());
  }
  if (verdict == "C" || verdict == "CJ") {
    d.committed_unconfirmed = true;
    if (d.sampler) {
      d.sampler_before_step = {d.sampler->epoch(), d.sampler->cursor()};
      d.sampler->advance(d.participants(*gen));
    }
    d.stats.committed_steps += 1;
    // ddprun tells a worker that fails at start-up (a usage error, restarted in vain) from one that
    // trained and then failed by this file's existence (docs/fault_tolerance.md "Start-up failures").
    if (const char* progress = std::getenv("DDP_FT_PROGRESS_FILE");
        d.stats.committed_steps == 1 && progress != nullptr && *progress != '\0') {
      const int fd = ::open(progress, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
      if (fd >= 0) ::close(fd);
    }
    d.store_ops += ops;
    d.store_ops_counted_steps += 1;
    d.step += 1;
    d.current_step = d.step;
    if (verdict == "CJ") d.reconfigure = Reconfigure::kJoin;
    return true;
  }
  d.drop_step(gen, cause.empty() ? "step skipped" : cause);
  return false;
}

void FaultTolerance::skip_committed_step(const std::string& cause) {
  auto& d = *impl_;
  DDP_CHECK(d.committed_unconfirmed, "ddp: skip_committed_step() needs a step that should_commit() just committed");
  d.committed_unconfirmed = false;
  std::shared_ptr<Generation> gen;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    gen = d.current;
  }
  if (d.sampler) d.sampler->set_position(d.sampler_before_step.first, d.sampler_before_step.second);
  d.stats.committed_steps -= 1;
  d.store_ops_counted_steps -= 1;
  d.step -= 1;
  d.current_step = d.step;
  d.drop_step(gen, cause);
}

void FaultTolerance::leave() {
  auto& d = *impl_;
  std::shared_ptr<Generation> gen;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    gen = d.current;
  }
  if (gen) {
    d.publish_last_commit(*d.store, gen->g);
    d.store->set(k_dead(gen->g + 1, d.id), bytes_of("left"));
    d.store->set(k_abort(gen->g), bytes_of("1"));
    d.store->compareSet(k_verdict(gen->g, d.step), {}, bytes_of("S"));
    {
      std::lock_guard<std::mutex> lock(d.mutex);
      gen->aborted = true;
      d.current = nullptr;
    }
    detail::shutdown_sockets(gen->sockets);
    d.retire(gen);
  }
  d.left = true;
}

int FaultTolerance::rank() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->current ? impl_->current->rank : -1;
}

int FaultTolerance::size() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->current ? impl_->current->size() : 0;
}

int FaultTolerance::participants() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->current ? impl_->participants(*impl_->current) : 0;
}

bool FaultTolerance::participating() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->current && impl_->current->rank < impl_->participants(*impl_->current);
}

int64_t FaultTolerance::step() const { return impl_->step; }
int64_t FaultTolerance::generation() const { return impl_->current_gen.load(); }
const std::string& FaultTolerance::replica_id() const { return impl_->id; }

std::vector<std::string> FaultTolerance::members() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->current ? impl_->current->membership.ids : std::vector<std::string>{};
}

bool FaultTolerance::join_pending() const { return impl_->join_seq_seen.load() > impl_->joined_upto.load(); }
void FaultTolerance::hold_joiners(bool hold) { impl_->hold = hold; }

FaultToleranceStats FaultTolerance::stats() const {
  FaultToleranceStats s = impl_->stats;
  if (impl_->store_ops_counted_steps > 0) {
    s.store_ops_per_step = static_cast<double>(impl_->store_ops) / static_cast<double>(impl_->store_ops_counted_steps);
  }
  return s;
}

std::string FaultTolerance::stats_json() const {
  const auto s = stats();
  const double total = s.committed_steps + s.skipped_steps;
  char text[512];
  std::snprintf(text, sizeof(text),
                "{\"ft_committed_steps\": %lld, \"ft_skipped_steps\": %lld, \"ft_seconds_lost\": %.3f, "
                "\"ft_membership_changes\": %lld, \"ft_last_recovery_ms\": %.1f, \"ft_committed_fraction\": %.4f, "
                "\"ft_heal_bytes_sent\": %lld, \"ft_heal_bytes_received\": %lld, \"ft_store_ops_per_step\": %.2f}",
                static_cast<long long>(s.committed_steps), static_cast<long long>(s.skipped_steps), s.seconds_lost,
                static_cast<long long>(s.membership_changes), s.last_recovery_ms,
                total > 0 ? s.committed_steps / total : 1.0, static_cast<long long>(s.heal_bytes_sent),
                static_cast<long long>(s.heal_bytes_received), s.store_ops_per_step);
  return text;
}

}  // namespace ddp
