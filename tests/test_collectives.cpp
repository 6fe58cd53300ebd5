// ProcessGroup's collectives beyond DDP's and FSDP's, on real ranks over Gloo
// (support/ranks.h): reduce, the blocking reduce_scatter, gather, scatter,
// all_to_all with uneven splits, batch_isend_irecv, monitored_barrier and the
// object collectives give what
// torch.distributed gives for the same calls at 2 and 3 ranks
// (tests/python/collectives_reference.py), each with its trace record; on a
// subgroup they take the group's ranks and refuse non-members; bad arguments
// get errors that say what to pass; monitored_barrier never waits past its
// timeout (plus the verdict's grace on the ranks other than 0); a peer's
// pickle that would run code is refused by broadcast_object.

#include <support/collective_scenarios.h>
#include <support/hostile_files.h>
#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/process_group.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(Collectives, SameAsTorchDistributedAtTwoRanks) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&](const Group& world) { run_reference_scenario(*world, dir.path()); });
  expect_all_succeeded(ranks);
  expect_same_as_python(dir.path(), 2);
}

// Under DDP_DEBUG=detail too: every collective's desync check passes (the
// ranks' all_to_all rows differ, yet their fingerprints agree), and
// monitored_barrier has none, which would wait for the missing ranks.
TEST(Collectives, SameAsTorchDistributedAtThreeRanksWithTheDesyncCheck) {
  RanksTempDir dir;
  RanksOptions options;
  options.env = {{"DDP_DEBUG", "detail"}};
  auto ranks = run_on_ranks(3, [&](const Group& world) { run_reference_scenario(*world, dir.path()); }, options);
  expect_all_succeeded(ranks);
  expect_same_as_python(dir.path(), 3);
}

TEST(Collectives, OnASubgroupRootsAndPeersAreGroupRanksAndNonMembersAreRefused) {
  expect_all_succeeded(run_on_ranks(3, [](const Group& world) {
    const int me = world->rank();
    Group pair = world->new_group({1, 2});  // group rank 0 is global rank 1, group rank 1 is global rank 2
    if (me == 0) {
      ASSERT_FALSE(pair->is_member());
      at::Tensor t = at::ones({2});
      c10::IValue v(int64_t{1});
      for (const auto& [op, call] : std::vector<std::pair<std::string, std::function<void()>>>{
               {"reduce", [&] { pair->reduce(t, 0); }},
               {"gather", [&] { pair->gather(t, 0); }},
               {"scatter", [&] { pair->scatter(t, {}, 0); }},
               {"all_to_all", [&] { pair->all_to_all(t, t); }},
               {"batch_isend_irecv", [&] { pair->batch_isend_irecv({ddp::P2POp(ddp::P2POp::kIsend, t, 1)}); }},
               {"monitored_barrier", [&] { pair->monitored_barrier(std::chrono::seconds(1)); }},
               {"broadcast_object", [&] { pair->broadcast_object(v, 0); }},
               {"all_gather_object", [&] { pair->all_gather_object(v); }}}) {
        const std::string error = error_of(call);
        EXPECT_NE(error.find(op + " on process group 0 from global rank 0, which is not one of its members"),
                  std::string::npos)
            << error;
      }
      return;
    }
    const int mine = pair->rank();  // 0 on global rank 1, 1 on global rank 2
    at::Tensor t = at::full({2}, 10.0 * me);
    pair->reduce(t, /*root=*/1);
    if (mine == 1) EXPECT_TRUE(t.equal(at::full({2}, 30.0))) << t;
    std::vector<at::Tensor> gathered = pair->gather(at::full({1}, static_cast<int64_t>(me), at::kLong), 1);
    if (mine == 1) {
      ASSERT_EQ(gathered.size(), 2u);
      EXPECT_EQ(gathered[0].item<int64_t>(), 1);
      EXPECT_EQ(gathered[1].item<int64_t>(), 2);
    } else {
      EXPECT_TRUE(gathered.empty());
    }
    at::Tensor out = at::empty({1}, at::kLong);
    std::vector<at::Tensor> sources;
    if (mine == 0) sources = {at::full({1}, int64_t{7}), at::full({1}, int64_t{8})};
    pair->scatter(out, sources, 0);
    EXPECT_EQ(out.item<int64_t>(), 7 + mine);
    // Uneven: group rank 0 sends 1 row to itself and 2 to rank 1; rank 1
    // sends 3 to rank 0 and 1 to itself.
    at::Tensor input = mine == 0 ? at::tensor({1.0f, 2.0f, 3.0f}) : at::tensor({4.0f, 5.0f, 6.0f, 7.0f});
    std::vector<int64_t> in_splits = mine == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 1};
    std::vector<int64_t> out_splits = mine == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 1};
    at::Tensor output = at::empty({mine == 0 ? 4 : 3});
    pair->all_to_all(output, input, out_splits, in_splits);
    EXPECT_TRUE(output.equal(mine == 0 ? at::tensor({1.0f, 4.0f, 5.0f, 6.0f}) : at::tensor({2.0f, 3.0f, 7.0f})))
        << output;
    at::Tensor got = at::empty({1}, at::kLong);
    for (auto& work : pair->batch_isend_irecv({ddp::P2POp(ddp::P2POp::kIsend, at::full({1}, int64_t{me}), 1 - mine),
                                               ddp::P2POp(ddp::P2POp::kIrecv, got, 1 - mine)})) {
      pair->wait(work, "batch_isend_irecv");
    }
    EXPECT_EQ(got.item<int64_t>(), 3 - me);
    c10::IValue value = mine == 1 ? c10::IValue(std::string("from global rank 2")) : c10::IValue();
    pair->broadcast_object(value, 1);
    EXPECT_EQ(value.toStringRef(), "from global rank 2");
    std::vector<c10::IValue> all = pair->all_gather_object(int64_t{me * 100});
    ASSERT_EQ(all.size(), 2u);
    EXPECT_EQ(all[0].toInt(), 100);
    EXPECT_EQ(all[1].toInt(), 200);
    pair->monitored_barrier(std::chrono::seconds(20));
    // A root outside the group's ranks says which ranks it has.
    const std::string error = error_of([&] { pair->reduce(t, 2); });
    EXPECT_NE(error.find("reduce was given root 2, but process group 0 has ranks 0 to 1"), std::string::npos) << error;
    // The subgroup's own trace has them; the world's has none of them.
    std::set<std::string> ops;
    for (const auto& record : pair->trace().recent(100)) ops.insert(record.op);
    for (const char* op : {"reduce", "gather", "scatter", "all_to_all", "send", "recv", "broadcast_object",
                           "all_gather_object", "monitored_barrier"}) {
      EXPECT_TRUE(ops.count(op)) << op;
    }
    for (const auto& record : world->trace().recent(100)) EXPECT_NE(record.op, "reduce");
  }));
}

