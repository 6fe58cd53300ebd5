// The mpi backend, under a real mpirun: every collective and dtype ddp
// sends, the training stack above the process group against Gloo on the same
// data, timeouts and dead ranks, and the errors for a wrong launch. Each test
// skips, saying why, where this build has no MPI or mpirun is missing.
//
// Tests whose ranks run code from this file re-execute this binary under
// mpirun with DDP_MPI_TEST_CHILD set to the test's name (run_on_mpi_ranks,
// support/mpi_ranks.h), so the assertion and each rank's code stay together.
// The training stack's scenarios are the very ones the Gloo tests run
// (support/ddp_scenarios.h).

#include <ddp/ddp.h>

#include <gtest/gtest.h>
#include <support/ddp_models.h>
#include <support/ddp_scenarios.h>
#include <support/launch.h>
#include <support/mpi_ranks.h>
#include <support/ranks.h>
#include <support/subprocess.h>
#include <support/two_node_network.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <regex>
#include <thread>

#include <unistd.h>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;
using ddp::testing::detail::current_test_name;
using ddp::testing::detail::self_executable;

std::vector<at::ScalarType> all_dtypes() {
  return {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kByte, at::kBool, at::kHalf, at::kBFloat16};
}

void check_every_collective(const Group& ranks_group) {
  ddp::ProcessGroup& group = *ranks_group;
  const int n = group.size();
  const int r = group.rank();
  for (auto dtype : all_dtypes()) {
    const bool is_bool = dtype == at::kBool;
    auto opts = at::TensorOptions().dtype(dtype);
    SCOPED_TRACE(c10::toString(dtype));
    // all_reduce: SUM, MAX, MIN, PRODUCT (bool: or, or, and, and).
    auto value = at::full({5}, is_bool ? (r == 0) : r + 1, opts);
    at::Tensor sum = value.clone();
    group.all_reduce(sum, c10d::ReduceOp::SUM);
    EXPECT_TRUE(sum.equal(at::full({5}, is_bool ? 1 : n * (n + 1) / 2, opts)));
    at::Tensor max = value.clone();
    group.all_reduce(max, c10d::ReduceOp::MAX);
    EXPECT_TRUE(max.equal(at::full({5}, is_bool ? 1 : n, opts)));
    at::Tensor min = value.clone();
    group.all_reduce(min, c10d::ReduceOp::MIN);
    EXPECT_TRUE(min.equal(at::full({5}, is_bool ? 0 : 1, opts)));
    if (!is_bool) {
      at::Tensor product = value.clone();
      group.all_reduce(product, c10d::ReduceOp::PRODUCT);
      int64_t factorial = 1;
      for (int i = 1; i <= n; ++i) factorial *= i;
      EXPECT_TRUE(product.equal(at::full({5}, factorial, opts)));
    }
    // broadcast from the last rank.
    at::Tensor b = at::full({3}, is_bool ? (r == n - 1) : r + 10, opts);
    group.broadcast(b, n - 1);
    EXPECT_TRUE(b.equal(at::full({3}, is_bool ? 1 : n - 1 + 10, opts)));
    // all_gather and all_gather_into.
    auto gathered = group.all_gather(at::full({2}, is_bool ? (r % 2 == 0) : r, opts));
    ASSERT_EQ(static_cast<int>(gathered.size()), n);
    for (int i = 0; i < n; ++i) EXPECT_TRUE(gathered[i].equal(at::full({2}, is_bool ? (i % 2 == 0) : i, opts)));
    at::Tensor into = at::empty({2 * n}, opts);
    at::Tensor mine = at::full({2}, is_bool ? (r % 2 == 0) : r, opts);
    group.wait(group.all_gather_into_async(into, mine), "all_gather");
    for (int i = 0; i < n; ++i) EXPECT_TRUE(into.narrow(0, 2 * i, 2).equal(gathered[i]));
    // reduce_scatter: part i of the sum lands on rank i.
    if (!is_bool) {
      at::Tensor input = at::arange(3 * n, opts);
      at::Tensor output = at::empty({3}, opts);
      group.wait(group.reduce_scatter_async(output, input), "reduce_scatter");
      EXPECT_TRUE(output.equal((at::arange(3, opts) + 3 * r) * n));
    }
    // send/recv around the ring, tagged.
    at::Tensor out = at::full({4}, is_bool ? 1 : r + 100, opts);
    at::Tensor in = at::zeros({4}, opts);
    auto sent = group.send_async(out, (r + 1) % n, /*tag=*/7);
    auto received = group.recv_async(in, (r + n - 1) % n, 7);
    group.wait(sent, "send");
    group.wait(received, "recv");
    EXPECT_TRUE(in.equal(at::full({4}, is_bool ? 1 : (r + n - 1) % n + 100, opts)));
  }
  // AVG for floating types.
  at::Tensor avg = at::full({2}, static_cast<double>(r), at::kDouble);
  group.wait(group.all_reduce_async(avg, c10d::ReduceOp::AVG), "all_reduce");
  EXPECT_TRUE(avg.allclose(at::full({2}, (n - 1) / 2.0, at::kDouble)));
  group.barrier();

  // What it cannot send is refused, naming the dtype and the backend.
  at::Tensor complex = at::zeros({2}, at::kComplexFloat);
  try {
    group.all_reduce(complex);
    ADD_FAILURE() << "a complex tensor was reduced";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("mpi backend cannot send"), std::string::npos) << e.what();
  }
  at::Tensor floats = at::zeros({2});
  try {
    group.all_reduce(floats, c10d::ReduceOp::BAND);
    ADD_FAILURE() << "BAND ran on floats";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("BAND needs an integer tensor"), std::string::npos) << e.what();
  }
}

