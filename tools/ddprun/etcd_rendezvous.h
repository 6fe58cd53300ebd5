// ddprun's agent rendezvous through etcd (--rdzv-backend etcd-v2, torchrun's name for its etcd
// backend): the agents meet in an etcd cluster's v2 key space instead of a store one of them
// hosts, so no ddprun holds state the job needs, and the cluster survives the loss of any one
// member (etcd replicates every write to a majority). The client is ddp's own, torch-free
// (src/common/etcd_v2_client.h), failing over between the members listed in --rdzv-endpoint.
//
// Keys, under /ddprun/<run id>/:
//   count          agents that joined; each takes its node rank by compare-and-swap on it
//   nodes/<rank>   "<nproc> <address> <host>" of each agent
//   closed         "<nnodes> <world size> <master address> <master port> <base rank,...>": the
//                  round, written once by node 0 when MAX joined, or MIN joined and the last
//                  call passed; an agent whose rank is not below nnodes came too late (under
//                  --fault-tolerance it joins the running job: its workers heal from a live one)
//   failed         the first failure any node reported ("rank R on node N (host): how")
//   done/<rank>    each agent's end; node 0 removes the whole directory once every node's is in
// One round per job: restarts of the whole job are the c10d backend's; under --fault-tolerance
// the workers replace their lost members themselves.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "launcher.h"
#include "rdzv.h"

namespace ddp::detail {
class EtcdV2Client;
}

namespace ddprun {

class SignalPipe;

class EtcdRendezvous {
 public:
  explicit EtcdRendezvous(const LaunchOptions& options);
  ~EtcdRendezvous();
  EtcdRendezvous(const EtcdRendezvous&) = delete;
  EtcdRendezvous& operator=(const EtcdRendezvous&) = delete;

  // Joins and waits until the round forms. Returns a stop signal if ddprun was asked to stop
  // meanwhile (the round is then not joined), else 0 with *round set. Throws
  // std::runtime_error when the round cannot form (too few nodes in time, too late, etcd
  // unreachable).
  int join(SignalPipe& signals, RoundAssignment* round);

  // After join: polls the failure key every monitor interval in a thread of its own.
  void start_watching();
  // The first failure reported by another node; empty while there is none.
  std::string other_failure();
  // Records this node's failure for the others (the first one's text stays).
  void notify_failing(const std::string& text);
  // Records this node's end; node 0 removes the job's keys once every node ended.
  void report_done(const std::string& kind);

  // Under --fault-tolerance: this node came after the round formed (its ranks follow the
  // round's world size; its workers join the running replicas).
  bool late() const { return late_; }

  // "etcd://HOST:PORT,.../ddp-ft/<run id>": the workers' fault-tolerance store in the same cluster.
  std::string ft_store_spec() const;
  // The members as given, for messages.
  const std::string& endpoints() const { return endpoints_; }

 private:
  std::string key(const std::string& name) const { return prefix_ + "/" + name; }
  void watch_loop();

  const LaunchOptions& options_;
  std::string endpoints_;
  std::string prefix_;  // /ddprun/<run id>
  std::unique_ptr<ddp::detail::EtcdV2Client> client_;
  int node_rank_ = -1;
  int nnodes_ = 0;
  bool late_ = false;
  std::mutex mutex_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::string other_failure_;
  bool reported_failure_ = false;
  std::thread watcher_;
};

}  // namespace ddprun
