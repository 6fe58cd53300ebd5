// The shared-memory backend on real ranks (support/ranks.h): every
// collective it implements gives Gloo's result (a Gloo backend over the same
// store, side by side), for several dtypes and sizes, odd ones and ones over
// a slot; a peer SIGKILLed or SIGSTOPped mid 40 MB all-reduce ends the
// collective on every other rank with an error naming it, within 2 s, and
// leaves nothing in /dev/shm; a rank that is alive but never arrives is
// bounded by the group's timeout; ranks that issue different collectives
// fail at once; ddp picks shared memory by itself on one host, DDP_SHM=0,
// DDP_BACKEND=gloo and an explicit kGloo override it; subgroups on one host
// get it, also of a job spread over two (named) hosts, where the
// hierarchical hook and HSDP's node dimension then use it.

#include <support/fsdp_nets.h>
#include <support/fsdp_trainers.h>
#include <support/ranks.h>

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

#include "comm/backends.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>
#include <unistd.h>

using namespace ddp::testing;

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// A Gloo backend over the group's ranks and store: the reference.
c10::intrusive_ptr<c10d::Backend> gloo_beside(const Group& group) {
  auto store = c10::intrusive_ptr<c10d::Store>::unsafe_reclaim_from_nonowning(&group->store());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("test/gloo", store);
  return ddp::detail::make_gloo_backend(prefixed, group->world(), std::chrono::seconds(60));
}

// Small whole numbers: sums, products, minima and maxima are exact in every
// dtype, so shared memory and Gloo must agree bit for bit whatever order
// they add in.
at::Tensor input_for(int rank, at::ScalarType dtype, int64_t n, int salt, bool for_product = false) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7919 * salt + rank);
  at::Tensor values = for_product ? at::randint(1, 3, {n}, gen, at::kLong) : at::randint(-8, 9, {n}, gen, at::kLong);
  if (for_product) values = values * (at::randint(0, 2, {n}, gen, at::kLong) * 2 - 1);
  return values.to(dtype);
}

std::string what(const char* op, at::ScalarType dtype, int64_t n) {
  return std::string(op) + " of " + std::to_string(n) + " " + c10::toString(dtype);
}

