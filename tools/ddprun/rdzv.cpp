#include "rdzv.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "hmac_sha256.h"
#include "posix_util.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxFrame = 1 << 20;  // a peer sending more is not one of ours
constexpr const char* kProtocol = "ddprun-rdzv-2";

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

int ms_until(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 60 * 1000));
}

std::string fmt(double seconds) {
  std::ostringstream text;
  text.precision(3);
  text << seconds;
  return text.str();
}

void put_u32(std::string& out, uint32_t value) {
  uint32_t big = htonl(value);
  out.append(reinterpret_cast<const char*>(&big), 4);
}

uint32_t get_u32(const std::string& in, size_t at) {
  uint32_t big = 0;
  std::memcpy(&big, in.data() + at, 4);
  return ntohl(big);
}

std::string encode(const Message& message) {
  std::string body;
  put_u32(body, static_cast<uint32_t>(message.size()));
  for (const std::string& field : message) {
    put_u32(body, static_cast<uint32_t>(field.size()));
    body += field;
  }
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(body.size()));
  return frame + body;
}

// 1: a whole frame was taken from the front of buffer; 0: need more bytes; -1: garbage.
int take_frame(std::string& buffer, Message* message) {
  if (buffer.size() < 4) return 0;
  const uint32_t length = get_u32(buffer, 0);
  if (length > kMaxFrame || length < 4) return -1;
  if (buffer.size() < 4 + static_cast<size_t>(length)) return 0;
  const std::string body = buffer.substr(4, length);
  buffer.erase(0, 4 + static_cast<size_t>(length));
  const uint32_t count = get_u32(body, 0);
  size_t at = 4;
  message->clear();
  for (uint32_t i = 0; i < count; ++i) {
    if (at + 4 > body.size()) return -1;
    const uint32_t size = get_u32(body, at);
    at += 4;
    if (at + size > body.size()) return -1;
    message->push_back(body.substr(at, size));
    at += size;
  }
  return at == body.size() ? 1 : -1;
}

int to_int(const std::string& text, int fallback = 0) {
  try {
    return std::stoi(text);
  } catch (...) {
    return fallback;
  }
}

long long to_ll(const std::string& text) {
  try {
    return std::stoll(text);
  } catch (...) {
    return 0;
  }
}

// IPv4 address of `host` (a dotted quad or a name). Throws std::runtime_error.
in_addr resolve_ipv4(const std::string& host) {
  in_addr address{};
  if (::inet_pton(AF_INET, host.c_str(), &address) == 1) return address;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw std::runtime_error("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  address = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
  ::freeaddrinfo(found);
  return address;
}

std::string address_text(const in_addr& address) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address, text, sizeof text);
  return text;
}

// Blocks every signal in the threads started while it lives: the launcher's signal pipe is
// read by the main thread, and the helpers must never run its handlers.
class BlockSignalsForNewThreads {
 public:
  BlockSignalsForNewThreads() {
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, &previous_);
  }
  ~BlockSignalsForNewThreads() { ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }

 private:
  sigset_t previous_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The store's state machine. Rounds ("attempts") are formed from the agents that joined;
// a round runs until every member has reported (success, stopped, failed, left) or was lost,
// and then the store decides: done, failed, or the next round.

struct RdzvServer::State {
  struct Peer {
    long serial = -1;
    std::string agent;  // empty until it joined or resumed
  };
  struct Agent {
    std::string id, host, addr;
    int nproc = 1;
    int port = 0;
    bool hosts_store = false;
    long seq = 0;
    Clock::time_point last_seen;
    bool gone = false;      // lost or left
    bool informed = false;  // fetched the job's outcome
    int member_of = -1;     // round in which it is a member that has not reported yet
    int node_rank = -1;     // in the last round it was a member of
    bool pending = false;   // waiting for the next round
    long connection = -1;   // serial of the connection that speaks for it
  };
  struct Report {
    std::string kind;
    Message failure;
  };

  explicit State(const RdzvConfig& c) : config(c), started(Clock::now()) {}

  RdzvConfig config;
  std::mutex mutex;
  Clock::time_point started;
  std::map<std::string, Agent> agents;
  long next_seq = 0;
  enum class Phase { kForming, kRunning, kFinished } phase = Phase::kForming;
  int round = -1;
  std::vector<std::string> members;  // current round, by node rank
  int world_size = 0;
  std::map<std::string, int> base_rank;
  std::string master_addr;
  int master_port = 0;
  std::string round_reason = "first rendezvous";
  std::string next_reason;
  bool stopping = false;
  std::string stop_reason;
  // The round is being stopped for a change of membership (a node waiting
  // to join): workers that fail from then on fail because their peers on
  // other nodes were stopped first, which is no failure of the job.
  bool stopping_for_membership = false;
  std::map<std::string, Report> reports;
  std::map<std::string, long> failing_order;  // agent -> order of its first failure notice
  std::vector<std::string> departed;          // members lost or gone during this round
  int restarts_used = 0;
  bool min_reached = false;
  Clock::time_point min_reached_at;
  bool done = false;
  std::string final_message;

