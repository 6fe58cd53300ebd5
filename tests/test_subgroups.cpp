// Subgroups of a process group on real ranks over Gloo (support/ranks.h):
// new_group and split give the right members in the right order with their
// own traces, refuse non-members clearly, run collectives on disjoint groups
// at the same time without mixing them, name a rank that never joins the
// creation, and carry DDP on each of two pairs as one process would train
// that pair's data.

#include <support/ddp_models.h>
#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;

std::vector<int64_t> gathered_values(ddp::ProcessGroup& group, int64_t value) {
  std::vector<int64_t> values;
  for (const auto& t : group.all_gather(at::full({1}, value, at::kLong))) values.push_back(t.item<int64_t>());
  return values;
}

TEST(Subgroups, NewGroupHasItsRanksInOrderAndRefusesNonMembers) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& world) {
    const int me = world->rank();
    // Given out of order, as torch.distributed.new_group allows: rank i of
    // the group is the i-th smallest.
    Group odd = world->new_group({3, 1});
    ASSERT_EQ(odd->size(), 2);
    EXPECT_EQ(odd->global_ranks(), (std::vector<int>{1, 3}));
    EXPECT_EQ(odd->global_rank(), me);
    EXPECT_EQ(odd->global_rank_of(1), 3);
    EXPECT_EQ(odd->group_rank_of(3), 1);
    EXPECT_EQ(odd->group_rank_of(2), -1);
    EXPECT_EQ(odd->name(), "0");
    if (me % 2 == 1) {
      EXPECT_TRUE(odd->is_member());
      EXPECT_EQ(odd->rank(), me / 2);
      at::Tensor sum = at::full({3}, me + 1.0);
      odd->all_reduce(sum);
      EXPECT_TRUE(sum.equal(at::full({3}, 2.0 + 4.0))) << sum;
      // Roots and peers are ranks of the group: its rank 1 is global rank 3.
      at::Tensor from_three = at::full({2}, static_cast<double>(me));
      odd->broadcast(from_three, /*root=*/1);
      EXPECT_TRUE(from_three.equal(at::full({2}, 3.0))) << from_three;
      EXPECT_EQ(gathered_values(*odd, me), (std::vector<int64_t>{1, 3}));
      // FSDP's collectives (on Gloo, rings of the group's own send/recv).
      at::Tensor whole = at::arange(6, at::kFloat) + me;
      at::Tensor part = at::empty({3});
      odd->wait(odd->reduce_scatter_async(part, whole), "reduce_scatter");
      EXPECT_TRUE(part.equal(2 * at::arange(3 * (me / 2), 3 * (me / 2) + 3, at::kFloat) + 4)) << part;
      at::Tensor joined = at::empty({6});
      odd->wait(odd->all_gather_into_async(joined, part), "all_gather");
      EXPECT_TRUE(joined.equal(2 * at::arange(6, at::kFloat) + 4)) << joined;
    } else {
      EXPECT_FALSE(odd->is_member());
      EXPECT_EQ(odd->rank(), -1);
      at::Tensor t = at::ones({2});
      const std::string error = error_of([&] { odd->all_reduce(t); });
      EXPECT_NE(error.find("all_reduce on process group 0 from global rank " + std::to_string(me) +
                           ", which is not one of its members (its global ranks are 1, 3)"),
                std::string::npos)
          << error;
      EXPECT_NE(error.find("check is_member()"), std::string::npos) << error;
      EXPECT_NE(error_of([&] { odd->barrier(); }).find("not one of its members"), std::string::npos);
      EXPECT_NE(error_of([&] { odd->new_group({0}); }).find("not one of its members"), std::string::npos);
    }
    // The world's group goes on after (and is unaffected by) the subgroup.
    at::Tensor all = at::ones({1});
    world->all_reduce(all);
    EXPECT_EQ(all.item<float>(), 4.0f);
    // Ranks that disagree about the members all fail, saying so.
    const std::string mismatch = error_of([&] { world->new_group(me == 2 ? std::vector<int>{0, 2} : std::vector<int>{0, 1}); });
    EXPECT_NE(mismatch.find("passed other ranks to new_group than rank 0"), std::string::npos) << mismatch;
    EXPECT_NE(error_of([&] { world->new_group({0, 4}); }).find("has ranks 0 to 3"), std::string::npos);
  }));
}