void compare_every_collective(const Group& group) {
  ASSERT_EQ(group->backend(), ddp::BackendKind::kShm);
  auto gloo = gloo_beside(group);
  const int me = group->rank(), n = group->size();
  int salt = 0;
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt};
  // With DDP_SHM_SLOT_BYTES=65536 (set by the tests): 70001 float32 take
  // five chunks, 4099 take one phase.
  const std::vector<int64_t> sizes = {1, 7, 4099, 70001};
  for (at::ScalarType dtype : dtypes) {
    for (int64_t size : sizes) {
      for (c10d::ReduceOp::RedOpType op :
           {c10d::ReduceOp::SUM, c10d::ReduceOp::MAX, c10d::ReduceOp::MIN, c10d::ReduceOp::PRODUCT}) {
        ++salt;
        const bool product = op == c10d::ReduceOp::PRODUCT;
        at::Tensor input = input_for(me, dtype, size, salt, product);
        at::Tensor ours = input.clone();
        group->all_reduce(ours, op);
        std::vector<at::Tensor> theirs{input.clone()};
        c10d::AllreduceOptions opts;
        opts.reduceOp = op;
        gloo->allreduce(theirs, opts)->wait();
        EXPECT_TRUE(at::equal(ours, theirs[0])) << what("all_reduce", dtype, size) << " op " << int(op);
      }
      ++salt;
      // reduce to rank 1 (sum)
      {
        at::Tensor input = input_for(me, dtype, size, salt);
        at::Tensor ours = input.clone();
        group->reduce(ours, /*root=*/1);
        std::vector<at::Tensor> theirs{input.clone()};
        c10d::ReduceOptions opts;
        opts.rootRank = 1;
        gloo->reduce(theirs, opts)->wait();
        if (me == 1) EXPECT_TRUE(at::equal(ours, theirs[0])) << what("reduce", dtype, size);
      }
      // broadcast from the last rank
      {
        at::Tensor input = input_for(me, dtype, size, ++salt);
        at::Tensor ours = input.clone();
        group->broadcast(ours, /*root=*/n - 1);
        std::vector<at::Tensor> theirs{input.clone()};
        c10d::BroadcastOptions opts;
        opts.rootRank = n - 1;
        gloo->broadcast(theirs, opts)->wait();
        EXPECT_TRUE(at::equal(ours, theirs[0])) << what("broadcast", dtype, size);
      }
      // all_gather, list and into-tensor forms
      {
        at::Tensor input = input_for(me, dtype, size, ++salt);
        std::vector<at::Tensor> ours = group->all_gather(input);
        at::Tensor into = at::empty({size * n}, input.options());
        group->all_gather_into_async(into, input)->wait();
        std::vector<std::vector<at::Tensor>> theirs(1);
        for (int r = 0; r < n; ++r) theirs[0].push_back(at::empty_like(input));
        std::vector<at::Tensor> in{input.clone()};
        gloo->allgather(theirs, in, c10d::AllgatherOptions())->wait();
        ASSERT_EQ(static_cast<int>(ours.size()), n);
        for (int r = 0; r < n; ++r) {
          EXPECT_TRUE(at::equal(ours[r], theirs[0][r])) << what("all_gather", dtype, size) << " part " << r;
          EXPECT_TRUE(at::equal(into.narrow(0, r * size, size), theirs[0][r]))
              << what("all_gather_into", dtype, size) << " part " << r;
        }
      }
      // reduce_scatter (sum): Gloo's c10d backend has no CPU reduce-scatter
      // of its own, so its reference is Gloo's all-reduce, sliced.
      {
        at::Tensor input = input_for(me, dtype, size * n, ++salt);
        at::Tensor ours = at::empty({size}, input.options());
        at::Tensor in = input.clone();
        group->reduce_scatter(ours, in);
        std::vector<at::Tensor> theirs{input.clone()};
        gloo->allreduce(theirs, c10d::AllreduceOptions())->wait();
        EXPECT_TRUE(at::equal(ours, theirs[0].narrow(0, me * size, size))) << what("reduce_scatter", dtype, size);
      }
    }
  }
  // Random float32 over more than one default-sized slot: the same up to
  // the order of the additions.
  at::Tensor big = at::randn({(int64_t{1} << 18) + 3}, at::make_generator<at::CPUGeneratorImpl>(me));
  at::Tensor ours = big.clone();
  group->all_reduce(ours);
  std::vector<at::Tensor> theirs{big.clone()};
  gloo->allreduce(theirs, c10d::AllreduceOptions())->wait();
  EXPECT_TRUE(at::allclose(ours, theirs[0], 1e-5, 1e-5));
  // Every rank holds the same bits: each part was reduced once.
  std::vector<at::Tensor> everyone = group->all_gather(ours);
  for (int r = 0; r < n; ++r) EXPECT_TRUE(at::equal(everyone[r], ours)) << "rank " << r << "'s result differs";
  group->barrier();
}

RanksOptions small_slots() {
  RanksOptions options;
  options.env = {{"DDP_SHM_SLOT_BYTES", "65536"}};
  options.timeout = std::chrono::seconds(200);
  return options;
}

std::set<std::string> dev_shm() {
  std::set<std::string> names;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

TEST(ShmCollectives, MatchGlooOnTwoRanks) {
  expect_all_succeeded(run_on_ranks(2, compare_every_collective, small_slots()));
}

TEST(ShmCollectives, MatchGlooOnFourRanks) {
  expect_all_succeeded(run_on_ranks(4, compare_every_collective, small_slots()));
}

TEST(ShmCollectives, MatchGlooOnThreeRanksWithDefaultSlots) {
  expect_all_succeeded(run_on_ranks(3, [](const Group& group) {
    ASSERT_EQ(group->backend(), ddp::BackendKind::kShm);
    auto gloo = gloo_beside(group);
    // 5 MiB + 12 bytes of float32: six chunks of 1 MiB, the last one short.
    for (int64_t size : {(int64_t{5} << 18) + 3, int64_t{100003}}) {
      at::Tensor input = input_for(group->rank(), at::kFloat, size, 1);
      at::Tensor ours = input.clone();
      group->all_reduce_async(ours)->wait();
      std::vector<at::Tensor> theirs{input.clone()};
      gloo->allreduce(theirs, c10d::AllreduceOptions())->wait();
      EXPECT_TRUE(at::equal(ours, theirs[0])) << size;
    }
  }));
}

// Asynchronous collectives issued back to back complete in order, with
// their futures (DDP's buckets and comm hooks use them).
TEST(ShmCollectives, AsyncCollectivesAndFuturesInOrder) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    std::vector<at::Tensor> tensors;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int i = 0; i < 12; ++i) {
      // Large ones go to the backend's thread, small ones may run inline.
      tensors.push_back(at::full({i % 2 ? 3 : (1 << 19)}, float(group->rank() + i)));
      works.push_back(group->all_reduce_async(tensors.back()));
    }
    for (int i = 0; i < 12; ++i) {
      auto future = works[i]->getFuture();
      future->wait();
      ASSERT_FALSE(future->hasError());
      const float expected = float(0 + i) + float(1 + i);
      EXPECT_TRUE(at::equal(future->value().toTensorVector()[0], at::full_like(tensors[i], expected))) << i;
      group->wait(works[i], "all_reduce");
    }
  }));
}