  std::string describe(const Agent& agent) const {
    std::string where = agent.host + ", " + agent.addr;
    if (agent.node_rank >= 0) return "node " + std::to_string(agent.node_rank) + " (" + where + ")";
    return "a node that had not started yet (" + where + ")";
  }

  std::vector<Agent*> pending_agents() {
    std::vector<Agent*> result;
    for (auto& [id, agent] : agents) {
      if (agent.pending && !agent.gone) result.push_back(&agent);
    }
    std::sort(result.begin(), result.end(), [&](const Agent* a, const Agent* b) {
      // Stable node ranks: the last round's members keep their order; on the first round the
      // agent hosting the store comes first; newcomers then by arrival.
      auto key = [&](const Agent* x) {
        int first = x->node_rank >= 0 ? x->node_rank : (round < 0 && x->hosts_store ? -1 : 1 << 30);
        return std::make_pair(first, x->seq);
      };
      return key(a) < key(b);
    });
    return result;
  }

  void finish(bool success, const std::string& message) {
    phase = Phase::kFinished;
    done = success;
    final_message = message.compare(0, 10, "job failed") == 0 ? message : "job failed: " + message;
    for (auto& [id, agent] : agents) agent.member_of = -1;
  }

  void form(std::vector<Agent*> chosen, Clock::time_point now) {
    ++round;
    members.clear();
    base_rank.clear();
    world_size = 0;
    for (size_t i = 0; i < chosen.size(); ++i) {
      Agent* agent = chosen[i];
      agent->pending = false;
      agent->member_of = round;
      agent->node_rank = static_cast<int>(i);
      members.push_back(agent->id);
      base_rank[agent->id] = world_size;
      world_size += agent->nproc;
    }
    // The agents still pending (more than MAX) are no longer numbered by the last round.
    for (Agent* agent : pending_agents()) agent->node_rank = -1;
    master_addr = chosen.front()->addr;
    master_port = chosen.front()->port;
    round_reason = next_reason.empty() ? "first rendezvous" : next_reason;
    next_reason.clear();
    stopping = false;
    stopping_for_membership = false;
    stop_reason.clear();
    reports.clear();
    failing_order.clear();
    departed.clear();
    phase = Phase::kRunning;
    (void)now;
  }

  void try_form(Clock::time_point now) {
    std::vector<Agent*> ready = pending_agents();
    const int n = static_cast<int>(ready.size());
    if (round < 0) {
      if (n >= config.max_nodes) {
        ready.resize(static_cast<size_t>(config.max_nodes));
        return form(ready, now);
      }
      if (n >= config.min_nodes) {
        if (!min_reached) {
          min_reached = true;
          min_reached_at = now;
        }
        if (seconds_between(min_reached_at, now) >= config.last_call_timeout) return form(ready, now);
        return;
      }
      min_reached = false;
      if (seconds_between(started, now) >= config.join_timeout) {
        finish(false, "only " + std::to_string(n) + " of the minimum " + std::to_string(config.min_nodes) +
                          " node(s) joined the rendezvous within the join timeout of " +
                          fmt(config.join_timeout) + " s (--rdzv-conf join_timeout=SECONDS)");
      }
      return;
    }
    if (n >= config.min_nodes) {
      if (n > config.max_nodes) ready.resize(static_cast<size_t>(config.max_nodes));
      return form(ready, now);
    }
    finish(false, next_reason + (next_reason.empty() ? "" : "; ") + "only " + std::to_string(n) +
                      " node(s) remain, fewer than the minimum of " + std::to_string(config.min_nodes) +
                      " (--nnodes MIN:MAX)");
  }

  std::string root_cause() const {
    // The earliest original error any node's workers recorded; failing that, the earliest
    // recorded consequence; failing that, the first failure the store was told about.
    const Message* best = nullptr;
    const Agent* best_agent = nullptr;
    long best_order = 0;
    auto recorded = [](const Message& f) { return f.size() > 10 && f[6] == "1"; };
    for (const auto& [id, report] : reports) {
      if (report.kind != "failed" || report.failure.size() < 11) continue;
      const Message& f = report.failure;
      auto order_it = failing_order.find(id);
      const long order = order_it == failing_order.end() ? (1L << 40) : order_it->second;
      bool better = false;
      if (best == nullptr) {
        better = true;
      } else if (recorded(f) != recorded(*best)) {
        better = recorded(f);
      } else if (recorded(f)) {
        const bool consequence = f[8] == "1", best_consequence = (*best)[8] == "1";
        if (consequence != best_consequence) {
          better = !consequence;
        } else {
          better = to_ll(f[9]) < to_ll((*best)[9]);
        }
      } else {
        better = order < best_order;
      }
      if (better) {
        best = &f;
        best_agent = &agents.at(id);
        best_order = order;
      }
    }
    std::vector<std::string> lines = {"job failed after " + std::to_string(restarts_used) + " restart(s)"};
    if (best == nullptr) {
      lines.push_back("root cause: " + (stop_reason.empty() ? std::string("unknown") : stop_reason));
    } else {
      const Message& f = *best;
      std::string heading = "root cause (first failure of the last attempt, across all nodes):";
      std::string detail = "  last error line: " + f[4];
      if (f[6] == "1" && f[8] != "1") {
        heading = "root cause (the earliest original error of the last attempt, across all nodes):";
        detail = "  error: " + f[7];
      } else if (f[6] == "1") {
        heading =
            "root cause (the earliest error of the last attempt, across all nodes; every recorded error is a "
            "consequence of another failure, such as a worker that died without a message):";
        detail = "  error (a consequence): " + f[7];
      }
      lines.push_back(heading);
      lines.push_back("  node: " + std::to_string(best_agent->node_rank) + ", rank: " + f[0] + " (local rank " +
                      f[1] + "), host: " + f[10] + " (" + best_agent->addr + "), pid: " + f[2]);
      lines.push_back("  exit: " + f[3]);
      lines.push_back(detail);
      if (!f[5].empty()) lines.push_back("  log: " + f[5] + " (on node " + std::to_string(best_agent->node_rank) + ")");
    }
    std::string text;
    for (size_t i = 0; i < lines.size(); ++i) text += (i ? "\n" : "") + lines[i];
    return text;
  }

