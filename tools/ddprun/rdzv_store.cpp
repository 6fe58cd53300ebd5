#include "rdzv_store.h"

#include <algorithm>
#include <limits>

#include "hmac_sha256.h"
#include "posix_util.h"

namespace ddprun {

using namespace rdzv_wire;

std::string RdzvServer::State::describe(const Agent& agent) const {
  std::string where = agent.host + ", " + agent.addr;
  if (agent.node_rank >= 0) return "node " + std::to_string(agent.node_rank) + " (" + where + ")";
  return "a node that had not started yet (" + where + ")";
}

std::vector<RdzvServer::State::Agent*> RdzvServer::State::pending_agents() {
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

void RdzvServer::State::finish(bool success, const std::string& message) {
  phase = Phase::kFinished;
  done = success;
  final_message = message.compare(0, 10, "job failed") == 0 ? message : "job failed: " + message;
  for (auto& [id, agent] : agents) agent.member_of = -1;
}

void RdzvServer::State::form(std::vector<Agent*> chosen, Clock::time_point now) {
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

void RdzvServer::State::try_form(Clock::time_point now) {
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

std::string RdzvServer::State::root_cause() const {
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
  // Each node's ddprun prints these lines one by one: a field a node sent (a host name, a
  // worker's last line) must not add lines of its own.
  for (size_t i = 0; i < lines.size(); ++i) text += (i ? "\n" : "") + printable(lines[i]);
  return text;
}

std::string RdzvServer::State::failure_summary(const Agent& agent, const Message& failure) const {
  if (failure.size() < 11) return describe(agent) + " failed";
  return "rank " + failure[0] + " on " + describe(agent) + " failed: " + failure[3];
}

void RdzvServer::State::decide(Clock::time_point now) {
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

void RdzvServer::State::start_stopping(const std::string& reason) {
  if (stopping) return;
  stopping = true;
  stop_reason = reason;
}

void RdzvServer::State::depart(Agent& agent, const std::string& what) {
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

void RdzvServer::State::tick(Clock::time_point now) {
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

Message RdzvServer::State::handle(const Message& request, Clock::time_point now, Peer* peer) {
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
    // Every node prints the others' names; one with a newline could forge their lines.
    if (has_control_character(request[3]) || has_control_character(request[4])) {
      return {"refused", "its host name or address holds a control character"};
    }
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

}  // namespace ddprun