// What a dying or stopped peer does to the others: `victim` ranks kill or
// stop themselves during a stream of 40 MB all-reduces (the time in the
// store); every other rank must fail, naming the rank and the collective,
// within 2 s.
void peer_fails_mid_all_reduce(int world, int signal) {
  const std::set<std::string> before = dev_shm();
  RanksOptions options;
  options.timeout = std::chrono::seconds(60);
  options.collective_timeout_seconds = 60;
  auto results = run_on_ranks(
      world,
      [signal](const Group& group) {
        const int victim = 1;
        at::Tensor big = at::ones({10 * 1000 * 1000});  // 40 MB
        std::thread killer;
        if (group->rank() == victim) {
          killer = std::thread([&group, signal] {
            std::this_thread::sleep_for(std::chrono::milliseconds(600));
            group->store().set("test/signalled_at", c10::str(now_ns()));
            group->store().set("test/pid", c10::str(::getpid()));
            ::raise(signal);
          });
        }
        try {
          for (int i = 0; i < 100000; ++i) group->all_reduce(big);
          ADD_FAILURE() << "the all-reduces went on after rank 1 was " << (signal == SIGKILL ? "killed" : "stopped");
        } catch (const c10::Error& e) {
          const int64_t caught = now_ns();
          const std::string text = e.what_without_backtrace();
          ASSERT_NE(group->rank(), victim) << text;
          const int64_t signalled = std::stoll(std::string(
              [&] { auto b = group->store().get("test/signalled_at"); return std::string(b.begin(), b.end()); }()));
          const double seconds = double(caught - signalled) / 1e9;
          EXPECT_LT(seconds, 2.0) << text;
          EXPECT_NE(text.find("all_reduce"), std::string::npos) << text;
          EXPECT_NE(text.find("rank 1 "), std::string::npos) << text;
          EXPECT_NE(text.find(signal == SIGKILL ? "died" : "stopped"), std::string::npos) << text;
          std::cout << "rank " << group->rank() << " failed " << seconds << " s after the signal: " << text << "\n";
          // A stopped victim is killed by the first rank that saw it.
          if (signal == SIGSTOP) {
            auto pid = group->store().get("test/pid");
            ::kill(std::stoi(std::string(pid.begin(), pid.end())), SIGKILL);
          }
          // Rank 0 hosts the store: it stays until the others have read it.
          group->store().add("test/read", 1);
          const auto until = Clock::now() + std::chrono::seconds(10);
          while (group->rank() == 0 && group->store().add("test/read", 0) < group->size() - 1 &&
                 Clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
        if (killer.joinable()) killer.join();
      },
      options);
  for (int r = 0; r < world; ++r) {
    if (r == 1) {
      EXPECT_EQ(results[r].term_signal, SIGKILL) << describe_ranks(results);
    } else {
      EXPECT_EQ(results[r].exit_code, 0) << describe_ranks(results);
      EXPECT_NE(results[r].out.find("after the signal"), std::string::npos) << describe_ranks(results);
    }
  }
  for (const auto& r : results) std::cout << r.out;  // how long each took, what it said
  EXPECT_EQ(dev_shm(), before) << "the job left files in /dev/shm";
}

TEST(ShmFailure, SigkilledPeerMidAllReduceIsNamedWithinTwoSecondsOnTwoRanks) {
  peer_fails_mid_all_reduce(2, SIGKILL);
}
TEST(ShmFailure, SigkilledPeerMidAllReduceIsNamedWithinTwoSecondsOnThreeRanks) {
  peer_fails_mid_all_reduce(3, SIGKILL);
}
TEST(ShmFailure, StoppedPeerMidAllReduceIsNamedWithinTwoSeconds) { peer_fails_mid_all_reduce(3, SIGSTOP); }

// Alive but never arriving: the group's timeout (2 s here) still ends it.
TEST(ShmFailure, AlivePeerThatNeverArrivesHitsTheTimeout) {
  RanksOptions options;
  options.collective_timeout_seconds = 2;
  options.timeout = std::chrono::seconds(60);
  expect_all_succeeded(run_on_ranks(
      2,
      [](const Group& group) {
        at::Tensor t = at::ones({1000});
        if (group->rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(5));
          return;
        }
        const auto start = Clock::now();
        try {
          group->all_reduce(t);
          ADD_FAILURE() << "all_reduce returned without rank 1";
        } catch (const c10::Error& e) {
          const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
          const std::string text = e.what_without_backtrace();
          EXPECT_GE(seconds, 1.9) << text;
          EXPECT_LT(seconds, 4.5) << text;
          EXPECT_NE(text.find("timed out"), std::string::npos) << text;
          EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
        }
      },
      options));
}

// Different collectives on different ranks fail on both at once, naming both.
TEST(ShmFailure, DifferentCollectivesFailAtOnce) {
  expect_all_succeeded(run_on_ranks(2, [](const Group& group) {
    at::Tensor t = at::ones({group->rank() == 0 ? 10 : 12});
    const auto start = Clock::now();
    try {
      if (group->rank() == 0) {
        group->all_reduce(t);
      } else {
        group->broadcast(t, 0);
      }
      ADD_FAILURE() << "mismatched collectives succeeded";
    } catch (const c10::Error& e) {
      const std::string text = e.what_without_backtrace();
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0) << text;
      EXPECT_NE(text.find("different collectives"), std::string::npos) << text;
      EXPECT_NE(text.find("broadcast"), std::string::npos) << text;
    }
  }));
}