  std::string failure_summary(const Agent& agent, const Message& failure) const {
    if (failure.size() < 11) return describe(agent) + " failed";
    return "rank " + failure[0] + " on " + describe(agent) + " failed: " + failure[3];
  }

  void decide(Clock::time_point now) {
    bool any_failed = false, all_success = true;
    for (const std::string& id : members) {
      auto it = reports.find(id);
      const std::string kind = it == reports.end() ? "lost" : it->second.kind;
      if (kind == "failed") any_failed = true;
      if (kind != "success") all_success = false;
    }
    std::string departed_text;
    for (const std::string& d : departed) departed_text += (departed_text.empty() ? "" : "; ") + d;
    if (!departed.empty()) {
      // A change of membership: no restart is counted.
      next_reason = departed_text;
      std::vector<Agent*> ready = pending_agents();
      if (static_cast<int>(ready.size()) >= config.min_nodes) {
        next_reason += "; continuing with " + std::to_string(std::min<int>(static_cast<int>(ready.size()), config.max_nodes)) +
                       " node(s)";
      }
      phase = Phase::kForming;
      return try_form(now);
    }
    if (all_success) return finish(true, "");
    if (any_failed && stopping_for_membership) {
      // Failures after the store asked every node to stop for a joining node
      // are that stop's consequences: no restart is counted.
      next_reason = "re-forming: " + stop_reason;
    } else if (any_failed) {
      if (restarts_used >= config.max_restarts) return finish(false, root_cause());
      ++restarts_used;
      next_reason = "restart " + std::to_string(restarts_used) + " of " + std::to_string(config.max_restarts) +
                    " after " + stop_reason;
    } else {
      next_reason = "re-forming: " + stop_reason;
    }
    phase = Phase::kForming;
    try_form(now);
  }

  void start_stopping(const std::string& reason) {
    if (stopping) return;
    stopping = true;
    stop_reason = reason;
  }

  void depart(Agent& agent, const std::string& what) {
    agent.gone = true;
    const bool was_pending = agent.pending;
    agent.pending = false;
    if (phase == Phase::kFinished) return;
    if (phase == Phase::kForming && was_pending && agent.node_rank >= 0) {
      next_reason += (next_reason.empty() ? "" : "; ") + describe(agent) + " " + what;
    }
    const bool in_round = phase == Phase::kRunning &&
                          std::find(members.begin(), members.end(), agent.id) != members.end();
    if (in_round) {
      departed.push_back(describe(agent) + " " + what);
      start_stopping(describe(agent) + " " + what);
    }
    agent.member_of = -1;
  }

  void tick(Clock::time_point now) {
    for (auto& [id, agent] : agents) {
      if (agent.gone) continue;
      const double silent = seconds_between(agent.last_seen, now);
      if (silent > config.heartbeat_timeout) {
        depart(agent, "lost: its ddprun has not answered for " + fmt(silent) + " s (heartbeat timeout " +
                          fmt(config.heartbeat_timeout) + " s)");
      }
    }
    if (phase == Phase::kForming) return try_form(now);
    if (phase != Phase::kRunning) return;
    if (!stopping && static_cast<int>(members.size()) < config.max_nodes) {
      for (auto& [id, agent] : agents) {
        if (agent.pending && !agent.gone && agent.node_rank < 0) {
          start_stopping("a new node (" + agent.host + ", " + agent.addr + ") is waiting to join");
          stopping_for_membership = true;
          break;
        }
      }
    }
    for (const std::string& id : members) {
      const Agent& agent = agents.at(id);
      if (!agent.gone && agent.member_of == round) return;  // still running
    }
    decide(now);
  }