TEST(Mpi, EveryCollectiveAndDtypeAtTwoRanks) {
  SKIP_WITHOUT_MPI();
  expect_mpi_bodies_ran(run_on_mpi_ranks(2, check_every_collective), 2);
}

TEST(Mpi, EveryCollectiveAndDtypeAtThreeRanks) {
  SKIP_WITHOUT_MPI();
  expect_mpi_bodies_ran(run_on_mpi_ranks(3, check_every_collective), 3);
}

// Small collectives run on the caller's thread when the progress thread is
// idle; one issued while larger ones are queued or running must wait its
// turn, or the ranks would match different collectives (wrong sums or a
// hang) and two threads would call MPI at once. Ranks issue in different
// rhythms (rank 1 pauses) so that on one rank the progress thread is busy
// where on the other it is idle.
TEST(Mpi, SmallCollectivesRunHereOnlyWhenNothingIsAheadOfThem) {
  SKIP_WITHOUT_MPI();
  auto r = run_on_mpi_ranks(2, [](const Group& group) {
    const int n = group->size();
    const float total = static_cast<float>(n * (n + 1) / 2);
    for (int i = 0; i < 100; ++i) {
      at::Tensor large = at::full({256 << 10}, static_cast<float>(group->rank() + 1));  // 1 MB: queued
      auto in_flight = group->all_reduce_async(large);
      if (group->rank() == 1 && i % 2 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
      std::vector<at::Tensor> smalls;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int k = 0; k < 3; ++k) {
        smalls.push_back(at::full({1024}, static_cast<float>(k * (group->rank() + 1))));  // 4 KB
        works.push_back(group->all_reduce_async(smalls.back()));
      }
      group->wait(in_flight, "all_reduce");
      // Nothing ahead of these on a rank whose large one is done.
      at::Tensor right_away = at::full({8}, static_cast<float>(i + group->rank()));
      group->all_reduce(right_away);
      for (auto& work : works) group->wait(work, "all_reduce");
      at::Tensor after = at::full({8}, static_cast<float>(group->rank()));
      group->all_reduce(after, c10d::ReduceOp::MAX);
      EXPECT_TRUE(large.equal(at::full({256 << 10}, total))) << "step " << i;
      for (int k = 0; k < 3; ++k) EXPECT_TRUE(smalls[k].equal(at::full({1024}, k * total))) << "step " << i;
      EXPECT_TRUE(right_away.equal(at::full({8}, static_cast<float>(n * i + n * (n - 1) / 2)))) << "step " << i;
      EXPECT_TRUE(after.equal(at::full({8}, static_cast<float>(n - 1)))) << "step " << i;
    }
  });
  expect_mpi_bodies_ran(r, 2);
}