// ---- The choice -----------------------------------------------------------------

TEST(ShmChoice, AutoPicksSharedMemoryOnOneHostAndRankZeroSaysSo) {
  auto results = run_on_ranks(2, [](const Group& group) {
    EXPECT_EQ(group->backend(), ddp::BackendKind::kShm);
    EXPECT_EQ(group->c10d_backend()->getBackendName(), "shm");
    at::Tensor t = at::full({5}, float(group->rank() + 1));
    group->all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::full({5}, 3.0f)));
  });
  expect_all_succeeded(results);
  EXPECT_NE(results[0].err.find("ddp: transport shm (2 ranks on one host)\n"), std::string::npos)
      << describe_ranks(results);
  EXPECT_EQ(results[1].err.find("ddp: transport"), std::string::npos) << describe_ranks(results);
}

TEST(ShmChoice, DdpShmZeroGivesGloo) {
  RanksOptions options;
  options.env = {{"DDP_SHM", "0"}};
  auto results = run_on_ranks(
      2, [](const Group& group) { EXPECT_EQ(group->backend(), ddp::BackendKind::kGloo); }, options);
  expect_all_succeeded(results);
  EXPECT_NE(results[0].err.find("ddp: transport gloo (2 ranks on one host)\n"), std::string::npos)
      << describe_ranks(results);
}

TEST(ShmChoice, DdpBackendGlooGivesGloo) {
  RanksOptions options;
  options.env = {{"DDP_BACKEND", "gloo"}};
  expect_all_succeeded(run_on_ranks(
      2, [](const Group& group) { EXPECT_EQ(group->backend(), ddp::BackendKind::kGloo); }, options));
}

TEST(ShmChoice, ExplicitGlooOptionGivesGlooAndItsSubgroupsToo) {
  expect_all_succeeded(run_on_ranks(
      2,
      [](const Group&) {
        auto group = ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::BackendKind::kGloo));
        EXPECT_EQ(group->backend(), ddp::BackendKind::kGloo);
        auto sub = group->new_group({0, 1});
        EXPECT_EQ(sub->backend(), ddp::BackendKind::kGloo);
        group->shutdown();
      },
      RanksOptions().no_group()));
}

TEST(ShmChoice, SubgroupsOnOneHostUseSharedMemory) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& world) {
    auto pair = world->split(world->rank() / 2);
    EXPECT_EQ(pair->backend(), ddp::BackendKind::kShm);
    at::Tensor t = at::full({3}, float(world->rank()));
    pair->all_reduce(t);
    const float expected = world->rank() < 2 ? 1.0f : 5.0f;
    EXPECT_TRUE(at::equal(t, at::full({3}, expected))) << t;
    auto odd = world->new_group({1, 3});
    if (odd->is_member()) {
      EXPECT_EQ(odd->backend(), ddp::BackendKind::kShm);
      at::Tensor u = at::full({2}, float(world->rank()));
      odd->broadcast(u, 1);
      EXPECT_TRUE(at::equal(u, at::full({2}, 3.0f)));
    }
    // Point-to-point goes to Gloo beside it.
    at::Tensor p = at::full({4}, float(world->rank()));
    if (world->rank() == 0) world->send_async(p, 1)->wait();
    if (world->rank() == 1) {
      world->recv_async(p, 0)->wait();
      EXPECT_TRUE(at::equal(p, at::zeros({4})));
    }
    world->barrier();
  }));
}