  // `peer` is the connection the request came on: JOIN and RESUME bind it to an agent, and every
  // other request must name the agent bound to it, so that no one can speak for another node.
  Message handle(const Message& request, Clock::time_point now, Peer* peer) {
    if (request.empty()) return {"error", "empty request"};
    const std::string& op = request[0];
    if (op == "JOIN") {
      // JOIN protocol run_id host addr nproc port hosts_store
      if (request.size() < 8 || request[1] != kProtocol) return {"refused", "protocol mismatch"};
      if (!peer->agent.empty()) return {"refused", "this connection has joined already"};
      // The store's run id is never quoted: in a job without a secret it is all that keeps a
      // stranger out.
      if (request[2] != config.run_id) {
        return {"refused", "its run id is not the store's (--rdzv-id must be the same on every node)"};
      }
      if (phase == Phase::kFinished) return {"refused", "the job has finished already"};
      Agent agent;
      agent.id = random_hex(16);  // unpredictable: the id is what a request for a node names
      agent.seq = next_seq++;
      agent.host = request[3];
      agent.addr = request[4];
      agent.nproc = std::max(1, to_int(request[5], 1));
      // Each node checked its own --nnodes times --nproc-per-node; nodes that disagree on
      // --nnodes could still add up past an int here.
      if (agent.nproc > std::numeric_limits<int>::max() / std::max(1, config.max_nodes)) {
        return {"refused", "its --nproc-per-node " + std::to_string(agent.nproc) + " times the job's " +
                               std::to_string(config.max_nodes) + " nodes is more ranks than a job can have"};
      }
      agent.port = to_int(request[6]);
      agent.hosts_store = request[7] == "1";
      agent.last_seen = now;
      agent.pending = true;
      agent.connection = peer->serial;
      const std::string id = agent.id;
      agents[id] = agent;
      peer->agent = id;
      tick(now);
      return {"ok", kProtocol, id};
    }
    if (request.size() < 2) return {"error", "malformed request"};
    auto it = agents.find(request[1]);
    if (it == agents.end() || it->second.gone) {
      return {"lost", "the rendezvous store no longer counts this node as part of the job (its heartbeat was "
                      "late by more than " + fmt(config.heartbeat_timeout) + " s, or it left)"};
    }
    if (op == "RESUME") {
      // An agent's new connection after its old one broke; the old one speaks for it no more.
      if (!peer->agent.empty() && peer->agent != request[1]) return {"refused", "this connection belongs to another node"};
      it->second.connection = peer->serial;
      peer->agent = request[1];
      it->second.last_seen = now;
      return {"ok"};
    }
    if (peer->agent != request[1] || it->second.connection != peer->serial) {
      return {"refused", "this connection does not belong to that node"};
    }
    Agent& agent = it->second;
    agent.last_seen = now;
    if (op == "POLL") {
      if (phase == Phase::kFinished) {
        agent.informed = true;
        return done ? Message{"done"} : Message{"fail", final_message};
      }
      if (agent.member_of == round && phase == Phase::kRunning) {
        if (stopping) return {"stop", std::to_string(round), stop_reason};
        return {"round", std::to_string(round), std::to_string(agent.node_rank), std::to_string(members.size()),
                std::to_string(world_size), std::to_string(base_rank[agent.id]), master_addr,
                std::to_string(master_port), std::to_string(restarts_used), round_reason};
      }
      int waiting = 0;
      for (auto& [id, a] : agents) waiting += a.pending && !a.gone ? 1 : 0;
      return {"wait", std::to_string(waiting) + " node(s) waiting for the next round (minimum " +
                          std::to_string(config.min_nodes) + ", maximum " + std::to_string(config.max_nodes) + ")"};
    }
    if (op == "FAILING" && request.size() >= 4) {
      if (to_int(request[2], -2) == round && agent.member_of == round) {
        if (!failing_order.count(agent.id)) failing_order[agent.id] = next_seq++;
        start_stopping("rank " + request[3] + " on " + describe(agent) + " failed: " +
                       (request.size() > 4 ? request[4] : std::string("?")));
      }
      return {"ok"};
    }
    if (op == "REPORT" && request.size() >= 5) {
      // REPORT id round kind port failure-fields...
      if (to_int(request[2], -2) != round || agent.member_of != round) return {"ok"};
      Report report;
      report.kind = request[3];
      report.failure.assign(request.begin() + 5, request.end());
      agent.port = to_int(request[4], agent.port);
      agent.member_of = -1;
      if (report.kind == "failed") {
        if (!failing_order.count(agent.id)) failing_order[agent.id] = next_seq++;
        start_stopping(failure_summary(agent, report.failure));
      }
      reports[agent.id] = report;
      if (report.kind == "signal") {
        depart(agent, "left: its ddprun was asked to stop (" + (report.failure.empty() ? std::string("signal")
                                                                                         : report.failure[0]) + ")");
      } else {
        agent.pending = true;
      }
      tick(now);
      return {"ok"};
    }
    if (op == "LEAVE") {
      depart(agent, "left: its ddprun was asked to stop");
      tick(now);
      return {"ok"};
    }
    return {"error", "unknown request '" + op + "'"};
  }
};

// ---------------------------------------------------------------------------------------------
// The store's network side.

