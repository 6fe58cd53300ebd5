// The rendezvous store's state machine, shared by its network side (rdzv_server.cpp) and its
// rules (rdzv_store.cpp). Rounds ("attempts") are formed from the agents that joined; a round
// runs until every member has reported (success, stopped, failed, left) or was lost, and then
// the store decides: done, failed, or the next round. Every member is used under `mutex`.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "rdzv.h"
#include "rdzv_wire.h"

namespace ddprun {

struct RdzvServer::State {
  using Clock = rdzv_wire::Clock;

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

  // "node R (host, addr)", as the messages name an agent.
  std::string describe(const Agent& agent) const;
  // The agents waiting for the next round, in the order they get node ranks.
  std::vector<Agent*> pending_agents();
  void finish(bool success, const std::string& message);
  void form(std::vector<Agent*> chosen, Clock::time_point now);
  // Forms the next round if enough agents wait (the first round also waits for the last call),
  // or fails the job when too few are left.
  void try_form(Clock::time_point now);
  // The job's failure summary: the earliest original error across every node's report.
  std::string root_cause() const;
  std::string failure_summary(const Agent& agent, const Message& failure) const;
  // Once every member of the round has reported or is gone: done, failed, or the next round.
  void decide(Clock::time_point now);
  void start_stopping(const std::string& reason);
  // An agent lost or left; a member of the running round stops that round.
  void depart(Agent& agent, const std::string& what);
  // Declares silent agents lost and moves the rounds on: on every pass of the poll loop, and
  // after a JOIN, REPORT or LEAVE.
  void tick(Clock::time_point now);

  // `peer` is the connection the request came on: JOIN and RESUME bind it to an agent, and every
  // other request must name the agent bound to it, so that no one can speak for another node.
  Message handle(const Message& request, Clock::time_point now, Peer* peer);
};

}  // namespace ddprun
