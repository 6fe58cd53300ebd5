#include "etcd_rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/etcd_v2_client.h"
#include "posix_util.h"
#include "rdzv.h"
#include "signal_pipe.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;
using ddp::detail::EtcdResponse;

// How long one wait on etcd's change index lasts before ddprun looks at its signals again.
constexpr std::chrono::milliseconds kWaitSlice{200};
// One request, failovers between the members included.
constexpr std::chrono::milliseconds kRequestTimeout{10000};

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "unknown-host";
  return name;
}

// The address this host reaches `endpoint` (HOST:PORT) from: a UDP socket's connect() picks
// the route without sending anything.
std::string address_towards(const std::string& endpoint) {
  std::string host_port = endpoint.substr(endpoint.find("://") == std::string::npos ? 0 : endpoint.find("://") + 3);
  const size_t colon = host_port.rfind(':');
  const std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  std::string address = "127.0.0.1";
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) return address;
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in mine{};
    socklen_t length = sizeof mine;
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &length) == 0 &&
        ::inet_ntop(AF_INET, &mine.sin_addr, text, sizeof text) != nullptr) {
      address = text;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return address;
}

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream stream(text);
  for (std::string word; stream >> word;) words.push_back(word);
  return words;
}

[[noreturn]] void fail(const std::string& why) { throw std::runtime_error("etcd-v2 rendezvous: " + why); }

void expect_ok(const EtcdResponse& response, const std::string& what) {
  if (response.error_code != 0) {
    fail(what + " failed: etcd error " + std::to_string(response.error_code) + ": " + response.error_message);
  }
}

}  // namespace

EtcdRendezvous::EtcdRendezvous(const LaunchOptions& options)
    : options_(options), endpoints_(options.rdzv_endpoint) {
  std::string id = options.run_id;
  std::replace(id.begin(), id.end(), '/', '_');
  prefix_ = "/ddprun/" + id;
  try {
    client_ = std::make_unique<ddp::detail::EtcdV2Client>(ddp::detail::EtcdV2Client::parse_endpoints(endpoints_),
                                                          kRequestTimeout);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string("--rdzv-endpoint: ") + error.what());
  }
}

EtcdRendezvous::~EtcdRendezvous() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

std::string EtcdRendezvous::ft_store_spec() const {
  return "etcd://" + endpoints_ + "/ddp-ft/" + prefix_.substr(std::string("/ddprun/").size());
}