TEST(Mpi, LocalRankComesFromTheSharedMemorySplitAndMatchesTheEnvironment) {
  SKIP_WITHOUT_MPI();
  auto r = run_on_mpi_ranks(3, [](const Group& group) {
    auto from_env = ddp::world_from_env();
    EXPECT_EQ(group->world().local_rank, from_env.local_rank);
    EXPECT_EQ(group->world().local_world_size, from_env.local_world_size);
    EXPECT_EQ(group->world().local_world_size, 3);  // one host
    EXPECT_EQ(group->backend(), ddp::BackendKind::kMpi);
  });
  expect_mpi_bodies_ran(r, 3);
}

double max_difference(const std::string& a, const std::string& b) {
  auto r = run_process({DDP_PYTHON, "-c",
                        "import sys, torch\n"
                        "a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\n"
                        "assert a.keys() == b.keys()\n"
                        "print(max((a[k] - b[k]).abs().max().item() for k in a))\n",
                        a, b});
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  return r.exit_code == 0 ? std::stod(r.out) : 1e9;
}

TEST(Mpi, WineOverMpiEndsWithGloosWeights) {
  SKIP_WITHOUT_MPI();
  const std::string dir = make_temp_dir("ddp_mpi_wine");
  for (int ranks : {2, 3}) {
    const std::string gloo = dir + "/gloo" + std::to_string(ranks);
    const std::string mpi = dir + "/mpi" + std::to_string(ranks);
    fs::create_directories(gloo);
    fs::create_directories(mpi);
    auto g = run_process(under_ddprun(ranks, "wine_ddp", {"8", "4", "--checkpoint-dir", gloo}), one_rank({}));
    ASSERT_EQ(g.exit_code, 0) << g.describe();
    auto m = run_process(
        mpirun_argv(ranks, {bin_path("wine_ddp"), "8", "4", "--backend", "mpi", "--checkpoint-dir", mpi}),
        one_rank({}));
    ASSERT_EQ(m.exit_code, 0) << m.describe();
    EXPECT_EQ(loss_lines(m.out), loss_lines(g.out)) << ranks << " ranks";
    const double diff = max_difference(gloo + "/model_final.pt", mpi + "/model_final.pt");
    // Two ranks add the same two numbers either way; three may sum in
    // another order.
    if (ranks == 2) {
      EXPECT_EQ(diff, 0.0);
    } else {
      EXPECT_LE(diff, 1e-6);
    }
  }
  fs::remove_all(dir);
}

// DDP's options, no_sync(), unused parameters, a compression hook, Join,
// the non-finite check and ZeRO over mpi: the Gloo tests' own scenarios.
TEST(Mpi, TheTrainingStackWorksOverMpi) {
  SKIP_WITHOUT_MPI();
  auto r = run_on_mpi_ranks(
      2,
      [](const Group& group) {
        Equivalence small_buckets;
        small_buckets.steps = 6;
        small_buckets.engine.bucket_cap_mb = 0.0003;
        small_buckets.buckets = 3;
        expect_equivalence(group, small_buckets, "a bucket per layer");
        Equivalence after_backward;
        after_backward.steps = 6;
        after_backward.engine.overlap = false;
        expect_equivalence(group, after_backward, "all-reduce after backward");
        expect_no_sync_matches_one_batch(group, 3, Engine{});
        expect_unused_parameters_per_rank_handled(group, /*bucket_view=*/false);
        EXPECT_LE(hook_error(group, "fp16"), 2e-3);
        expect_join_matches_one_process(group);
        EXPECT_EQ(train_with_a_nan(group, ddp::parse_nonfinite_policy("skip")), 1);
        expect_zero_matches_full_optimizer(group, "adam");
      },
      {{"DDP_TIMEOUT_SECONDS", "30"}}, std::chrono::seconds(240));
  expect_mpi_bodies_ran(r, 2);
}

TEST(Mpi, FsdpStrategiesOverMpiMatchGloo) {
  SKIP_WITHOUT_MPI();
  const std::string dir = make_temp_dir("ddp_mpi_fsdp");
  for (const std::string strategy : {"ddp", "zero1", "fsdp-full", "fsdp-grad-op"}) {
    auto g = run_process(under_ddprun(2, "ddp_worker", {"train", "--strategy", strategy, "--out", dir + "/g.pt"}),
                         one_rank({}));
    ASSERT_EQ(g.exit_code, 0) << strategy << ": " << g.describe();
    auto m = run_process(mpirun_argv(2, {bin_path("ddp_worker"), "train", "--strategy", strategy, "--backend", "mpi",
                                         "--out", dir + "/m.pt"}),
                         one_rank({}));
    ASSERT_EQ(m.exit_code, 0) << strategy << ": " << m.describe();
    EXPECT_LE(max_difference(dir + "/g.pt", dir + "/m.pt"), 1e-6) << strategy;
  }
  fs::remove_all(dir);
}

