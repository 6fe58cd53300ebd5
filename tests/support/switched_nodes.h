// N "nodes" on one machine, each a network namespace with its own address, joined through a
// bridge in a namespace of its own (the switch), as bench/emulated_cluster.py builds them;
// optionally each link shaped to a rate in both directions (tc tbf on the node's end and on the
// switch's end, as bench/emulated_cluster.py does). For tests where a whole node must go: its
// processes killed and its link cut. Needs root and iproute2; build() says why it could not,
// so the test can skip with that reason. The namespaces go when the object does.
#pragma once

#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "support/subprocess.h"

namespace ddp::testing {

class SwitchedNodes {
 public:
  // Names from `prefix` and this process's pid; addresses subnet_prefix.1 .. .N on a /24.
  SwitchedNodes(int nodes, const std::string& prefix, const std::string& subnet_prefix, std::string rate = "")
      : rate_(std::move(rate)) {
    const std::string id = std::to_string(::getpid());
    switch_ = prefix + "sw_" + id;
    for (int i = 0; i < nodes; ++i) {
      ns.push_back(prefix + "n" + std::to_string(i) + "_" + id);
      addr.push_back(subnet_prefix + "." + std::to_string(i + 1));
    }
  }
  ~SwitchedNodes() { remove(); }
  SwitchedNodes(const SwitchedNodes&) = delete;
  SwitchedNodes& operator=(const SwitchedNodes&) = delete;

  // The interface every node has, for GLOO_SOCKET_IFNAME.
  static constexpr const char* kInterface = "ft0";

  std::string build() {
    built_ = true;
    std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", switch_},
        {"ip", "netns", "exec", switch_, "ip", "link", "add", "br0", "type", "bridge"},
        {"ip", "netns", "exec", switch_, "ip", "link", "set", "br0", "up"},
    };
    for (size_t i = 0; i < ns.size(); ++i) {
      const std::string node_end = "ftn" + std::to_string(i) + "_" + std::to_string(::getpid() % 100000);
      const std::string port = "ftp" + std::to_string(i) + "_" + std::to_string(::getpid() % 100000);
      steps.push_back({"ip", "netns", "add", ns[i]});
      steps.push_back({"ip", "link", "add", node_end, "type", "veth", "peer", "name", port});
      steps.push_back({"ip", "link", "set", node_end, "netns", ns[i]});
      steps.push_back({"ip", "link", "set", port, "netns", switch_});
      steps.push_back(in(i, {"ip", "link", "set", node_end, "name", kInterface}));
      steps.push_back(in(i, {"ip", "addr", "add", addr[i] + "/24", "dev", kInterface}));
      steps.push_back(in(i, {"ip", "link", "set", kInterface, "up"}));
      steps.push_back(in(i, {"ip", "link", "set", "lo", "up"}));
      steps.push_back({"ip", "netns", "exec", switch_, "ip", "link", "set", port, "master", "br0"});
      steps.push_back({"ip", "netns", "exec", switch_, "ip", "link", "set", port, "up"});
      if (!rate_.empty()) {
        // A full-duplex link: what a node receives is bounded too, not only what it sends (a
        // joiner healed by several senders at once must not get their sum).
        const std::vector<std::string> tbf = {"tbf", "rate", rate_, "burst", "256kb", "latency", "50ms"};
        std::vector<std::string> out = {"tc", "qdisc", "add", "dev", kInterface, "root"};
        out.insert(out.end(), tbf.begin(), tbf.end());
        steps.push_back(in(i, out));
        std::vector<std::string> into = {"ip", "netns", "exec", switch_, "tc", "qdisc", "add", "dev", port, "root"};
        into.insert(into.end(), tbf.begin(), tbf.end());
        steps.push_back(into);
      }
    }
    for (const auto& step : steps) {
      RunOptions options;
      options.timeout = std::chrono::seconds(20);
      auto r = run_process(step, options);
      if (r.exit_code != 0) {
        std::string command;
        for (const auto& word : step) command += word + " ";
        remove();
        return "cannot build the switched nodes (" + command + "): " + r.err;
      }
    }
    return "";
  }

  // argv run inside node i's namespace.
  std::vector<std::string> in(size_t i, const std::vector<std::string>& argv) const {
    std::vector<std::string> full = {"ip", "netns", "exec", ns[i]};
    full.insert(full.end(), argv.begin(), argv.end());
    return full;
  }

  // Node i's link goes down: nothing reaches it, nothing leaves it.
  void cut(size_t i) { set_link(i, "down"); }
  // And up again.
  void reconnect(size_t i) { set_link(i, "up"); }

  void remove() {
    if (!built_) return;
    RunOptions options;
    options.timeout = std::chrono::seconds(20);
    for (const auto& n : ns) run_process({"ip", "netns", "del", n}, options);
    run_process({"ip", "netns", "del", switch_}, options);
    built_ = false;
  }

  std::vector<std::string> ns, addr;

 private:
  void set_link(size_t i, const std::string& state) {
    RunOptions options;
    options.timeout = std::chrono::seconds(20);
    run_process(in(i, {"ip", "link", "set", kInterface, state}), options);
  }

  std::string rate_;
  std::string switch_;
  bool built_ = false;
};

}  // namespace ddp::testing
