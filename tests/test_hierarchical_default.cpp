// Issue 37, defaults that fit the link: DistributedDataParallel with no comm
// hook reduces hierarchically (within each host, then between one leader per
// host) when its Gloo group spans hosts and some host runs several ranks.
//  * the choice itself, a pure function of every rank's vote (no processes);
//  * 4 ranks as 2 named hosts of 2 (DDP_SHM_HOST_ID, no root needed): the
//    default takes the hierarchical path, bit for bit the explicit
//    hierarchical_allreduce_hook over DeviceMesh::from_launcher, within float
//    rounding the flat all-reduce and one process on the whole batch; rank 0
//    says so in one line; so do hosts of 3 and 1 ranks, and interleaved ones; DDP_HIERARCHICAL=0 (on every rank or on some) and
//    hierarchical_allreduce(false) give the flat all-reduce bit for bit; one
//    host is unchanged and prints nothing; insisting where the layout cannot
//    take it, or a bad DDP_HIERARCHICAL, fails on every rank alike;
//  * 2 network namespaces of 2 ranks each under ddprun (root; skipped
//    otherwise): the same against DDP_HIERARCHICAL=0 and one process.

#include <support/launch.h>
#include <support/ranks.h>
#include <support/two_node_network.h>

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

#include "engine/hierarchical_choice.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace ddp::testing;
using ddp::detail::HierarchicalVote;
using ddp::detail::HierarchicalWish;