std::unique_ptr<RdzvServer> RdzvServer::try_bind(const std::string& host, int port, const RdzvConfig& config,
                                                 std::string* why, int* error_number) {
  in_addr address = resolve_ipv4(host);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw_errno("socket");
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in bind_address{};
  bind_address.sin_family = AF_INET;
  bind_address.sin_addr = address;
  bind_address.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&bind_address), sizeof bind_address) != 0 || ::listen(fd, 128) != 0) {
    *error_number = errno;
    *why = std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<RdzvServer>(new RdzvServer(fd, config));
}

RdzvServer::RdzvServer(int listen_fd, const RdzvConfig& config)
    : listen_fd_(listen_fd), state_(std::make_unique<State>(config)) {
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
  BlockSignalsForNewThreads block;
  thread_ = std::thread([this] { loop(); });
}

RdzvServer::~RdzvServer() {
  char byte = 1;
  ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
  (void)ignored;
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

void RdzvServer::wait_until_everyone_knows(double seconds) {
  const Clock::time_point deadline = after(seconds);
  while (Clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      bool all = state_->phase == State::Phase::kFinished;
      for (auto& [id, agent] : state_->agents) all = all && (agent.gone || agent.informed);
      if (all) return;
    }
    ::usleep(20 * 1000);
  }
}

void RdzvServer::loop() {
  // Until a connection has proven the secret it may hold only a small buffer and a slot for a
  // few seconds: strangers must not be able to fill the table or the memory.
  enum class Stage { kNew, kChallenged, kAuthenticated };
  struct Connection {
    int fd = -1;
    std::string in, out;
    Clock::time_point opened, last_activity;
    Stage stage = Stage::kNew;
    std::string client_nonce, server_nonce;
    State::Peer peer;
    bool peer_closed = false;  // it shut down its side: send what is left, then close
    bool closing = false;      // refused: send the refusal, then close
  };
  std::vector<Connection> connections;
  long next_serial = 0;
  // A connection silent for this long belongs to an agent that is gone (or a stray client).
  const double idle_limit = std::max(30.0, 4 * state_->config.heartbeat_timeout);
  const double handshake_limit = 5.0;
  constexpr size_t kMaxUnauthenticatedInput = 4096;
  // Half the descriptors this process may open, at most 1024: the agent needs the rest for its
  // workers' pipes.
  size_t max_connections = 1024;
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    max_connections = std::clamp<size_t>(files.rlim_cur / 2, 16, 1024);
  }
  Clock::time_point accept_paused_until{};

  auto evict_oldest_unauthenticated = [&] {
    Connection* oldest = nullptr;
    for (Connection& c : connections) {
      if (c.fd >= 0 && c.stage != Stage::kAuthenticated && (oldest == nullptr || c.opened < oldest->opened)) oldest = &c;
    }
    if (oldest == nullptr) return false;
    ::close(oldest->fd);
    oldest->fd = -1;
    return true;
  };

  // The challenge and response; only an authenticated connection reaches the state machine.
  auto respond = [&](Connection& c, const Message& request, Clock::time_point now) -> Message {
    const std::string op = request.empty() ? std::string() : request[0];
    if (c.stage == Stage::kNew) {
      if (op != "HELLO" || request.size() < 3 || request[1] != kProtocol || request[2].size() > 128) {
        c.closing = true;
        return {"refused", "protocol mismatch: a ddprun rendezvous store expects its own handshake first"};
      }
      c.client_nonce = request[2];
      c.server_nonce = random_hex(16);
      c.stage = Stage::kChallenged;
      return {"challenge", kProtocol, c.server_nonce,
              to_hex(hmac_sha256(state_->config.secret, "server\n" + c.client_nonce + "\n" + c.server_nonce))};
    }
    if (c.stage == Stage::kChallenged) {
      const std::string expected =
          to_hex(hmac_sha256(state_->config.secret, "client\n" + c.server_nonce + "\n" + c.client_nonce));
      if (op != "AUTH" || request.size() < 2 || !equal_in_constant_time(request[1], expected)) {
        c.closing = true;
        return {"refused", "authentication failed: this node's rendezvous secret is not the store's (every node "
                           "needs the same secret: --rdzv-secret-file or DDP_RDZV_SECRET_FILE)"};
      }
      c.stage = Stage::kAuthenticated;
      return {"ok"};
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->handle(request, now, &c.peer);
  };

  auto serve = [&](Connection& c, short revents, Clock::time_point now) {
    if (revents & (POLLERR | POLLNVAL)) return false;
    if (!c.peer_closed && (revents & (POLLIN | POLLHUP))) {
      const size_t input_limit = c.stage == Stage::kAuthenticated ? kMaxFrame + 8 : kMaxUnauthenticatedInput;
      // Everything that is there now, so that a burst of requests is answered in one pass.
      for (size_t taken = 0; taken < 4 * kMaxFrame;) {
        char buffer[16384];
        const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
        if (n > 0) {
          c.in.append(buffer, static_cast<size_t>(n));
          taken += static_cast<size_t>(n);
          c.last_activity = now;
          Message request;
          int got;
          while (!c.closing && (got = take_frame(c.in, &request)) == 1) c.out += encode(respond(c, request, now));
          if (c.closing) break;
          if (got < 0 || c.in.size() > input_limit) return false;
          continue;
        }
        if (n == 0) {
          c.peer_closed = true;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return false;
        }
        break;
      }
    }
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        break;
      } else {
        return false;
      }
    }
    if ((c.peer_closed || c.closing) && c.out.empty()) return false;
    if (c.stage != Stage::kAuthenticated && seconds_between(c.opened, now) > handshake_limit) return false;
    if (seconds_between(c.last_activity, now) > idle_limit) return false;
    return c.out.size() <= kMaxFrame * 4;  // a peer that never reads its replies
  };

  while (true) {
    Clock::time_point now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    std::vector<pollfd> fds = {{wake_pipe_[0], POLLIN, 0}, {listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0}};
    for (const Connection& c : connections) {
      short events = c.out.empty() ? 0 : POLLOUT;
      if (!c.peer_closed) events |= POLLIN;
      fds.push_back({c.fd, events, 0});
    }
    const int ready = ::poll(fds.data(), fds.size(), 100);
    if (ready < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;  // shutting down
    now = Clock::now();
    // Only the connections that were polled: fds holds nothing for the ones accepted below.
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      if (!serve(c, ready > 0 ? fds[i + 2].revents : 0, now)) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    connections.erase(std::remove_if(connections.begin(), connections.end(),
                                     [](const Connection& c) { return c.fd < 0; }),
                      connections.end());
    if (ready > 0 && (fds[1].revents & POLLIN)) {
      while (true) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if ((errno == EMFILE || errno == ENFILE) && evict_oldest_unauthenticated()) continue;
          // Out of descriptors with no stranger to evict: stop polling the listener for a
          // while rather than spin on a backlog we cannot take.
          if (errno != EAGAIN && errno != EWOULDBLOCK) accept_paused_until = now + std::chrono::milliseconds(200);
          break;
        }
        size_t open = 0;
        for (const Connection& c : connections) open += c.fd >= 0 ? 1 : 0;
        if (open >= max_connections && !evict_oldest_unauthenticated()) {
          ::close(fd);  // every slot is an agent's
          continue;
        }
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        Connection c;
        c.fd = fd;
        c.opened = c.last_activity = now;
        c.peer.serial = next_serial++;
        connections.push_back(std::move(c));
      }
      connections.erase(std::remove_if(connections.begin(), connections.end(),
                                       [](const Connection& c) { return c.fd < 0; }),
                        connections.end());
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->tick(now);
  }
  for (Connection& c : connections) ::close(c.fd);
}