TEST(Collectives, BadArgumentsSayWhatToPass) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& world) {
    const int me = world->rank();
    at::Tensor input = at::arange(5, at::kFloat);
    at::Tensor output = at::empty({5});
    std::string error = error_of([&] { world->all_to_all(output, input); });
    EXPECT_NE(error.find("all_to_all's input has 5 rows, which do not split evenly among 2 ranks; pass "
                         "input_split_sizes"),
              std::string::npos)
        << error;
    error = error_of([&] { world->all_to_all(output, input, {2, 3}, {2, 2}); });
    EXPECT_NE(error.find("input_split_sizes add up to 4 rows but the input has 5"), std::string::npos) << error;
    error = error_of([&] { world->all_to_all(output, input, {5}, {5}); });
    EXPECT_NE(error.find("input_split_sizes has 1 entries; it needs one per rank (2)"), std::string::npos) << error;
    at::Tensor out = at::empty({2});
    if (me == 1) {
      error = error_of([&] { world->scatter(out, {at::ones({2})}, 0); });
      EXPECT_NE(error.find("scatter takes inputs only on its root (rank 0); rank 1 passed 1"), std::string::npos)
          << error;
    } else {
      error = error_of([&] { world->scatter(out, {at::ones({2})}, 0); });
      EXPECT_NE(error.find("scatter's root (rank 0) needs one input per rank, 2 in all; got 1"), std::string::npos)
          << error;
    }
    error = error_of([&] { world->batch_isend_irecv({}); });
    EXPECT_NE(error.find("batch_isend_irecv needs at least one P2POp"), std::string::npos) << error;
    error = error_of([&] { world->batch_isend_irecv({ddp::P2POp(ddp::P2POp::kIsend, out, 5)}); });
    EXPECT_NE(error.find("batch_isend_irecv was given peer 5, but process group world has ranks 0 to 1"),
              std::string::npos)
        << error;
    error = error_of([&] { world->monitored_barrier(std::chrono::milliseconds(0)); });
    EXPECT_NE(error.find("monitored_barrier's timeout must be positive"), std::string::npos) << error;
    // None of these reached the backend: the ranks are still in step.
    at::Tensor sum = at::ones({1});
    world->all_reduce(sum);
    EXPECT_EQ(sum.item<float>(), 2.0f);
  }));
}

