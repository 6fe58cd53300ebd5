#pragma once

// The store that fault-tolerant training keeps its membership, votes and
// joiners in. It must outlive any one worker: ddprun hosts it outside the
// workers (a store keeper process) or it is an etcd cluster, which survives
// the loss of any one node.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <set>
#include <string>

namespace ddp::detail {

/// Opens the store named by `spec`, a client of it:
///  - "tcp://HOST:PORT": a c10d TCPStore that another process serves;
///  - "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]": an etcd cluster through its
///    v2 API (keys under PREFIX), failing over between the endpoints.
/// Every operation of the returned store times out after `timeout`. Throws
/// c10::Error naming the spec and what to fix when it cannot connect.
c10::intrusive_ptr<c10d::Store> open_ft_store(const std::string& spec, std::chrono::milliseconds timeout);

/// Every address ("ip:port", each endpoint's host resolved) that a client of
/// the store named by `spec` may connect to: a socket with such a peer is the
/// store's, never a process group's.
std::set<std::string> ft_store_addresses(const std::string& spec);

}  // namespace ddp::detail