namespace {

const std::string kHierarchicalLine = "ddp: all-reduce hierarchical: shm within each host, gloo between 2 hosts";

// ---------------------------------------------------------------- the choice

std::vector<HierarchicalVote> layout(const std::vector<int64_t>& hosts,
                                     HierarchicalWish wish = HierarchicalWish::kAuto) {
  std::vector<HierarchicalVote> votes;
  for (int64_t host : hosts) votes.push_back({host, wish, true});
  return votes;
}

TEST(HierarchicalChoice, TwoHostsOfTwoRanksTakeItAndNumberTheHostsInRankOrder) {
  auto choice = ddp::detail::choose_hierarchical_allreduce(layout({77, 77, 5, 5}));
  EXPECT_TRUE(choice.hierarchical);
  EXPECT_TRUE(choice.layout_fits);
  EXPECT_EQ(choice.hosts, 2);
  EXPECT_EQ(choice.host_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_TRUE(choice.error.empty());
}

TEST(HierarchicalChoice, UnevenAndInterleavedHostsTakeItToo) {
  // The hook groups ranks by host, not by a 2-D mesh.
  auto choice = ddp::detail::choose_hierarchical_allreduce(layout({1, 2, 1, 1}));
  EXPECT_TRUE(choice.hierarchical);
  EXPECT_EQ(choice.host_of_rank, (std::vector<int>{0, 1, 0, 0}));
}

TEST(HierarchicalChoice, OneHostOrOneRankPerHostStaysFlatAndSilent) {
  for (const auto& hosts : std::vector<std::vector<int64_t>>{{1, 1, 1, 1}, {1, 2, 3, 4}, {9}}) {
    auto choice = ddp::detail::choose_hierarchical_allreduce(layout(hosts));
    EXPECT_FALSE(choice.hierarchical);
    EXPECT_FALSE(choice.layout_fits);
    EXPECT_TRUE(choice.why_flat.empty());
    EXPECT_TRUE(choice.error.empty());
  }
}

TEST(HierarchicalChoice, OneRankSayingNoMakesEveryRankFlatAndTheLineSaysWho) {
  auto votes = layout({1, 1, 2, 2});
  votes[2].wish = votes[3].wish = HierarchicalWish::kOffByEnv;
  auto choice = ddp::detail::choose_hierarchical_allreduce(votes);
  EXPECT_FALSE(choice.hierarchical);
  EXPECT_TRUE(choice.layout_fits);
  EXPECT_EQ(choice.why_flat, "DDP_HIERARCHICAL=0 on ranks 2, 3");
  EXPECT_EQ(ddp::detail::choose_hierarchical_allreduce(layout({1, 1, 2, 2}, HierarchicalWish::kOffByEnv)).why_flat,
            "DDP_HIERARCHICAL=0");
  EXPECT_EQ(ddp::detail::choose_hierarchical_allreduce(layout({1, 1, 2, 2}, HierarchicalWish::kOffByOption)).why_flat,
            "DDPOptions::hierarchical_allreduce(false)");
  auto gpu = layout({1, 1, 2, 2});
  gpu[0].cpu = false;
  EXPECT_EQ(ddp::detail::choose_hierarchical_allreduce(gpu).why_flat, "parameters not on the CPU on rank 0");
}

TEST(HierarchicalChoice, InsistingWhereItCannotOrAgainstARefusalIsAnErrorForEveryRank) {
  auto one_host = ddp::detail::choose_hierarchical_allreduce(layout({1, 1}, HierarchicalWish::kOnByOption));
  EXPECT_FALSE(one_host.hierarchical);
  EXPECT_NE(one_host.error.find("needs ranks on more than one host and more than one rank on some host, but this "
                                "group has 2 rank(s) on 1 host"),
            std::string::npos)
      << one_host.error;
  auto votes = layout({1, 1, 2, 2}, HierarchicalWish::kOnByOption);
  votes[3].wish = HierarchicalWish::kOffByEnv;
  EXPECT_NE(ddp::detail::choose_hierarchical_allreduce(votes).error.find("but rank 3 refuse it"), std::string::npos);
  auto forced = ddp::detail::choose_hierarchical_allreduce(layout({1, 1, 2, 2}, HierarchicalWish::kOnByOption));
  EXPECT_TRUE(forced.hierarchical);
  auto bad = layout({1, 1, 2, 2});
  bad[1].wish = HierarchicalWish::kInvalid;
  EXPECT_EQ(ddp::detail::choose_hierarchical_allreduce(bad).error,
            "ddp: DDP_HIERARCHICAL on rank 1 is not 0, 1 or auto; unset it (ddp chooses) or set 0 (the flat "
            "all-reduce), alike on every rank");
}

TEST(HierarchicalChoice, TheOptionWinsOverTheEnvironment) {
  using ddp::detail::hierarchical_wish;
  EXPECT_EQ(hierarchical_wish(std::nullopt, nullptr), HierarchicalWish::kAuto);
  EXPECT_EQ(hierarchical_wish(std::nullopt, ""), HierarchicalWish::kAuto);
  EXPECT_EQ(hierarchical_wish(std::nullopt, "auto"), HierarchicalWish::kAuto);
  EXPECT_EQ(hierarchical_wish(std::nullopt, "1"), HierarchicalWish::kAuto);
  EXPECT_EQ(hierarchical_wish(std::nullopt, "0"), HierarchicalWish::kOffByEnv);
  EXPECT_EQ(hierarchical_wish(std::nullopt, "no"), HierarchicalWish::kInvalid);
  EXPECT_EQ(hierarchical_wish(true, "0"), HierarchicalWish::kOnByOption);
  EXPECT_EQ(hierarchical_wish(false, nullptr), HierarchicalWish::kOffByOption);
}

// ------------------------------------------------ 2 named hosts x 2 ranks

// This rank's host as ddp sees it, and the launcher's view of the node, as
// ddprun would set them for 2 nodes of 2 ranks.
void be_on_two_hosts() {
  const int rank = std::stoi(std::getenv("RANK"));
  ::setenv("DDP_SHM_HOST_ID", rank < 2 ? "node-a" : "node-b", 1);
  ::setenv("LOCAL_RANK", std::to_string(rank % 2).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  ::setenv("GROUP_RANK", std::to_string(rank / 2).c_str(), 1);
}

torch::nn::Sequential make_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(6, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32),
                               torch::nn::Tanh(), torch::nn::Linear(32, 2));
}

// Step s's global batch of 16 rows: the same on every rank and world size.
std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {at::randn({16, 6}, generator), at::randn({16, 2}, generator)};
}