// A rank that never comes: rank 0 names it after the timeout, the rank that
// came hears it from rank 0, and nobody waits much longer. Then rank 0 is
// the one missing: the others say rank 0 gave no verdict, after the timeout
// and the grace (min(timeout, 5 s)).
TEST(Collectives, MonitoredBarrierNamesTheMissingRanksWithinItsTimeout) {
  expect_all_succeeded(run_on_ranks(3, [](const Group& world) {
    const int me = world->rank();
    const std::chrono::milliseconds timeout(1500);
    Group group = world->new_group({0, 1, 2});
    if (me != 2) {
      const auto start = Clock::now();
      const std::string error = error_of([&] { group->monitored_barrier(timeout); });
      const double waited = seconds_since(start);
      EXPECT_EQ(missing_named(error), "2") << error;
      EXPECT_GE(waited, me == 0 ? 1.4 : 0.0) << error;
      EXPECT_LT(waited, me == 0 ? 3.0 : 4.5) << error;
      EXPECT_NE(error.find("continue on a new group"), std::string::npos) << error;
      if (me == 1) EXPECT_NE(error.find("says rank 0 of the group"), std::string::npos) << error;
      // The failure is in the group's trace.
      auto record = group->trace().find(group->trace().last_entered());
      ASSERT_TRUE(record.has_value());
      EXPECT_EQ(record->op, "monitored_barrier");
      EXPECT_EQ(record->state, ddp::CollectiveRecord::State::kFailed);
    }
    world->barrier();

    group = world->new_group({0, 1, 2});
    if (me != 0) {
      const auto start = Clock::now();
      const std::string error = error_of([&] { group->monitored_barrier(timeout, /*wait_all_ranks=*/true); });
      const double waited = seconds_since(start);
      EXPECT_NE(error.find("rank 0 of the group (rank 0) gave no verdict"), std::string::npos) << error;
      EXPECT_GE(waited, 2.9) << error;  // the timeout and a grace as long
      EXPECT_LT(waited, 5.0) << error;
    }
    world->barrier();

    // Everyone comes, late ones within the timeout: it passes.
    group = world->new_group({0, 1, 2});
    std::this_thread::sleep_for(std::chrono::milliseconds(300 * me));
    group->monitored_barrier(std::chrono::seconds(20), true);
  }));
}

// Object collectives read a peer's bytes as a file from elsewhere: a pickle
// that names a Python global (here os.system, from a rank that bypasses
// broadcast_object through the raw backend) is refused, and nothing runs.
TEST(Collectives, BroadcastObjectRefusesAPickleThatWouldRunCode) {
  RanksTempDir dir;
  expect_all_succeeded(run_on_ranks(2, [&](const Group& world) {
    if (world->rank() == 0) {
      const std::string path = dir / "hostile.pt";
      // PROTO 2, GLOBAL os.system, BINUNICODE "true", TUPLE1, REDUCE, STOP.
      static const char kPickle[] = "\x80\x02" "cos\nsystem\n" "X\x04\x00\x00\x00true" "\x85R.";
      write_zip(path, {{"data.pkl", std::string(kPickle, sizeof(kPickle) - 1)}, {"version", "3\n"}});
      std::ifstream file(path, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
      ASSERT_GT(bytes.size(), 0u);
      // What broadcast_object sends: the size, then the bytes.
      std::vector<at::Tensor> size{at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong)};
      std::vector<at::Tensor> payload{at::empty({static_cast<int64_t>(bytes.size())}, at::kByte)};
      std::memcpy(payload[0].data_ptr(), bytes.data(), bytes.size());
      c10d::BroadcastOptions opts;
      world->c10d_backend()->broadcast(size, opts)->wait();
      world->c10d_backend()->broadcast(payload, opts)->wait();
    } else {
      c10::IValue value;
      const std::string error = error_of([&] { world->broadcast_object(value, 0); });
      EXPECT_NE(error.find("broadcast_object's value from rank 0"), std::string::npos) << error;
      EXPECT_NE(error.find("it refers to the Python global 'os.system'"), std::string::npos) << error;
      EXPECT_TRUE(value.isNone());
    }
    world->barrier();
  }));
}

}  // namespace
