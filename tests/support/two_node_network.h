// Two "nodes" on one machine: network namespaces, each with its own address,
// joined by a veth pair, for tests of launchers across hosts (ddprun's
// static and c10d rendezvous, mpirun with a launch agent). Needs root and
// iproute2; build() says why it could not, so the test can skip with that
// reason. The namespaces go when the object does.
#pragma once

#include <support/launch.h>

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

namespace ddp::testing {

class TwoNodeNetwork {
 public:
  /// Names from `prefix` and this process's pid (so parallel test binaries
  /// do not collide); addresses `subnet_prefix`.1 and .2 on a /24 link that
  /// nothing outside these namespaces can reach.
  TwoNodeNetwork(const std::string& prefix, const std::string& subnet_prefix) {
    const std::string id = std::to_string(::getpid());
    ns = {prefix + "n0_" + id, prefix + "n1_" + id};
    veth = {prefix + "v0_" + id, prefix + "v1_" + id};
    addr = {subnet_prefix + ".1", subnet_prefix + ".2"};
    subnet = subnet_prefix + ".0/24";
  }
  ~TwoNodeNetwork() { remove(); }
  TwoNodeNetwork(const TwoNodeNetwork&) = delete;
  TwoNodeNetwork& operator=(const TwoNodeNetwork&) = delete;

  /// Creates both nodes and the link; an empty string on success, else why
  /// not (what is built so far is removed).
  std::string build() {
    built_ = true;
    std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", ns[0]},
        {"ip", "netns", "add", ns[1]},
        {"ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]},
        {"ip", "link", "set", veth[0], "netns", ns[0]},
        {"ip", "link", "set", veth[1], "netns", ns[1]},
    };
    for (int n = 0; n < 2; ++n) {
      steps.push_back({"ip", "netns", "exec", ns[n], "ip", "addr", "add", addr[n] + "/24", "dev", veth[n]});
      steps.push_back({"ip", "netns", "exec", ns[n], "ip", "link", "set", veth[n], "up"});
      steps.push_back({"ip", "netns", "exec", ns[n], "ip", "link", "set", "lo", "up"});
    }
    for (const auto& step : steps) {
      auto r = run_process(step, one_rank({}, std::chrono::seconds(20)));
      if (r.exit_code != 0) {
        remove();
        return "cannot build the two-node network (" + step[0] + " " + step[1] + " " + step[2] + "): " + r.err;
      }
    }
    return "";
  }

  void remove() {
    if (!built_) return;
    for (const auto& n : ns) run_process({"ip", "netns", "del", n}, one_rank({}, std::chrono::seconds(20)));
    built_ = false;
  }

  std::vector<std::string> ns, veth, addr;
  std::string subnet;  // for MPI's interface selection (btl_tcp_if_include)

 private:
  bool built_ = false;
};

/// A test on two such nodes: skipped, with the reason, without root or when the
/// namespaces cannot be built; they go after each test.
class TwoNodeTest : public ::testing::Test {
 protected:
  TwoNodeTest(const std::string& prefix, const std::string& subnet_prefix) : network_(prefix, subnet_prefix) {}
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "creating network namespaces needs root";
    const std::string why = network_.build();
    if (!why.empty()) GTEST_SKIP() << why;
  }
  void TearDown() override { network_.remove(); }
  TwoNodeNetwork network_;
};

}  // namespace ddp::testing