at::Tensor flat_weights(const torch::nn::Sequential& net) {
  std::vector<at::Tensor> parts;
  for (const auto& p : net->parameters()) parts.push_back(p.detach().reshape(-1));
  return at::cat(parts);
}

struct Variant {
  ddp::DDPOptions options;
  bool in_backward = false;  // step_in_backward
};

constexpr int kSteps = 5;

// Trains 5 steps of Adam on this rank's rows (rank, rank + world, ...) of
// each global batch. Small buckets, so that several go through the hook.
at::Tensor train(const Group& group, Variant variant) {
  auto net = make_net();
  const bool carry_loss = variant.options.carry_loss();
  ddp::DistributedDataParallel<torch::nn::Sequential> model(
      net, group, variant.options.bucket_cap_mb(0.001).first_bucket_cap_mb(0.001));
  EXPECT_GE(model.bucket_assignment().size(), 2u);
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
  if (variant.in_backward) model.step_in_backward(optimizer);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    at::Tensor rows = at::arange(group->rank(), x.size(0), group->size());
    optimizer.zero_grad();
    at::Tensor loss = torch::nn::functional::mse_loss(model.forward(x.index_select(0, rows)), y.index_select(0, rows));
    if (carry_loss) model.note_loss(loss);
    loss.backward();
    if (carry_loss) {
      EXPECT_TRUE(model.reduced_loss().valid);
      EXPECT_TRUE(model.reduced_loss().nonfinite_ranks.empty());
    }
    if (!variant.in_backward) optimizer.step();
  }
  return flat_weights(net);
}

// One process, the whole global batch: what the ranks together compute.
at::Tensor train_alone() {
  auto net = make_net();
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    optimizer.zero_grad();
    torch::nn::functional::mse_loss(net->forward(x), y).backward();
    optimizer.step();
  }
  return flat_weights(net);
}

void expect_close(const at::Tensor& a, const at::Tensor& b, const char* what) {
  EXPECT_TRUE(at::allclose(a, b, /*rtol=*/1e-5, /*atol=*/1e-6))
      << what << ": max |a - b| = " << (a - b).abs().max().item<double>();
}

TEST(HierarchicalDefaultRanks, TwoHostsTakeItByDefaultBitForBitTheExplicitHookAndMatchFlatAndOneProcess) {
  auto ranks = run_on_ranks(4, [](const Group&) {
    be_on_two_hosts();
    auto world = ddp::init_process_group();
    ASSERT_EQ(world->backend(), ddp::BackendKind::kGloo);
    const at::Tensor by_default = train(world, {});
    auto mesh = ddp::DeviceMesh::from_launcher(world);
    const at::Tensor explicit_hook =
        train(world, {ddp::DDPOptions().comm_hook(ddp::hierarchical_allreduce_hook(mesh))});
    const at::Tensor flat = train(world, {ddp::DDPOptions().hierarchical_allreduce(false)});
    // carry_loss rides on it, step_in_backward continues it, buckets as .grad.
    const at::Tensor carrying = train(world, {ddp::DDPOptions().carry_loss(true).gradient_as_bucket_view(true)});
    const at::Tensor stepping = train(world, {ddp::DDPOptions(), true});
    const at::Tensor insisted = train(world, {ddp::DDPOptions().hierarchical_allreduce(true)});
    EXPECT_TRUE(at::equal(by_default, explicit_hook)) << (by_default - explicit_hook).abs().max().item<double>();
    EXPECT_TRUE(at::equal(by_default, insisted));
    expect_close(by_default, flat, "default against flat");
    expect_close(by_default, carrying, "default against carry_loss + gradient_as_bucket_view");
    expect_close(by_default, stepping, "default against step_in_backward");
    expect_close(by_default, train_alone(), "default against one process on the whole batch");
    world->shutdown();
  }, RanksOptions().no_group());
  expect_all_succeeded(ranks);
  // Default, carrying, stepping and insisted: one line each, on rank 0 only.
  EXPECT_EQ(count_of(ranks[0].err, kHierarchicalLine + " (4 ranks; DDP_HIERARCHICAL=0 for flat)\n"), 4)
      << describe_ranks(ranks);
  const std::string flat_line =
      "ddp: all-reduce flat: gloo over 4 ranks on 2 hosts (DDPOptions::hierarchical_allreduce(false))\n";
  EXPECT_EQ(count_of(ranks[0].err, flat_line), 1)
      << describe_ranks(ranks);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(ranks[r].err.find("ddp: all-reduce"), std::string::npos) << ranks[r].err;
}

