// ProcessGroup's collectives over the mpi backend under a real mpirun:
// reduce, gather, scatter, all_to_all with uneven splits, batch_isend_irecv,
// monitored_barrier and the object collectives give what torch.distributed
// gives over gloo for the same calls at 2 and 3 ranks
// (tests/python/collectives_reference.py, via support/collective_scenarios.h);
// monitored_barrier without rank 0 ends after its timeout and grace. Skips,
// saying why, where this build has no MPI or mpirun is missing.
//
// As in test_subgroups_mpi.cpp, the test re-executes this binary under
// mpirun (run_on_mpi_ranks, support/mpi_ranks.h); the ranks find the test's
// directory in DDP_MPI_COLLECTIVES_DIR.

#include <support/collective_scenarios.h>
#include <support/launch.h>
#include <support/mpi_ranks.h>
#include <support/ranks.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;

constexpr const char* kDirVariable = "DDP_MPI_COLLECTIVES_DIR";

// run_on_mpi_ranks whose ranks get the directory the test made.
ProcessResult on_mpi_ranks(int ranks, const std::string& dir,
                           const std::function<void(const Group&, const std::string&)>& body) {
  return run_on_mpi_ranks(
      ranks, [&](const Group& world) { body(world, std::getenv(kDirVariable)); },
      {{kDirVariable, dir}, {"DDP_TIMEOUT_SECONDS", "60"}}, std::chrono::seconds(150));
}

void same_as_python_at(int ranks) {
  const std::string dir = make_temp_dir("mpi_collectives");
  const ProcessResult r = on_mpi_ranks(ranks, dir, [](const Group& world, const std::string& shared) {
    run_reference_scenario(*world, shared);
  });
  expect_mpi_bodies_ran(r, ranks);
  if (!::testing::Test::HasFailure()) expect_same_as_python(dir, ranks);
  std::filesystem::remove_all(dir);
}

TEST(MpiCollectives, SameAsTorchDistributedAtTwoRanks) {
  SKIP_WITHOUT_MPI();
  same_as_python_at(2);
}

TEST(MpiCollectives, SameAsTorchDistributedAtThreeRanks) {
  SKIP_WITHOUT_MPI();
  same_as_python_at(3);
}

TEST(MpiCollectives, MonitoredBarrierWithoutRankZeroEndsAfterItsTimeoutAndGrace) {
  SKIP_WITHOUT_MPI();
  const std::string dir = make_temp_dir("mpi_collectives");
  expect_mpi_bodies_ran(on_mpi_ranks(3, dir, [](const Group& world, const std::string&) {
    Group group = world->new_group({0, 1, 2});
    if (world->rank() != 0) {
      const auto start = std::chrono::steady_clock::now();
      const std::string error = error_of([&] { group->monitored_barrier(std::chrono::milliseconds(1000)); });
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_NE(error.find("rank 0 of the group (rank 0) gave no verdict"), std::string::npos) << error;
      EXPECT_GE(waited, 1.9) << error;
      EXPECT_LT(waited, 4.0) << error;
    }
    world->barrier();
  }), 3);
  std::filesystem::remove_all(dir);
}

}  // namespace