int EtcdRendezvous::join(SignalPipe& signals, RoundAssignment* round) {
  const Clock::time_point join_deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.join_timeout_seconds));
  auto stop_signal = [&]() {
    for (int signal_number : signals.drain()) {
      if (signal_number != SIGCHLD && signal_number != SIGUSR1) return signal_number;
    }
    return 0;
  };
  // Waits a slice for any change below the job's keys (or just sleeps it off).
  auto wait_a_little = [&](std::uint64_t index) {
    client_->wait(prefix_, index + 1, kWaitSlice, /*recursive=*/true);
  };

  try {
    // A round of this run id formed earlier and was not cleaned up: joining it would be wrong.
    const EtcdResponse closed = client_->get(key("closed"));
    // Under --fault-tolerance a node may come (back) to a running job: its workers join the
    // replicas and heal from a live one. Otherwise the round is someone else's.
    if (closed.ok() && !options_.fault_tolerance) {
      fail("run id '" + options_.run_id + "' already has a formed round in etcd (" + prefix_ +
           "); give a fresh --rdzv-id, or remove the old one: ETCDCTL_API=2 etcdctl --endpoints " + endpoints_ +
           " rm -r " + prefix_);
    }
    // A node rank: the count of agents before us, taken by compare-and-swap.
    while (node_rank_ < 0) {
      const EtcdResponse count = client_->get(key("count"));
      if (count.error_code == ddp::detail::kEtcdKeyNotFound) {
        const EtcdResponse created = client_->create(key("count"), "1");
        if (created.error_code == ddp::detail::kEtcdNodeExist) continue;
        expect_ok(created, "taking a node rank");
        node_rank_ = 0;
      } else {
        expect_ok(count, "reading the agents' count");
        const int before = std::stoi(count.node.value);
        const EtcdResponse swapped =
            client_->compare_and_swap(key("count"), std::to_string(before + 1), count.node.modified_index);
        if (swapped.error_code == ddp::detail::kEtcdTestFailed) continue;
        expect_ok(swapped, "taking a node rank");
        node_rank_ = before;
      }
    }
    const std::string address = options_.local_addr.empty()
                                    ? address_towards(ddp::detail::EtcdV2Client::parse_endpoints(endpoints_)[0])
                                    : options_.local_addr;
    expect_ok(client_->set(key("nodes/" + std::to_string(node_rank_)),
                           std::to_string(options_.nproc_per_node) + " " + address + " " + host_name()),
              "publishing this node");

    if (node_rank_ == 0) {
      // Node 0 closes the round: MAX nodes, or MIN and the last call over.
      Clock::time_point min_reached{};
      int nnodes = 0;
      while (nnodes == 0) {
        if (const int s = stop_signal()) return s;
        const EtcdResponse count = client_->get(key("count"));
        expect_ok(count, "reading the agents' count");
        const int joined = std::stoi(count.node.value);
        if (joined >= options_.nnodes) {
          nnodes = options_.nnodes;
          break;
        }
        if (joined >= options_.min_nodes) {
          if (min_reached == Clock::time_point{}) min_reached = Clock::now();
          if (Clock::now() - min_reached >= std::chrono::duration<double>(options_.last_call_timeout_seconds)) {
            nnodes = joined;
            break;
          }
        } else if (Clock::now() >= join_deadline) {
          fail("only " + std::to_string(joined) + " of at least " + std::to_string(options_.min_nodes) +
               " nodes joined within join_timeout (" + format_seconds(options_.join_timeout_seconds) + " s)");
        }
        wait_a_little(count.etcd_index);
      }
      // Every member's place: each published itself right after taking its rank.
      std::vector<int> nprocs;
      for (int rank = 0; rank < nnodes; ++rank) {
        while (true) {
          const EtcdResponse node = client_->get(key("nodes/" + std::to_string(rank)));
          if (node.ok()) {
            nprocs.push_back(std::stoi(words_of(node.node.value).at(0)));
            break;
          }
          if (const int s = stop_signal()) return s;
          if (Clock::now() >= join_deadline) fail("node " + std::to_string(rank) + " took a rank but never said who it is");
          wait_a_little(node.etcd_index);
        }
      }
      std::string bases;
      int world = 0;
      for (int n : nprocs) {
        bases += (bases.empty() ? "" : ",") + std::to_string(world);
        world += n;
      }
      const EtcdResponse created =
          client_->create(key("closed"), std::to_string(nnodes) + " " + std::to_string(world) + " " + address + " " +
                                             std::to_string(pick_free_tcp_port()) + " " + bases);
      expect_ok(created, "closing the round");
    }

    // Everyone: the round as node 0 closed it.
    const Clock::time_point closed_deadline =
        join_deadline + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(options_.last_call_timeout_seconds + 10));
    while (true) {
      const EtcdResponse formed = client_->get(key("closed"));
      if (formed.ok()) {
        const std::vector<std::string> words = words_of(formed.node.value);
        if (words.size() < 5) fail("the round's key holds '" + formed.node.value + "', not a round");
        nnodes_ = std::stoi(words[0]);
        if (node_rank_ >= nnodes_ && options_.fault_tolerance) {
          // A late node: ranks past the first round's, which fault-tolerant workers do not go
          // by (their replica ids say who they are); the master is the first round's.
          round->node_rank = node_rank_;
          round->nnodes = nnodes_;
          round->world_size = std::stoi(words[1]);
          round->master_addr = words[2];
          round->master_port = std::stoi(words[3]);
          round->base_rank = round->world_size + (node_rank_ - nnodes_) * options_.nproc_per_node;
          late_ = true;
          return 0;
        }
        if (node_rank_ >= nnodes_) {
          fail("the round formed with " + words[0] + " node(s) before this node (the " + std::to_string(node_rank_ + 1) +
               "th to join) got in; with --rdzv-backend etcd-v2 a job forms once");
        }
        std::vector<std::string> bases;
        std::stringstream list(words[4]);
        for (std::string base; std::getline(list, base, ',');) bases.push_back(base);
        round->node_rank = node_rank_;
        round->nnodes = nnodes_;
        round->world_size = std::stoi(words[1]);
        round->master_addr = words[2];
        round->master_port = std::stoi(words[3]);
        round->base_rank = std::stoi(bases.at(static_cast<size_t>(node_rank_)));
        return 0;
      }
      if (const int s = stop_signal()) return s;
      if (Clock::now() >= closed_deadline) fail("node 0 never closed the round (is its ddprun still running?)");
      wait_a_little(formed.etcd_index);
    }
  } catch (const ddp::detail::EtcdUnavailable& error) {
    fail(error.what());
  } catch (const std::invalid_argument&) {
    fail("a key under " + prefix_ + " holds something other than ddprun wrote; is another job using run id '" +
         options_.run_id + "'?");
  } catch (const std::out_of_range&) {
    fail("a key under " + prefix_ + " holds something other than ddprun wrote; is another job using run id '" +
         options_.run_id + "'?");
  }
}

void EtcdRendezvous::start_watching() { watcher_ = std::thread([this] { watch_loop(); }); }

void EtcdRendezvous::watch_loop() {
  const auto interval = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::duration<double>(options_.monitor_interval_seconds));
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (stop_cv_.wait_for(lock, interval, [this] { return stopping_ || !other_failure_.empty(); })) return;
    }
    try {
      const EtcdResponse failed = client_->get(key("failed"));
      if (failed.ok()) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!reported_failure_) other_failure_ = failed.node.value;
      }
    } catch (const std::exception&) {
      // etcd unreachable for a whole request: the next pass tries again; the workers go on.
    }
  }
}

std::string EtcdRendezvous::other_failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return other_failure_;
}

void EtcdRendezvous::notify_failing(const std::string& text) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!other_failure_.empty()) return;  // a consequence of another node's failure
    reported_failure_ = true;
  }
  try {
    client_->create(key("failed"), text);
  } catch (const std::exception& error) {
    say("could not tell the other nodes through etcd that this node failed: " + std::string(error.what()));
  }
}

void EtcdRendezvous::report_done(const std::string& kind) {
  try {
    client_->set(key("done/" + std::to_string(node_rank_)), kind);
    if (node_rank_ != 0) return;
    // Node 0 tidies up once every node ended (waiting a little for the others' reports).
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(3);
    while (Clock::now() < deadline) {
      const EtcdResponse done = client_->get(key("done"));
      if (done.ok() && static_cast<int>(done.children.size()) >= nnodes_) {
        client_->remove(prefix_, /*recursive=*/true);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // The keys stay; the next job with this run id is told how to remove them.
  }
}

}  // namespace ddprun