// ---------------------------------------------------------------------------------------------
// An agent's side.

RdzvClient::RdzvClient(std::string host, int port, std::string local_addr, double monitor_interval,
                       double heartbeat_timeout, std::string secret)
    : host_(std::move(host)),
      port_(port),
      local_addr_(std::move(local_addr)),
      endpoint_text_(host_ + ":" + std::to_string(port_)),
      monitor_interval_(monitor_interval),
      heartbeat_timeout_(heartbeat_timeout),
      secret_(std::move(secret)),
      last_answer_(Clock::now()) {
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
}

RdzvClient::~RdzvClient() {
  {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

bool RdzvClient::connect_once(double timeout_seconds) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  auto fail = [&] {
    ::close(fd);
    return false;
  };
  if (!local_addr_.empty()) {
    sockaddr_in local{};
    local.sin_family = AF_INET;
    if (::inet_pton(AF_INET, local_addr_.c_str(), &local.sin_addr) == 1) {
      // Leave the connection from --local-addr (a host name is only advertised, not bound).
      if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) return fail();
    }
  }
  sockaddr_in remote{};
  remote.sin_family = AF_INET;
  try {
    remote.sin_addr = resolve_ipv4(host_);
  } catch (const std::exception&) {
    return fail();
  }
  remote.sin_port = htons(static_cast<uint16_t>(port_));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof remote) != 0) {
    if (errno != EINPROGRESS) return fail();
    pollfd p{fd, POLLOUT, 0};
    const Clock::time_point deadline = after(timeout_seconds);
    int ready;
    while ((ready = ::poll(&p, 1, ms_until(deadline))) < 0 && errno == EINTR) {
    }
    if (ready <= 0) return fail();
    int error = 0;
    socklen_t length = sizeof error;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != 0) return fail();
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (!authenticate(fd, after(timeout_seconds))) return fail();
  if (local_addr_.empty()) {
    sockaddr_in mine{};
    socklen_t length = sizeof mine;
    // The address this host reaches the store from is one the other nodes can reach too.
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &length) == 0) local_addr_ = address_text(mine.sin_addr);
  }
  fd_ = fd;
  return true;
}