// Hosts that hold different numbers of ranks, or ranks that are not
// consecutive per host: no 2-D mesh fits, but the ranks are grouped by host.
void expect_hierarchical_on(const char* (*host_of)(int rank)) {
  RanksOptions options;
  options.no_group();
  auto ranks = run_on_ranks(4, [host_of](const Group&) {
    ::setenv("DDP_SHM_HOST_ID", host_of(std::stoi(std::getenv("RANK"))), 1);
    auto world = ddp::init_process_group();
    const at::Tensor by_default = train(world, {});
    const at::Tensor flat = train(world, {ddp::DDPOptions().hierarchical_allreduce(false)});
    expect_close(by_default, flat, "default against flat");
    expect_close(by_default, train_alone(), "default against one process on the whole batch");
    world->shutdown();
  }, options);
  expect_all_succeeded(ranks);
  EXPECT_EQ(count_of(ranks[0].err, kHierarchicalLine + " (4 ranks; DDP_HIERARCHICAL=0 for flat)\n"), 1)
      << describe_ranks(ranks);
}

TEST(HierarchicalDefaultRanks, ThreeRanksOnOneHostAndOneOnAnotherTakeIt) {
  expect_hierarchical_on([](int rank) { return rank < 3 ? "node-a" : "node-b"; });
}

TEST(HierarchicalDefaultRanks, HostsWhoseRanksInterleaveTakeIt) {
  expect_hierarchical_on([](int rank) { return rank % 2 == 0 ? "node-a" : "node-b"; });
}

TEST(HierarchicalDefaultRanks, DdpHierarchicalZeroGivesTheFlatAllReduceBitForBit) {
  RanksOptions options;
  options.no_group().env = {{"DDP_HIERARCHICAL", "0"}};
  auto ranks = run_on_ranks(4, [](const Group&) {
    be_on_two_hosts();
    auto world = ddp::init_process_group();
    const at::Tensor by_default = train(world, {});
    const at::Tensor flat = train(world, {ddp::DDPOptions().hierarchical_allreduce(false)});
    EXPECT_TRUE(at::equal(by_default, flat)) << (by_default - flat).abs().max().item<double>();
    world->shutdown();
  }, options);
  expect_all_succeeded(ranks);
  EXPECT_NE(ranks[0].err.find("ddp: all-reduce flat: gloo over 4 ranks on 2 hosts (DDP_HIERARCHICAL=0)\n"),
            std::string::npos)
      << describe_ranks(ranks);
  EXPECT_EQ(ranks[0].err.find("ddp: all-reduce hierarchical"), std::string::npos) << ranks[0].err;
}