TEST(Subgroups, SplitGivesEachColourItsGroupOrderedByKeyWithItsOwnTrace) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& world) {
    const int me = world->rank();
    const uint64_t world_before = world->trace().last_entered();
    // Colour by parity, keys reversed: the colour-0 group is {2, 0}, in that order.
    Group parity = world->split(me % 2, /*key=*/-me);
    ASSERT_TRUE(parity->is_member());
    EXPECT_EQ(parity->global_ranks(), me % 2 == 0 ? (std::vector<int>{2, 0}) : (std::vector<int>{3, 1}));
    EXPECT_EQ(parity->rank(), me < 2 ? 1 : 0);
    EXPECT_EQ(gathered_values(*parity, me), me % 2 == 0 ? (std::vector<int64_t>{2, 0}) : (std::vector<int64_t>{3, 1}));
    // The split is one collective of the world's; the subgroup's collectives
    // are its own, numbered from 1 in its own trace.
    EXPECT_EQ(world->trace().last_entered(), world_before + 1);
    EXPECT_EQ(world->trace().find(world_before + 1)->op, "split");
    EXPECT_EQ(parity->trace().last_entered(), 1u);
    EXPECT_EQ(parity->trace().find(1)->op, "all_gather");

    // kNoColour: rank 3 joins no group.
    Group first_three = world->split(me == 3 ? ddp::ProcessGroup::kNoColour : 7);
    EXPECT_EQ(first_three->is_member(), me != 3);
    if (me != 3) {
      EXPECT_EQ(first_three->global_ranks(), (std::vector<int>{0, 1, 2}));
      at::Tensor sum = at::full({1}, static_cast<int64_t>(me), at::kLong);
      first_three->all_reduce(sum);
      EXPECT_EQ(sum.item<int64_t>(), 0 + 1 + 2);
    } else {
      EXPECT_NE(error_of([&] { first_three->barrier(); }).find("split off with kNoColour"), std::string::npos);
    }
    // A subgroup of a subgroup: its ranks are still named by global rank.
    Group nested = parity->new_group({0});
    EXPECT_EQ(nested->name(), "0.0");
    EXPECT_EQ(nested->global_ranks(), (std::vector<int>{me % 2 == 0 ? 2 : 3}));
    EXPECT_EQ(nested->is_member(), me >= 2);
  }));
}

// Both pairs of a 4-rank job all-reduce at the same time, many times, with
// several collectives in flight, different values per pair and sizes that
// change: any crosstalk between the pairs' backends or store keys would
// show as a wrong sum (or a hang, caught by the timeout).
TEST(Subgroups, DisjointPairsAllReduceConcurrentlyWithoutCrosstalk) {
  RanksOptions options;
  options.timeout = std::chrono::seconds(90);
  expect_all_succeeded(run_on_ranks(
      4,
      [](const Group& world) {
        const int me = world->rank(), pair = me / 2;
        Group mine = world->split(pair);
        ASSERT_EQ(mine->global_ranks(), (std::vector<int>{2 * pair, 2 * pair + 1}));
        constexpr int kRounds = 200, kInFlight = 4;
        std::vector<at::Tensor> tensors;
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        auto expected = [&](int i) { return 2.0 * (1000.0 * (pair + 1) + i) + 1.0; };
        auto check = [&](size_t k) {
          mine->wait(works[k], "all_reduce");
          const int i = static_cast<int>(k);
          EXPECT_TRUE(tensors[k].equal(at::full({1 + i % 7 * 100}, expected(i))))
              << "round " << i << " on rank " << me << ": " << tensors[k].slice(0, 0, 3);
        };
        for (int i = 0; i < kRounds; ++i) {
          // Rank 2p contributes 1000(p+1)+i, rank 2p+1 one more.
          tensors.push_back(at::full({1 + i % 7 * 100}, 1000.0 * (pair + 1) + i + me % 2));
          works.push_back(mine->all_reduce_async(tensors.back()));
          if (i >= kInFlight) check(i - kInFlight);
        }
        for (int k = kRounds - kInFlight; k < kRounds; ++k) check(k);
        EXPECT_EQ(mine->trace().last_entered(), static_cast<uint64_t>(kRounds));
        // The world still works, and knows nothing of the pairs' collectives.
        at::Tensor total = at::full({1}, static_cast<double>(me));
        world->all_reduce(total);
        EXPECT_EQ(total.item<double>(), 6.0);
        EXPECT_EQ(world->trace().find(world->trace().last_entered())->op, "all_reduce");
        EXPECT_EQ(world->trace().last_entered(), 2u);  // the split and this all-reduce
      },
      options));
}