// Both sides prove that they know the secret without sending it: each MACs both nonces, the
// store's fresh per connection, so that a recorded answer is worth nothing on another one.
bool RdzvClient::authenticate(int fd, Clock::time_point deadline) {
  const std::string client_nonce = random_hex(16);
  Message reply;
  if (!exchange(fd, {"HELLO", kProtocol, client_nonce}, &reply, deadline)) return false;
  if (reply.size() >= 2 && reply[0] == "refused") {
    refusal_ = reply[1];
    return false;
  }
  if (reply.size() < 4 || reply[0] != "challenge" || reply[1] != kProtocol) {
    refusal_ = "the process on " + endpoint_text_ + " is not a ddprun rendezvous store of this version";
    return false;
  }
  const std::string& server_nonce = reply[2];
  const std::string expected = to_hex(hmac_sha256(secret_, "server\n" + client_nonce + "\n" + server_nonce));
  if (!equal_in_constant_time(reply[3], expected)) {
    refusal_ = "the rendezvous store at " + endpoint_text_ +
               " does not know this node's secret (every node needs the same --rdzv-secret-file or "
               "DDP_RDZV_SECRET_FILE, or none)";
    return false;
  }
  const std::string proof = to_hex(hmac_sha256(secret_, "client\n" + server_nonce + "\n" + client_nonce));
  if (!exchange(fd, {"AUTH", proof}, &reply, deadline)) return false;
  if (reply.size() >= 2 && reply[0] == "refused") {
    refusal_ = reply[1];
    return false;
  }
  if (reply.empty() || reply[0] != "ok") return false;
  if (agent_id_.empty()) return true;
  // A new connection of a node that joined already speaks for it from now on.
  return exchange(fd, {"RESUME", agent_id_}, &reply, deadline);
}

bool RdzvClient::request(const Message& message, Message* reply, double timeout_seconds) {
  std::lock_guard<std::mutex> lock(connection_mutex_);
  const Clock::time_point deadline = after(timeout_seconds);
  if (fd_ < 0 && !connect_once(std::min(timeout_seconds, 1.0))) return false;
  if (exchange(fd_, message, reply, deadline)) return true;
  ::close(fd_);
  fd_ = -1;
  return false;
}

