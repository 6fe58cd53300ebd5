// Multi-process tests over the mpi backend, under a real mpirun:
// run_on_mpi_ranks(N, body) runs `body` on N ranks started by mpirun, so a
// test's assertions and every rank's code sit together:
//
//   TEST(Mpi, Something) {
//     SKIP_WITHOUT_MPI();
//     auto r = ddp::testing::run_on_mpi_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
//       ... EXPECT_EQ(...) ...        // runs on every rank, in its own process
//     });
//     ddp::testing::expect_mpi_bodies_ran(r, 2);   // runs in the test process
//   }
//
// How: the test process re-executes its own binary under mpirun with
// --gtest_filter=<this test> and DDP_MPI_TEST_CHILD=<this test> (passed with
// -x, as are the caller's variables). In such a child, run_on_mpi_ranks joins
// an mpi group, runs `body`, waits at a barrier, prints "MPI BODY DONE on
// rank R of N" and ends the process: exit 0 if `body` returned and no gtest
// assertion failed, 1 otherwise (an exception's message goes to stderr after
// "rank threw:"). It ends with exit(), not _Exit(): MPI_Finalize runs from
// atexit.
//
// Rules as for run_on_ranks (support/ranks.h): one call per test, code
// before it runs in every rank too; a body that needs something from the
// test process (a directory) reads it from a variable passed in `env`.
#pragma once

#include <support/launch.h>
#include <support/ranks.h>
#include <support/subprocess.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ddp::testing {

/// The variable that marks a child of run_on_mpi_ranks; it holds the test's
/// full name.
constexpr const char* kMpiRanksChildVariable = "DDP_MPI_TEST_CHILD";

/// What every rank of run_on_mpi_ranks prints once its body returned.
constexpr const char* kMpiBodyDone = "MPI BODY DONE on rank";

#define SKIP_WITHOUT_MPI()                                                                           \
  do {                                                                                               \
    if (!::ddp::mpi_available()) GTEST_SKIP() << "this build of ddp has no MPI (libopenmpi-dev)";      \
    if (::ddp::testing::run_process({"sh", "-c", "command -v mpirun"}).exit_code != 0)               \
      GTEST_SKIP() << "mpirun (Debian's openmpi-bin) is not installed";                              \
  } while (false)

/// mpirun's argv: `ranks` copies of `program`, each with the variables of
/// `env` (-x NAME=VALUE).
inline std::vector<std::string> mpirun_argv(int ranks, const std::vector<std::string>& program,
                                            const std::vector<std::pair<std::string, std::string>>& env = {}) {
  std::vector<std::string> argv = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(ranks)};
  for (const auto& [name, value] : env) {
    argv.push_back("-x");
    argv.push_back(name + "=" + value);
  }
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

/// Whether this process is an mpirun rank of the current test.
inline bool in_mpi_rank_process() {
  const char* child = std::getenv(kMpiRanksChildVariable);
  return child && detail::current_test_name() == child;
}

/// In a child (see the top of this file): runs `body` over an mpi group and
/// ends the process. In the test process: runs this test under mpirun on
/// `ranks` ranks with the variables of `env` and returns what mpirun did,
/// killing it after `timeout`.
inline ProcessResult run_on_mpi_ranks(int ranks, const RankBody& body,
                                      std::vector<std::pair<std::string, std::string>> env = {},
                                      std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const std::string test = detail::current_test_name();
  if (in_mpi_rank_process()) {
    int code = 0;
    try {
      auto group = init_process_group(ProcessGroupOptions().backend(BackendKind::kMpi));
      body(group);
      group->barrier();
      std::printf("%s %d of %d\n", kMpiBodyDone, group->rank(), group->size());
    } catch (const std::exception& e) {
      std::cerr << "rank threw: " << e.what() << "\n";
      code = 1;
    }
    if (::testing::Test::HasFailure()) code = 1;
    std::fflush(nullptr);
    std::exit(code);  // exit, not _Exit: MPI_Finalize runs from atexit
  }
  env.emplace_back(kMpiRanksChildVariable, test);
  return run_process(mpirun_argv(ranks, {detail::self_executable(), "--gtest_filter=" + test}, env),
                     one_rank({}, timeout));
}

/// Every rank ran the test's body to its end (so the test cannot pass
/// because nothing ran).
inline void expect_mpi_bodies_ran(const ProcessResult& r, int ranks) {
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(count_of(r.out, kMpiBodyDone), ranks) << r.describe();
}

}  // namespace ddp::testing