// Creating a group is a collective of the parent's: a rank that never calls
// new_group is named, with the collective, when the others time out.
TEST(Subgroups, ARankThatNeverCreatesTheGroupIsNamedByTheStallReport) {
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(60);
  auto ranks = run_on_ranks(
      4,
      [](const Group& world) {
        if (world->rank() == 3) {
          // Behind, not dead: its progress responder still answers.
          std::this_thread::sleep_for(std::chrono::seconds(9));
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        const std::string error = error_of([&] { world->new_group({0, 1}); });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cerr << "RANK " << world->rank() << " ERROR: " << error << "\n";
        EXPECT_NE(error.find("rank 3 never entered collective #1 (new_group"), std::string::npos) << error;
        EXPECT_EQ(error.find("rank 1 never entered"), std::string::npos) << error;
        EXPECT_LT(seconds, 3 + 2 + 3) << "the timeout is 3 s";
        // Rank 0 hosts the store through which the others ask rank 3.
        if (world->rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(3));
      },
      options);
  expect_all_succeeded(ranks);
  for (int r = 0; r < 3; ++r) EXPECT_NE(ranks[r].err.find("ERROR: "), std::string::npos) << describe_ranks(ranks);
}

// A stall inside a subgroup is reported by the subgroup, with global ranks:
// rank 3 (the pair's rank 1) skips an all-reduce of the pair {2, 3}.
TEST(Subgroups, AStallInASubgroupNamesTheGlobalRankAndTheGroup) {
  RanksTempDir dir;
  RanksOptions options;
  options.collective_timeout_seconds = 3;
  options.timeout = std::chrono::seconds(60);
  options.env = {{"DDP_TRACE_DIR", dir.path()}};
  auto ranks = run_on_ranks(
      4,
      [&dir](const Group& world) {
        Group pair = world->split(world->rank() / 2);
        at::Tensor t = at::ones({4});
        pair->all_reduce(t);
        if (world->rank() == 3) {
          std::this_thread::sleep_for(std::chrono::seconds(9));
          return;
        }
        if (world->rank() != 2) {
          // Rank 0 hosts the store that rank 2's report goes through.
          std::this_thread::sleep_for(std::chrono::seconds(9));
          return;
        }
        const std::string error = error_of([&] { pair->all_reduce(t); });
        std::cerr << "RANK 2 ERROR: " << error << "\n";
        EXPECT_NE(error.find("all_reduce failed on rank 2 (rank 0 of 2 in process group 0, global ranks 2, 3)"),
                  std::string::npos)
            << error;
        EXPECT_NE(error.find("This rank is in collective #2 (all_reduce, 16 B) of process group 0."), std::string::npos)
            << error;
        EXPECT_NE(error.find("rank 3 never entered collective #2 (all_reduce, 16 B) of process group 0; its last "
                             "completed collective is #1"),
                  std::string::npos)
            << error;
        // The group's own trace file, apart from the world's.
        EXPECT_NE(error.find("This rank's trace: " + dir / "trace_group0_rank2.jsonl"), std::string::npos) << error;
      },
      options);
  expect_all_succeeded(ranks);
  EXPECT_NE(ranks[2].err.find("RANK 2 ERROR: "), std::string::npos) << describe_ranks(ranks);
  // Rank 3's responder wrote its trace of the pair when rank 2 asked.
  EXPECT_TRUE(std::filesystem::exists(dir / "trace_group0_rank3.jsonl")) << describe_ranks(ranks);
}

// Two independent DDP jobs in one 4-rank job: the pairs {0, 1} and {2, 3}
// each train their own data from their own first rank's weights, and each
// ends where one process training that pair's joint batches ends.
TEST(Subgroups, DdpOnEachOfTwoPairsMatchesOneProcessOnThatPairsData) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& world) {
    const int me = world->rank(), pair_index = me / 2;
    Group pair = world->split(pair_index);
    constexpr int64_t kSteps = 6, kBatch = 4;
    // Each pair's own data, so a reduction that mixed the pairs would differ.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1234 + pair_index);
    at::Tensor features = at::randn({kSteps * 2 * kBatch, 10}, generator);
    at::Tensor labels = at::randint(0, 4, {kSteps * 2 * kBatch}, generator, at::kLong);

    torch::manual_seed(100 + me);  // DDP must replace these with the pair's rank 0's
    Mlp model;
    ddp::DistributedDataParallel<Mlp> ddp_model(model, pair);
    const at::Tensor initial = flatten_parameters(*model).clone();
    torch::optim::SGD optimizer(ddp_model->parameters(), torch::optim::SGDOptions(0.1));
    for (int64_t step = 0; step < kSteps; ++step) {
      const int64_t first = (step * 2 + pair->rank()) * kBatch;
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp_model.forward(features.slice(0, first, first + kBatch)),
                                           labels.slice(0, first, first + kBatch))
          .backward();
      optimizer.step();
    }
    const at::Tensor trained = flatten_parameters(*model);

    Mlp reference;
    load_flat_parameters(*reference, initial);
    torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1));
    for (int64_t step = 0; step < kSteps; ++step) {
      const int64_t first = step * 2 * kBatch;
      reference_optimizer.zero_grad();
      torch::nn::functional::cross_entropy(reference->forward(features.slice(0, first, first + 2 * kBatch)),
                                           labels.slice(0, first, first + 2 * kBatch))
          .backward();
      reference_optimizer.step();
    }
    EXPECT_LE((flatten_parameters(*reference) - trained).abs().max().item<double>(), 1e-6);
    EXPECT_GE((trained - initial).abs().max().item<double>(), 1e-3) << "training did not move the weights";

    // The pairs started from different weights and trained on different
    // data: their replicas must differ, within a pair they must not.
    std::vector<at::Tensor> everyone = world->all_gather(trained);
    EXPECT_TRUE(everyone[2 * pair_index].equal(everyone[2 * pair_index + 1]));
    EXPECT_GE((everyone[0] - everyone[2]).abs().max().item<double>(), 1e-3);
  }));
}

}  // namespace