// DDP_HIERARCHICAL=0 on one node only: every rank still takes one path, the
// flat one, instead of half the job waiting in collectives the other half
// never issues.
TEST(HierarchicalDefaultRanks, DdpHierarchicalZeroOnOneHostOnlyMakesEveryRankFlat) {
  auto ranks = run_on_ranks(4, [](const Group&) {
    be_on_two_hosts();
    if (std::stoi(std::getenv("RANK")) >= 2) ::setenv("DDP_HIERARCHICAL", "0", 1);
    auto world = ddp::init_process_group();
    const at::Tensor by_default = train(world, {});
    ::unsetenv("DDP_HIERARCHICAL");
    const at::Tensor flat = train(world, {ddp::DDPOptions().hierarchical_allreduce(false)});
    EXPECT_TRUE(at::equal(by_default, flat)) << (by_default - flat).abs().max().item<double>();
    world->shutdown();
  }, RanksOptions().no_group());
  expect_all_succeeded(ranks);
  EXPECT_NE(ranks[0].err.find("ddp: all-reduce flat: gloo over 4 ranks on 2 hosts (DDP_HIERARCHICAL=0 on ranks 2, 3)"),
            std::string::npos)
      << describe_ranks(ranks);
}

// One host: shared memory for DDP's group, as before, and no line; over Gloo
// (DDP_SHM=0) the ranks vote and find one host: flat, and no line either.
void expect_one_host_unchanged(const std::string& shm) {
  RanksOptions options;
  options.env = {{"DDP_SHM", shm}};
  auto ranks = run_on_ranks(4, [](const Group& group) {
    const at::Tensor by_default = train(group, {});
    const at::Tensor flat = train(group, {ddp::DDPOptions().hierarchical_allreduce(false)});
    EXPECT_TRUE(at::equal(by_default, flat)) << (by_default - flat).abs().max().item<double>();
  }, options);
  expect_all_succeeded(ranks);
  const std::string transport = shm == "1" ? "shm" : "gloo";
  EXPECT_NE(ranks[0].err.find("ddp: transport " + transport + " (4 ranks on one host)"), std::string::npos)
      << describe_ranks(ranks);
  EXPECT_EQ(ranks[0].err.find("ddp: all-reduce"), std::string::npos) << ranks[0].err;
}

TEST(HierarchicalDefaultRanks, OneHostOverSharedMemoryIsUnchangedAndSilent) { expect_one_host_unchanged("1"); }

TEST(HierarchicalDefaultRanks, OneHostOverGlooIsUnchangedAndSilent) { expect_one_host_unchanged("0"); }

void expect_insisting_fails(const std::string& shm, const std::string& why) {
  RanksOptions options;
  options.env = {{"DDP_SHM", shm}};
  auto ranks = run_on_ranks(2, [](const Group& group) {
    train(group, {ddp::DDPOptions().hierarchical_allreduce(true)});
  }, options);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 1) << describe_ranks(ranks);
    EXPECT_NE(r.err.find("ddp: DDPOptions::hierarchical_allreduce(true)"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(why), std::string::npos) << r.err;
  }
}

TEST(HierarchicalDefaultRanks, InsistingOnOneHostOverSharedMemoryFailsOnEveryRank) {
  expect_insisting_fails("1", "reduces over a Gloo group spanning hosts, but DDP's group is shm (2 ranks)");
}

TEST(HierarchicalDefaultRanks, InsistingOnOneHostOverGlooFailsOnEveryRank) {
  expect_insisting_fails("0", "but this group has 2 rank(s) on 1 host");
}

TEST(HierarchicalDefaultRanks, ABadDdpHierarchicalOnOneRankFailsOnEveryRankNamingIt) {
  RanksOptions options;
  options.env = {{"DDP_SHM", "0"}};
  auto ranks = run_on_ranks(2, [](const Group& group) {
    if (group->rank() == 1) ::setenv("DDP_HIERARCHICAL", "yes", 1);
    train(group, {});
  }, options);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 1) << describe_ranks(ranks);
    EXPECT_NE(r.err.find("ddp: DDP_HIERARCHICAL on rank 1 is not 0, 1 or auto"), std::string::npos) << r.err;
  }
}

// ------------------------------------- 2 network namespaces x 2 ranks (root)