bool RdzvClient::exchange(int fd, const Message& message, Message* reply, Clock::time_point deadline) {
  const std::string frame = encode(message);
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) return false;
    pollfd p{fd, POLLOUT, 0};
    if (Clock::now() >= deadline || ::poll(&p, 1, ms_until(deadline)) < 0) return false;
  }
  std::string buffer;
  while (true) {
    int got = take_frame(buffer, reply);
    if (got == 1) return true;
    if (got < 0) return false;
    pollfd p{fd, POLLIN, 0};
    int ready = ::poll(&p, 1, ms_until(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    char chunk[16384];
    ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n > 0) {
      buffer.append(chunk, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      return false;
    }
  }
}

void RdzvClient::join(const std::string& run_id, const std::string& host_name, int nproc, bool hosts_store,
                      double connect_deadline_seconds) {
  const Clock::time_point deadline = after(connect_deadline_seconds);
  bool answered_garbage = false;
  while (true) {
    Message reply;
    const Message join_request = {"JOIN", kProtocol, run_id, host_name, local_addr_.empty() ? "?" : local_addr_,
                                  std::to_string(nproc), std::to_string(pick_free_tcp_port()),
                                  hosts_store ? "1" : "0"};
    bool connected;
    {
      std::lock_guard<std::mutex> lock(connection_mutex_);
      refusal_.clear();
      connected = fd_ >= 0 || connect_once(1.0);
      if (!connected && !refusal_.empty()) {
        throw std::runtime_error("cannot join the rendezvous store at " + endpoint_text_ + ": " + refusal_);
      }
    }
    if (connected) {
      Message request_with_addr = join_request;
      request_with_addr[4] = local_addr_;  // known once connected
      const double remaining = std::chrono::duration<double>(deadline - Clock::now()).count();
      if (request(request_with_addr, &reply, std::clamp(remaining, 1.0, 5.0))) {
        if (reply.size() >= 3 && reply[0] == "ok" && reply[1] == kProtocol) {
          agent_id_ = reply[2];
          last_answer_ = Clock::now();
          return;
        }
        if (reply.size() >= 2 && reply[0] == "refused") {
          throw std::runtime_error("the rendezvous store at " + endpoint_text_ + " refused this node (run id '" +
                                   run_id + "'): " + reply[1]);
        }
        answered_garbage = true;
      }
    }
    if (Clock::now() >= deadline) {
      throw std::runtime_error(
          answered_garbage ? "the process on " + endpoint_text_ + " is not a ddprun rendezvous store"
                           : "cannot reach the rendezvous store at " + endpoint_text_ + " within " +
                                 fmt(connect_deadline_seconds) +
                                 " s (is the first ddprun running? --rdzv-conf join_timeout=SECONDS)");
    }
    ::usleep(200 * 1000);
  }
}

RdzvView RdzvClient::parse_view(const Message& reply) {
  RdzvView view;
  if (reply.empty()) return view;
  const std::string& kind = reply[0];
  if (kind == "wait") {
    view.kind = RdzvView::kWait;
    if (reply.size() > 1) view.text = reply[1];
  } else if (kind == "round" && reply.size() >= 10) {
    view.kind = RdzvView::kRound;
    view.round = to_int(reply[1]);
    view.node_rank = to_int(reply[2]);
    view.nnodes = to_int(reply[3]);
    view.world_size = to_int(reply[4]);
    view.base_rank = to_int(reply[5]);
    view.master_addr = reply[6];
    view.master_port = to_int(reply[7]);
    view.restart_count = to_int(reply[8]);
    view.text = reply[9];
  } else if (kind == "stop" && reply.size() >= 3) {
    view.kind = RdzvView::kStop;
    view.round = to_int(reply[1]);
    view.text = reply[2];
  } else if (kind == "done") {
    view.kind = RdzvView::kDone;
  } else if (kind == "fail") {
    view.kind = RdzvView::kFail;
    if (reply.size() > 1) view.text = reply[1];
  } else if (kind == "lost") {
    view.kind = RdzvView::kLost;
    if (reply.size() > 1) view.text = reply[1];
  }
  return view;
}

void RdzvClient::mark_supervisor_alive() {
  supervisor_alive_at_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

void RdzvClient::start_heartbeat() {
  mark_supervisor_alive();
  BlockSignalsForNewThreads block;
  thread_ = std::thread([this] { heartbeat_loop(); });
}

void RdzvClient::heartbeat_loop() {
  const double request_timeout = std::clamp(heartbeat_timeout_ / 3, 0.3, 2.0);
  while (true) {
    Message reply;
    const Clock::time_point supervisor_alive_at{Clock::duration(supervisor_alive_at_.load(std::memory_order_relaxed))};
    if (seconds_between(supervisor_alive_at, Clock::now()) > heartbeat_timeout_) {
      // Skipped, not failed: the store's silence is for a loop that cannot act on its answers.
    } else if (request({"POLL", agent_id_}, &reply, request_timeout)) {
      RdzvView fresh = parse_view(reply);
      std::lock_guard<std::mutex> lock(view_mutex_);
      last_answer_ = Clock::now();
      if (fresh.kind != view_.kind || fresh.round != view_.round || fresh.text != view_.text) {
        view_ = fresh;
        char byte = 1;
        ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
        (void)ignored;
      }
    } else {
      char byte = 1;  // the main loop re-checks how long the store has been silent
      ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
      (void)ignored;
    }
    std::unique_lock<std::mutex> lock(stop_mutex_);
    if (stop_cv_.wait_for(lock, std::chrono::duration<double>(monitor_interval_), [this] { return stopping_; })) return;
  }
}

RdzvView RdzvClient::view() {
  std::lock_guard<std::mutex> lock(view_mutex_);
  return view_;
}

double RdzvClient::seconds_since_answer() {
  std::lock_guard<std::mutex> lock(view_mutex_);
  return seconds_between(last_answer_, Clock::now());
}

bool RdzvClient::store_lost() { return seconds_since_answer() > heartbeat_timeout_; }

void RdzvClient::drain_wake() {
  char buffer[64];
  while (::read(wake_pipe_[0], buffer, sizeof buffer) > 0) {
  }
}

void RdzvClient::notify_failing(int round, int rank, const std::string& how) {
  Message reply;
  request({"FAILING", agent_id_, std::to_string(round), std::to_string(rank), how}, &reply, 2.0);
}

void RdzvClient::report(int round, const std::string& kind, const Message& failure) {
  Message message = {"REPORT", agent_id_, std::to_string(round), kind, std::to_string(pick_free_tcp_port())};
  message.insert(message.end(), failure.begin(), failure.end());
  Message reply;
  // The report ends this node's round; without it the store would wait for our heartbeat to
  // stop. Retried until the heartbeat timeout: a store that is gone by then is lost anyway.
  const Clock::time_point deadline = after(heartbeat_timeout_);
  while (!request(message, &reply, 2.0) && Clock::now() < deadline) {
    mark_supervisor_alive();  // retrying here is the supervisor at work
    ::usleep(100 * 1000);
  }
}

void RdzvClient::leave() {
  Message reply;
  request({"LEAVE", agent_id_}, &reply, 2.0);
}

std::string load_rdzv_secret(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error("cannot read the rendezvous secret file '" + path + "': " + std::strerror(errno));
  }
  struct stat info {};
  std::string secret;
  char buffer[4096];
  ssize_t n = 0;
  if (::fstat(fd, &info) == 0) {
    while (secret.size() <= 4096 && (n = ::read(fd, buffer, sizeof buffer)) > 0) secret.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  if ((info.st_mode & S_IFMT) != S_IFREG || n < 0) {
    throw std::runtime_error("the rendezvous secret file '" + path + "' is not a readable regular file");
  }
  if (info.st_mode & (S_IRWXG | S_IRWXO)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    throw std::runtime_error("the rendezvous secret file '" + path + "' is open to other users (mode " + mode +
                             "); run: chmod 600 " + path);
  }
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) secret.pop_back();
  if (secret.size() < 16 || secret.size() > 4096) {
    throw std::runtime_error("the rendezvous secret file '" + path + "' holds " + std::to_string(secret.size()) +
                             " bytes; it needs 16 to 4096, e.g. from: head -c 32 /dev/urandom | base64 > " + path);
  }
  return secret;
}

int pick_free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace ddprun