// Two "hosts" of two ranks (DDP_SHM_HOST_ID): the world is Gloo, each
// node's ranks share memory, the hierarchical hook reduces through the node
// groups, and HSDP's node dimension is shared memory too.
TEST(ShmChoice, TwoHostsGetGlooBetweenAndSharedMemoryInside) {
  auto results = run_on_ranks(4, [](const Group&) {
    const int rank = std::stoi(std::getenv("RANK"));
    ::setenv("DDP_SHM_HOST_ID", rank < 2 ? "node-a" : "node-b", 1);
    ::setenv("LOCAL_RANK", std::to_string(rank % 2).c_str(), 1);
    ::setenv("LOCAL_WORLD_SIZE", "2", 1);
    ::setenv("GROUP_RANK", std::to_string(rank / 2).c_str(), 1);
    auto world = ddp::init_process_group();
    EXPECT_EQ(world->backend(), ddp::BackendKind::kGloo);
    ddp::DeviceMesh mesh = ddp::DeviceMesh::from_launcher(world, {"replicate", "shard"});
    EXPECT_EQ(mesh.group(1)->backend(), ddp::BackendKind::kShm);  // inside a node
    EXPECT_EQ(mesh.group(0)->backend(), ddp::BackendKind::kGloo);  // between nodes
    // DDP with the hierarchical hook (node reduce and broadcast over shared
    // memory, leaders over Gloo) against flat DDP over Gloo.
    auto make = [] {
      torch::manual_seed(5);
      return torch::nn::Sequential(torch::nn::Linear(6, 32), torch::nn::Tanh(), torch::nn::Linear(32, 2));
    };
    // Flat by choice: without a hook, DDP across hosts is hierarchical by default.
    ddp::DistributedDataParallel<torch::nn::Sequential> flat(
        make(), world, ddp::DDPOptions().bucket_cap_mb(0.001).hierarchical_allreduce(false));
    ddp::DistributedDataParallel<torch::nn::Sequential> hierarchical(
        make(), world, ddp::DDPOptions().bucket_cap_mb(0.001).comm_hook(ddp::hierarchical_allreduce_hook(mesh)));
    auto generator = at::make_generator<at::CPUGeneratorImpl>(11 + rank);
    at::Tensor x = at::randn({4, 6}, generator), y = at::randn({4, 2}, generator);
    torch::nn::functional::mse_loss(flat.forward(x), y).backward();
    torch::nn::functional::mse_loss(hierarchical.forward(x), y).backward();
    auto a = flat->parameters(), b = hierarchical->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::allclose(a[i].grad(), b[i].grad(), 1e-6, 1e-6)) << "parameter " << i;
    }
    world->shutdown();
  }, RanksOptions().no_group());
  expect_all_succeeded(results);
  EXPECT_NE(results[0].err.find("ddp: transport gloo (4 ranks on 2 hosts)\n"), std::string::npos)
      << describe_ranks(results);
}

// HSDP on the same two "hosts": each row of the 2 x 2 mesh (its shard
// dimension) is one host's ranks, so FSDP's all-gathers and reduce-scatters
// go through shared memory and the replicas' all-reduce through Gloo; the
// weights match DDP's over the Gloo world.
TEST(ShmChoice, TwoHostsHsdpShardsOverSharedMemoryAndMatchesDdp) {
  expect_all_succeeded(run_on_ranks(4, [](const Group&) {
    const int rank = std::stoi(std::getenv("RANK"));
    ::setenv("DDP_SHM_HOST_ID", rank < 2 ? "node-a" : "node-b", 1);
    auto world = ddp::init_process_group();
    ASSERT_EQ(world->backend(), ddp::BackendKind::kGloo);
    ddp::DeviceMesh mesh(world, {2, 2}, {"replicate", "shard"});
    EXPECT_EQ(mesh.group(1)->backend(), ddp::BackendKind::kShm);
    EXPECT_EQ(mesh.group(0)->backend(), ddp::BackendKind::kGloo);
    TrainSpec reference;
    const auto ddp_state = train(world, reference).state;
    TrainSpec hybrid;
    hybrid.strategy = "hybrid_shard";
    hybrid.mesh_shape = {2, 2};
    const auto hsdp_state = train(world, hybrid).state;
    if (rank == 0) EXPECT_LE(max_difference(ddp_state, hsdp_state), 1e-5);
    world->shutdown();
  }, RanksOptions().no_group()));
}

}  // namespace