TEST(Mpi, MismatchedReplicasAreReportedOverMpi) {
  SKIP_WITHOUT_MPI();
  auto r = run_on_mpi_ranks(2, [](const Group& group) {
    Mlp model(group->rank() == 1 ? 5 : 4);
    ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
    ADD_FAILURE() << "no error";
  });
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE((r.out + r.err).find("parameter 'fc3.weight' has shape [4, 32] on rank 0 but [5, 32] on rank 1"),
            std::string::npos)
      << r.describe();
}

TEST(Mpi, AStalledPeerEndsTheJobWithinTheTimeout) {
  SKIP_WITHOUT_MPI();
  const auto start = std::chrono::steady_clock::now();
  auto r = run_on_mpi_ranks(
      2,
      [](const Group& group) {
        at::Tensor t = at::ones({4});
        group->all_reduce(t);
        // Rank 1 stops calling collectives; rank 0 waits in the next one.
        if (group->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
        group->all_reduce(t);
      },
      {{"DDP_TIMEOUT_SECONDS", "3"}}, std::chrono::seconds(60));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.err.find("all_reduce #"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("did not finish within the timeout of 3 s"), std::string::npos) << r.describe();
  EXPECT_LT(seconds, 20.0) << r.describe();
}

// Rank 1 exits before it starts MPI, so rank 0's MPI_Init_thread waits for
// it forever: the watchdog ends rank 0 within the timeout, naming why.
TEST(Mpi, ARankThatExitsBeforeMpiStartsEndsTheOthersWithinTheTimeout) {
  SKIP_WITHOUT_MPI();
  const std::string test = current_test_name();
  if (in_mpi_rank_process()) {
    try {
      ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::BackendKind::kMpi));
      std::printf("MPI STARTED WITHOUT RANK 1\n");
    } catch (const std::exception& e) {
      std::cerr << "rank threw: " << e.what() << "\n";
    }
    std::fflush(nullptr);
    std::_Exit(0);  // reaching here at all is the failure the test reports
  }
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 is a shell that exits before rank 0 has even loaded: mpirun
  // notices a rank leaving without MPI only once another rank started MPI.
  auto r = run_process(mpirun_argv(2,
                                   {"sh", "-c", "[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && exit 0; exec \"$0\" \"$@\"",
                                    self_executable(), "--gtest_filter=" + test},
                                   {{kMpiRanksChildVariable, test}, {"DDP_TIMEOUT_SECONDS", "3"}}),
                       one_rank({}, std::chrono::seconds(60)));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_EQ(r.out.find("MPI STARTED WITHOUT RANK 1"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("error: ddp: MPI_Init_thread"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("did not finish within the timeout of 3 s"), std::string::npos) << r.describe();
  EXPECT_LT(seconds, 20.0) << r.describe();
}

TEST(Mpi, AKilledRankEndsTheJobFastWithNoOrphans) {
  SKIP_WITHOUT_MPI();
  const auto start = std::chrono::steady_clock::now();
  auto r = run_on_mpi_ranks(
      2,
      [](const Group& group) {
        at::Tensor t = at::ones({4});
        group->all_reduce(t);
        if (group->rank() == 1) ::kill(::getpid(), SIGKILL);
        for (int i = 0; i < 1000; ++i) group->all_reduce(t);
      },
      {}, std::chrono::seconds(60));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_LT(seconds, 10.0) << r.describe();
  // No rank of that job is left: no process carries its marker.
  int survivors = 0;
  const std::string wanted = std::string(kMpiRanksChildVariable) + "=" + current_test_name();
  for (const auto& entry : fs::directory_iterator("/proc")) {
    std::ifstream environ(entry.path() / "environ", std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(environ)), std::istreambuf_iterator<char>());
    if (all.find(wanted) != std::string::npos) ++survivors;
  }
  EXPECT_EQ(survivors, 0);
}

