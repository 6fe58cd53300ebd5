// A real etcd cluster for tests: N members of /usr/bin/etcd (Debian's etcd-server 3.4) on free
// loopback ports with temporary data directories, serving the v2 API (--enable-v2), with short
// raft timings so that an election after a member's death takes well under a second. Members
// run in their own process groups and are killed (SIGKILL) and their directories removed when
// the cluster goes; kill(i) takes one down mid-test.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/etcd_v2_client.h"
#include "support/rdzv_agents.h"
#include "support/subprocess.h"

namespace ddp::testing {

inline constexpr const char* kEtcdProgram = "/usr/bin/etcd";

inline bool etcd_available() { return ::access(kEtcdProgram, X_OK) == 0 && ::access("/usr/bin/setpriv", X_OK) == 0; }

// A member must not outlive a test that crashed before its teardown: util-linux's setpriv gives
// it a parent-death signal before it becomes etcd.
inline const char* const kKeepTiedToTest[3] = {"/usr/bin/setpriv", "--pdeathsig", "KILL"};

class EtcdCluster {
 public:
  // Data on tmpfs where there is one: etcd fsyncs every write, which a disk shared with
  // compiles makes slow enough to trip elections.
  explicit EtcdCluster(int members = 3) : dir_(data_dir()) {
    std::string initial;
    for (int i = 0; i < members; ++i) {
      client_ports_.push_back(free_port());
      peer_ports_.push_back(free_port());
      initial += (i ? "," : "") + name(i) + "=http://127.0.0.1:" + std::to_string(peer_ports_.back());
    }
    for (int i = 0; i < members; ++i) {
      const std::string client = "http://127.0.0.1:" + std::to_string(client_ports_[i]);
      const std::string peer = "http://127.0.0.1:" + std::to_string(peer_ports_[i]);
      RunOptions options;
      options.timeout = std::chrono::minutes(10);
      processes_.push_back(start_background(
          {kKeepTiedToTest[0], kKeepTiedToTest[1], kKeepTiedToTest[2], kEtcdProgram, "--name", name(i), "--data-dir", dir_ + "/" + name(i), "--listen-client-urls", client,
           "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
           "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", "ddp-test",
           "--enable-v2=true", "--heartbeat-interval", "50", "--election-timeout", "500", "--logger", "zap", "--log-level", "error"},
          options));
      alive_.push_back(true);
    }
  }
  ~EtcdCluster() {
    for (size_t i = 0; i < processes_.size(); ++i) kill(static_cast<int>(i));
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  // Until a write through every member succeeds (a leader is elected and all have joined), at
  // most `timeout`. Returns what went wrong, or "" once ready.
  std::string wait_until_ready(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string last;
    for (size_t i = 0; i < processes_.size(); ++i) {
      while (true) {
        try {
          ddp::detail::EtcdV2Client client({endpoint(static_cast<int>(i))}, std::chrono::milliseconds(1000));
          if (client.set("/ddp-test-ready/" + name(static_cast<int>(i)), "1").ok()) break;
          last = "member " + name(static_cast<int>(i)) + " refused the write";
        } catch (const std::exception& error) {
          last = error.what();
        }
        if (std::chrono::steady_clock::now() >= deadline) return last + "\n" + logs();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    return "";
  }

  // The member that is the raft leader now (its v2 stats say StateLeader), or -1 if none says
  // so (or curl is missing).
  int leader() const {
    for (size_t i = 0; i < client_ports_.size(); ++i) {
      if (!alive_[i]) continue;
      const std::string command = "curl -s --max-time 1 http://" + endpoint(static_cast<int>(i)) + "/v2/stats/self";
      FILE* pipe = ::popen(command.c_str(), "r");
      if (pipe == nullptr) continue;
      std::string reply;
      char buffer[512];
      while (size_t got = std::fread(buffer, 1, sizeof buffer, pipe)) reply.append(buffer, got);
      ::pclose(pipe);
      if (reply.find("StateLeader") != std::string::npos) return static_cast<int>(i);
    }
    return -1;
  }

  // SIGKILL to member i (and its process group); it is reaped.
  void kill(int i) {
    if (!alive_[static_cast<size_t>(i)]) return;
    alive_[static_cast<size_t>(i)] = false;
    wait_background(processes_[static_cast<size_t>(i)], std::chrono::milliseconds(1));
  }

  std::string endpoint(int i) const { return "127.0.0.1:" + std::to_string(client_ports_[static_cast<size_t>(i)]); }
  std::vector<std::string> endpoints() const {
    std::vector<std::string> all;
    for (size_t i = 0; i < client_ports_.size(); ++i) all.push_back(endpoint(static_cast<int>(i)));
    return all;
  }
  // "h:p,h:p,h:p", as --rdzv-endpoint and etcd:// take them.
  std::string endpoint_list() const {
    std::string list;
    for (const std::string& e : endpoints()) list += (list.empty() ? "" : ",") + e;
    return list;
  }
  // The members' stderr so far, for assertion messages.
  std::string logs() const {
    std::string text;
    for (size_t i = 0; i < processes_.size(); ++i) {
      text += "--- etcd " + name(static_cast<int>(i)) + (alive_[i] ? "" : " (killed)") + ":\n" +
              read_text_file(processes_[i].err_path).substr(0, 4000);
    }
    return text;
  }

 private:
  static std::string name(int i) { return "m" + std::to_string(i); }
  static std::string data_dir() {
    char pattern[] = "/dev/shm/ddp_etcd_XXXXXX";
    if (::access("/dev/shm", W_OK) == 0 && ::mkdtemp(pattern) != nullptr) return pattern;
    return make_temp_dir("ddp_etcd");
  }

  std::string dir_;
  std::vector<int> client_ports_;
  std::vector<int> peer_ports_;
  std::vector<BackgroundProcess> processes_;
  std::vector<bool> alive_;
};

}  // namespace ddp::testing
