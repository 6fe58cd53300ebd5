// Subgroups of an mpi process group (MPI_Comm_split) under a real mpirun:
// new_group and split give the members and order Gloo's do, disjoint pairs
// all-reduce at the same time without mixing, non-members are refused. Skips,
// saying why, where this build has no MPI or mpirun is missing.
//
// As in test_mpi.cpp, the test re-executes this binary under mpirun
// (run_on_mpi_ranks, support/mpi_ranks.h), so each rank's code and the
// assertion stay together.

#include <support/launch.h>
#include <support/mpi_ranks.h>
#include <support/ranks.h>
#include <support/torch_errors.h>
#include <support/subprocess.h>

#include <ddp/device_mesh.h>
#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;

TEST(MpiSubgroups, NewGroupSplitAndConcurrentDisjointPairs) {
  SKIP_WITHOUT_MPI();
  expect_mpi_bodies_ran(run_on_mpi_ranks(4, [](const Group& world) {
    const int me = world->rank();
    Group odd = world->new_group({3, 1});
    EXPECT_EQ(odd->global_ranks(), (std::vector<int>{1, 3}));
    if (me % 2 == 1) {
      ASSERT_TRUE(odd->is_member());
      EXPECT_EQ(odd->rank(), me / 2);
      at::Tensor sum = at::full({3}, me + 1.0);
      odd->all_reduce(sum);
      EXPECT_TRUE(sum.equal(at::full({3}, 6.0))) << sum;
    } else {
      EXPECT_FALSE(odd->is_member());
      at::Tensor t = at::ones({1});
      EXPECT_NE(error_of([&] { odd->all_reduce(t); }).find("which is not one of its members"), std::string::npos);
    }

    // Keys reversed: MPI_Comm_split's order is ddp's.
    Group parity = world->split(me % 2, -me);
    EXPECT_EQ(parity->global_ranks(), me % 2 == 0 ? (std::vector<int>{2, 0}) : (std::vector<int>{3, 1}));
    EXPECT_EQ(parity->rank(), me < 2 ? 1 : 0);
    std::vector<at::Tensor> order = parity->all_gather(at::full({1}, static_cast<int64_t>(me), at::kLong));
    EXPECT_EQ(order[0].item<int64_t>(), me % 2 == 0 ? 2 : 3);

    // The pairs {0, 1} and {2, 3} all-reduce at once, several in flight.
    const int pair = me / 2;
    Group mine = world->split(pair);
    std::vector<at::Tensor> tensors;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int i = 0; i < 100; ++i) {
      tensors.push_back(at::full({1 + i % 5 * 50}, 1000.0 * (pair + 1) + i + me % 2));
      works.push_back(mine->all_reduce_async(tensors.back()));
    }
    for (int i = 0; i < 100; ++i) {
      mine->wait(works[i], "all_reduce");
      EXPECT_TRUE(tensors[i].equal(at::full({1 + i % 5 * 50}, 2.0 * (1000.0 * (pair + 1) + i) + 1.0)))
          << "round " << i << " on rank " << me;
    }
    EXPECT_EQ(mine->trace().last_entered(), 100u);  // its own numbering: the world's collectives are not in it

    // A 2 x 2 mesh over MPI: a column's sum of (rank + 1) is 2j + 4.
    ddp::DeviceMesh mesh(world, {2, 2}, {"replicate", "shard"});
    at::Tensor column = at::full({2}, me + 1.0);
    mesh.group("replicate")->all_reduce(column);
    EXPECT_TRUE(column.equal(at::full({2}, 2.0 * (me % 2) + 4.0))) << column;
  }, {{"DDP_TIMEOUT_SECONDS", "60"}}), 4);
}

}  // namespace