// Two "hosts": network namespaces joined by a veth pair, each with its own
// hostname (Open MPI groups ranks into nodes by hostname). mpirun runs on
// the first and starts the second's ranks through a launch agent that enters
// its namespace, as ssh would enter a real host.
TEST(Mpi, FourRanksOnTwoNamespaceNodesMatchFourOnOneNode) {
  SKIP_WITHOUT_MPI();
  if (::geteuid() != 0) GTEST_SKIP() << "creating network namespaces needs root";
  if (run_process({"sh", "-c", "command -v unshare && command -v ip"}).exit_code != 0) {
    GTEST_SKIP() << "needs unshare and ip (util-linux, iproute2)";
  }
  // Test hosts on a link of our own that nothing outside can reach.
  TwoNodeNetwork network("ddpm", "10.213.79");
  if (const std::string why = network.build(); !why.empty()) GTEST_SKIP() << why;
  const std::vector<std::string>& ns = network.ns;
  const std::vector<std::string>& addr = network.addr;
  const std::string dir = make_temp_dir("ddp_mpi_two_nodes");
  const std::string agent = dir + "/enter_node.sh";
  {
    std::ofstream script(agent);
    script << "#!/bin/sh\n"
           << "# Open MPI launch agent: HOST COMMAND..., run inside HOST's namespace with its own hostname\n"
           << "host=$1; shift\n"
           << "case $host in\n"
           << "  " << addr[0] << ") ns=" << ns[0] << "; name=node0 ;;\n"
           << "  " << addr[1] << ") ns=" << ns[1] << "; name=node1 ;;\n"
           << "  *) echo \"unknown host $host\" >&2; exit 1 ;;\n"
           << "esac\n"
           << "exec ip netns exec \"$ns\" unshare --uts /bin/sh -c \"hostname $name; $*\"\n";
  }
  fs::permissions(agent, fs::perms::owner_all);
  fs::create_directories(dir + "/two_nodes");
  fs::create_directories(dir + "/one_node");
  const std::string& subnet = network.subnet;
  std::string mpirun_command = "hostname node0; mpirun --allow-run-as-root --oversubscribe -np 4 --host " + addr[0] +
                               ":2," + addr[1] + ":2 --mca plm_rsh_agent " + agent + " --mca btl_tcp_if_include " +
                               subnet + " --mca oob_tcp_if_include " + subnet + " -x DDP_TIMEOUT_SECONDS=60 " +
                               bin_path("wine_ddp") + " 8 4 --backend mpi --checkpoint-dir " + dir + "/two_nodes";
  auto two = run_process({"ip", "netns", "exec", ns[0], "unshare", "--uts", "/bin/sh", "-c", mpirun_command},
                         one_rank({}, std::chrono::seconds(120)));
  ASSERT_EQ(two.exit_code, 0) << two.describe();
  auto one = run_process(under_ddprun(4, "wine_ddp", {"8", "4", "--checkpoint-dir", dir + "/one_node"}), one_rank({}));
  ASSERT_EQ(one.exit_code, 0) << one.describe();
  EXPECT_EQ(loss_lines(two.out), loss_lines(one.out));
  EXPECT_LE(max_difference(dir + "/one_node/model_final.pt", dir + "/two_nodes/model_final.pt"), 1e-6);
  fs::remove_all(dir);
}

TEST(Mpi, OutsideAnMpiLauncherTheErrorNamesTheFix) {
  if (!ddp::mpi_available()) GTEST_SKIP() << "this build of ddp has no MPI (libopenmpi-dev)";
  const std::string port = std::to_string(free_port());
  auto r = run_process({bin_path("wine_ddp"), "1", "1", "--backend", "mpi", "--checkpoint-dir", "/tmp"},
                       one_rank({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", port}}));
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find("the mpi backend needs ranks started by an MPI launcher"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("mpirun"), std::string::npos) << r.describe();
}

TEST(Mpi, AWorldOfOneNeedsNoLauncher) {
  if (!ddp::mpi_available()) GTEST_SKIP() << "this build of ddp has no MPI (libopenmpi-dev)";
  const std::string dir = make_temp_dir("ddp_mpi_alone");
  auto r = run_process({bin_path("wine_ddp"), "2", "1", "--backend", "mpi", "--checkpoint-dir", dir}, one_rank({}));
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(loss_lines(r.out).size(), 2u) << r.describe();
  fs::remove_all(dir);
}

}  // namespace