class HierarchicalTwoNodes : public TwoNodeTest {
 protected:
  HierarchicalTwoNodes() : TwoNodeTest("ddph", "10.213.81") {}

  // ddp_worker's DDP training (support/fsdp_trainers.h: 6 Adam steps, rank r
  // takes rows r, r + 4, ... of each 12-row global batch, DDP with default
  // options) on 2 nodes of 2 ranks; rank 0 writes the weights to `out`.
  std::vector<ProcessResult> train_on_two_nodes(const std::string& port, const std::string& out,
                                                std::vector<std::pair<std::string, std::string>> env) {
    env.push_back({"DDP_TIMEOUT_SECONDS", "60"});
    std::vector<BackgroundProcess> nodes;
    for (int n = 0; n < 2; ++n) {
      nodes.push_back(start_background({"ip", "netns", "exec", network_.ns[n], bin_path("ddprun"), "--nnodes", "2",
                                        "--node-rank", std::to_string(n), "--nproc-per-node", "2", "--master-addr",
                                        network_.addr[0], "--master-port", port, bin_path("ddp_worker"), "train",
                                        "--strategy", "ddp", "--out", out},
                                       one_rank(env)));
    }
    std::vector<ProcessResult> results;
    for (auto& node : nodes) results.push_back(wait_background(node, std::chrono::seconds(120)));
    return results;
  }

};

TEST_F(HierarchicalTwoNodes, FourRanksTakeItByDefaultAndMatchTheFlatAllReduceAndOneProcess) {
  const std::string dir = make_temp_dir("hier_two_nodes");
  auto hierarchical = train_on_two_nodes("29581", dir + "/hierarchical.pt", {});
  for (int n = 0; n < 2; ++n) ASSERT_EQ(hierarchical[n].exit_code, 0) << hierarchical[n].describe();
  EXPECT_NE(hierarchical[0].err.find("ddp: transport gloo (4 ranks on 2 hosts)"), std::string::npos)
      << hierarchical[0].err;
  EXPECT_EQ(count_of(hierarchical[0].err, kHierarchicalLine), 1) << hierarchical[0].err;
  EXPECT_EQ(hierarchical[1].err.find("ddp: all-reduce"), std::string::npos) << hierarchical[1].err;

  auto flat = train_on_two_nodes("29582", dir + "/flat.pt", {{"DDP_HIERARCHICAL", "0"}});
  for (int n = 0; n < 2; ++n) ASSERT_EQ(flat[n].exit_code, 0) << flat[n].describe();
  EXPECT_NE(flat[0].err.find("ddp: all-reduce flat: gloo over 4 ranks on 2 hosts (DDP_HIERARCHICAL=0)"),
            std::string::npos)
      << flat[0].err;
  EXPECT_EQ(flat[0].err.find("ddp: all-reduce hierarchical"), std::string::npos) << flat[0].err;

  auto alone = run_process({bin_path("ddp_worker"), "train", "--strategy", "single", "--out", dir + "/alone.pt"},
                           one_rank({}));
  ASSERT_EQ(alone.exit_code, 0) << alone.describe();

  std::string why;
  const double to_flat = max_state_dict_difference(dir + "/hierarchical.pt", dir + "/flat.pt", &why);
  ASSERT_GE(to_flat, 0) << why;
  const double to_alone = max_state_dict_difference(dir + "/hierarchical.pt", dir + "/alone.pt", &why);
  ASSERT_GE(to_alone, 0) << why;
  EXPECT_LE(to_flat, 1e-5);
  EXPECT_LE(to_alone, 1e-5);
  std::printf("[ measured ] 2 namespaces x 2 ranks, ddp's default (hierarchical): max |w - w'| against "
              "DDP_HIERARCHICAL=0 %g, against one process on the whole batch %g\n",
              to_flat, to_alone);
  fs::remove_all(dir);
}

}  // namespace
