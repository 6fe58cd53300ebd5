// ddprun's agent rendezvous (--rdzv-backend c10d): the agents (one ddprun per node) meet in a
// small TCP store that one of them hosts for the whole job. The store assigns node ranks, agrees
// on the workers' MASTER_ADDR/MASTER_PORT for every attempt, keeps one restart budget for the
// whole job, watches every agent's heartbeat, and picks the job-wide root cause.
//
// The protocol is ddprun's own (framing and handshake: rdzv_wire.h), and every socket operation
// on either side has a deadline. Each connection starts with a challenge and response over the
// job's secret (docs/security.md); then JOIN or RESUME binds it to one agent, and it may speak
// for that agent only. The store: rdzv_server.cpp (network) and rdzv_store.cpp (its rules);
// an agent's side: rdzv_client.cpp.
//
// Why not c10d's TCPStore, as torchrun does: ddprun links nothing from torch, and a key-value
// store gives none of what the agents need. They need an identity per connection (the secret's
// challenge and response, and requests bound to the connection that owns the node, so that no
// one can speak for another node), heartbeats after which the store itself declares a node
// lost, one restart budget for the whole job, and one job-wide root cause picked from every
// node's report. Over a plain store each agent would have to build these from keys that any
// client can read and overwrite.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ddprun {

using Message = std::vector<std::string>;

struct RdzvConfig {
  std::string run_id = "none";
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  double join_timeout = 600;       // first round: MIN nodes must have joined by then
  double last_call_timeout = 30;   // first round: once MIN joined, wait this long for up to MAX
  double heartbeat_timeout = 5;    // an agent silent this long is declared lost
  // Every connection must prove it knows this (HMAC-SHA256 challenge and response) before
  // its requests count; empty: anyone who reaches the port may join, as with torchrun.
  std::string secret;
};

// The store. It listens on exactly the address it was given (never every interface) and runs
// in a thread of the hosting agent until destroyed.
class RdzvServer {
 public:
  // Binds host:port. Returns nullptr and sets *why (strerror) and *error_number if it cannot
  // (EADDRINUSE: another agent hosts it; EADDRNOTAVAIL: not this host's address).
  static std::unique_ptr<RdzvServer> try_bind(const std::string& host, int port, const RdzvConfig& config,
                                              std::string* why, int* error_number);
  ~RdzvServer();
  RdzvServer(const RdzvServer&) = delete;
  RdzvServer& operator=(const RdzvServer&) = delete;

  // Once the job is over: waits (at most `seconds`) until every agent still alive has fetched
  // the outcome, so that the host does not vanish under agents that are still polling.
  void wait_until_everyone_knows(double seconds);

 private:
  RdzvServer(int listen_fd, const RdzvConfig& config);
  void loop();
  struct State;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::unique_ptr<State> state_;
  std::thread thread_;
};

// A node's place in a round, whichever rendezvous formed it (this one, or etcd_rendezvous.h's).
struct RoundAssignment {
  int node_rank = 0;
  int nnodes = 1;
  int world_size = 1;
  int base_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

// What an agent learnt from the store the last time it asked.
struct RdzvView : RoundAssignment {
  enum Kind { kNone, kWait, kRound, kStop, kDone, kFail, kLost };
  Kind kind = kNone;
  int round = -1;
  int restart_count = 0;
  std::string text;  // kRound: why this round was formed; kStop/kFail/kLost/kWait: the reason
};

// One agent's side: a connection to the store (re-established when it breaks) and a heartbeat
// thread that polls the store every monitor interval.
class RdzvClient {
 public:
  RdzvClient(std::string host, int port, std::string local_addr, double monitor_interval,
             double heartbeat_timeout, std::string secret = "");
  ~RdzvClient();
  RdzvClient(const RdzvClient&) = delete;
  RdzvClient& operator=(const RdzvClient&) = delete;

  // Connects (retrying until `connect_deadline_seconds` from now: the host may start later)
  // and joins. Throws std::runtime_error with the store's reason if refused or unreachable.
  void join(const std::string& run_id, const std::string& host_name, int nproc, bool hosts_store,
            double connect_deadline_seconds);

  // Starts the heartbeat thread (after join).
  void start_heartbeat();

  // Called by the agent's supervision loop on every pass. The heartbeat thread stays silent
  // while the last call is older than heartbeat_timeout: an agent whose loop is stuck (in a
  // write, in the kernel) must look lost to the store rather than hold up the whole job.
  void mark_supervisor_alive();

  // The latest view, and whether the store has not answered for longer than heartbeat_timeout.
  RdzvView view();
  bool store_lost();
  double seconds_since_answer();

  // Readable when the view changed (drain with drain_wake()).
  int wake_fd() const { return wake_pipe_[0]; }
  void drain_wake();

  // Tells the store at once that a worker of `round` failed (so the other nodes stop).
  void notify_failing(int round, int rank, const std::string& how);
  // Ends this agent's part in `round`: kind is "success", "stopped", "failed" or "signal";
  // failure holds the fields of the local root cause when kind is "failed".
  void report(int round, const std::string& kind, const Message& failure);
  // Leaves the job (ddprun was asked to stop between rounds).
  void leave();

  const std::string& local_addr() const { return local_addr_; }
  const std::string& endpoint() const { return endpoint_text_; }

 private:
  bool request(const Message& message, Message* reply, double timeout_seconds);
  bool connect_once(double timeout_seconds);
  bool authenticate(int fd, std::chrono::steady_clock::time_point deadline);
  void heartbeat_loop();
  static RdzvView parse_view(const Message& reply);

  std::string host_;
  int port_;
  std::string local_addr_;
  std::string endpoint_text_;
  double monitor_interval_;
  double heartbeat_timeout_;
  std::string secret_;
  std::string refusal_;  // why the store refused the last handshake, if it did
  std::string agent_id_;
  std::mutex connection_mutex_;  // one request at a time on the connection
  int fd_ = -1;
  std::mutex view_mutex_;
  RdzvView view_;
  std::chrono::steady_clock::time_point last_answer_;
  int wake_pipe_[2] = {-1, -1};
  std::mutex stop_mutex_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread thread_;
  std::atomic<std::chrono::steady_clock::rep> supervisor_alive_at_{0};
};

// The job secret in the file at `path`, without trailing whitespace. Throws std::runtime_error
// naming the file if it cannot be read, is readable by group or others, or is shorter than 16
// bytes.
std::string load_rdzv_secret(const std::string& path);

// A TCP port that was free on every interface of this host a moment ago.
int pick_free_tcp_port();

}  // namespace ddprun
