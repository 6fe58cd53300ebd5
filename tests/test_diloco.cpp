// ddp::DiLoCo (include/ddp/diloco.h) on 1 to 4 real ranks over Gloo
// (support/ranks.h): its trajectory against DDP's, how many collectives it
// issues, a streaming fragment's all-reduce in flight across inner steps,
// a resumed run bit for bit, composition with DDP on a 2-D mesh, and the
// errors of bad configurations.

#include <ddp/ddp.h>
#include <ddp/diloco.h>

#include <gtest/gtest.h>
#include <support/ranks.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

using ddp::testing::expect_all_succeeded;
using ddp::testing::Group;
using ddp::testing::run_on_ranks;

namespace {

torch::nn::Sequential make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

// This rank's batch at `step`: different on every rank and every step, the
// same in every run.
std::pair<at::Tensor, at::Tensor> batch(int64_t step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank + 1);
  at::Tensor x = at::randn({8, 6}, gen);
  at::Tensor y = at::randn({8, 3}, gen);
  return {x, y};
}

at::Tensor loss_of(torch::nn::Sequential& net, int64_t step, int rank) {
  auto [x, y] = batch(step, rank);
  return torch::nn::functional::mse_loss(net->forward(x), y);
}

at::Tensor flat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.detach().reshape({-1}));
  return at::cat(parts);
}

// Whether every rank of `group` holds the same `value`.
bool same_everywhere(ddp::ProcessGroup& group, const at::Tensor& value) {
  auto all = group.all_gather(value.contiguous());
  for (const auto& other : all) {
    if (!other.equal(all[0])) return false;
  }
  return true;
}

// DiLoCo's pseudo-gradient collectives in the trace, oldest first.
std::vector<ddp::CollectiveRecord> diloco_syncs(const ddp::ProcessGroup& group) {
  std::vector<ddp::CollectiveRecord> out;
  for (const auto& r : group.trace().recent(10000)) {
    if (r.tag.rfind("diloco fragment", 0) == 0) out.push_back(r);
  }
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

ddp::testing::RanksOptions gloo_only() {
  ddp::testing::RanksOptions options;
  options.env = {{"DDP_SHM", "0"}};
  return options;
}

}  // namespace

TEST(DiLoCoFragments, SplitInOrderIntoNonEmptyRunsOfAboutEqualSize) {
  using V = std::vector<std::vector<size_t>>;
  EXPECT_EQ(ddp::split_into_fragments({10, 10, 10, 10}, 2), (V{{0, 1}, {2, 3}}));
  EXPECT_EQ(ddp::split_into_fragments({10, 10, 10, 10}, 1), (V{{0, 1, 2, 3}}));
  EXPECT_EQ(ddp::split_into_fragments({1000, 1, 1, 1}, 4), (V{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(ddp::split_into_fragments({1, 1, 1, 1000}, 2), (V{{0, 1, 2}, {3}}));
  EXPECT_EQ(ddp::split_into_fragments({48, 8, 24, 3}, 2), (V{{0}, {1, 2, 3}}));
  auto many = ddp::split_into_fragments(std::vector<int64_t>(10, 5), 3);
  ASSERT_EQ(many.size(), 3u);
  size_t next = 0;
  for (const auto& f : many) {
    EXPECT_FALSE(f.empty());
    for (size_t i : f) EXPECT_EQ(i, next++);
  }
  EXPECT_EQ(next, 10u);
  EXPECT_NE(error_of([] { ddp::split_into_fragments({1, 2}, 3); }).find("cannot split 2 parameters into 3"),
            std::string::npos);
}

// With H = 1 and an outer SGD of lr 1 without momentum, the outer step is
// global − mean(global − local) = mean(local): the inner SGD's update
// averaged, which (SGD being linear in the gradient, momentum included) is
// DDP's step on the averaged gradient.
TEST(DiLoCoRanks, SyncEveryStepWithOuterSgdLr1EqualsDdp) {
  auto ranks = run_on_ranks(2, [](const Group& group) {
    ddp::DistributedDataParallel<torch::nn::Sequential> reference(make_net(3), group);
    torch::optim::SGD reference_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

    auto net = make_net(3);
    torch::optim::SGD inner(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    ddp::DiLoCo diloco(net->parameters(), inner, group,
                       ddp::DiLoCoOptions().sync_every(1).outer_lr(1.0).outer_momentum(0.0).outer_nesterov(false));
    const int rank = group->rank();
    for (int64_t step = 0; step < 12; ++step) {
      reference_opt.zero_grad();
      auto [x, y] = batch(step, rank);
      torch::nn::functional::mse_loss(reference(x), y).backward();
      reference_opt.step();

      inner.zero_grad();
      loss_of(net, step, rank).backward();
      diloco.step();
    }
    at::Tensor mine = flat(net->parameters());
    at::Tensor theirs = flat(reference->parameters());
    EXPECT_TRUE(at::allclose(mine, theirs, 1e-5, 1e-6))
        << "max difference " << (mine - theirs).abs().max().item<float>();
    // Not a coincidence of a model that did not move.
    EXPECT_GT((mine - flat(make_net(3)->parameters())).abs().max().item<float>(), 1e-2);
    EXPECT_TRUE(same_everywhere(*group, mine));
  });
  expect_all_succeeded(ranks);
}

TEST(DiLoCoRanks, AveragesThePseudoGradientOncePerHStepsInOneCollective) {
  auto ranks = run_on_ranks(3, [](const Group& group) {
    auto net = make_net(5);
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    ddp::DiLoCo diloco(net->parameters(), inner, group, ddp::DiLoCoOptions().sync_every(4));
    const uint64_t before = group->trace().last_entered();
    for (int64_t step = 0; step < 13; ++step) {
      const uint64_t entered = group->trace().last_entered();
      inner.zero_grad();
      loss_of(net, step, group->rank()).backward();
      diloco.step();
      const int64_t done = step + 1;
      // One collective on each sync step, none on the others.
      EXPECT_EQ(group->trace().last_entered() - entered, done % 4 == 0 ? 1u : 0u) << "after step " << done;
      if (done % 4 == 0) {
        // The sync leaves every replica at the new global weights.
        EXPECT_TRUE(same_everywhere(*group, flat(net->parameters()))) << "after step " << done;
        EXPECT_TRUE(flat(net->parameters()).equal(flat(diloco.global_parameters())));
      } else if (done % 4 == 1) {
        EXPECT_FALSE(same_everywhere(*group, flat(net->parameters()))) << "replicas did not diverge at " << done;
      }
    }
    auto syncs = diloco_syncs(*group);
    ASSERT_EQ(syncs.size(), 3u);
    for (const auto& s : syncs) {
      EXPECT_EQ(s.op, "all_reduce");
      EXPECT_EQ(s.bytes, 4 * (6 * 8 + 8 + 8 * 3 + 3)) << "the whole model, flat, fp32";
      EXPECT_EQ(s.state, ddp::CollectiveRecord::State::kCompleted);
    }
    EXPECT_EQ(diloco.syncs_started(), 3);
    // Besides the syncs, only the same_everywhere checks and the initial
    // broadcast (all_gathers issued by this test).
    EXPECT_GE(group->trace().last_entered() - before, 3u);
  });
  expect_all_succeeded(ranks);
}

// F = 2, H = 4, tau = 2: fragment 0 syncs at steps 2, 6, ...; fragment 1 at
// 4, 8, .... Rank 1 is slow to reach step 2, so rank 0's all-reduce of
// fragment 0, issued at step 2, cannot complete until rank 1 arrives; rank
// 0 meanwhile takes step 3, and waits for it only at step 4. Over Gloo:
// the shared-memory transport runs collectives this small inline, so its
// all_reduce_async returns only once they completed.
TEST(DiLoCoRanks, StreamingFragmentAllReduceIsInFlightAcrossTauInnerSteps) {
  auto ranks = run_on_ranks(2, [](const Group& group) {
    auto net = make_net(9);
    torch::optim::SGD inner(net->parameters(), torch::optim::SGDOptions(0.05));
    ddp::DiLoCo diloco(net->parameters(), inner, group,
                       ddp::DiLoCoOptions().sync_every(4).fragments(2).overlap_steps(2).mixing(0.5));
    ASSERT_EQ(diloco.fragments(), (std::vector<std::vector<size_t>>{{0}, {1, 2, 3}}));
    const int rank = group->rank();
    // Takes the inner step that makes the count `done`.
    auto take_step = [&](int64_t done) {
      inner.zero_grad();
      loss_of(net, done - 1, rank).backward();
      diloco.step();
      ASSERT_EQ(diloco.inner_step(), done);
    };
    take_step(1);
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    take_step(2);  // issues fragment 0
    auto issued = diloco_syncs(*group);
    ASSERT_EQ(issued.size(), 1u);
    EXPECT_NE(issued[0].tag.find("fragment 0/2 step 2"), std::string::npos) << issued[0].tag;
    EXPECT_EQ(diloco.in_flight(), std::vector<size_t>{0});
    at::Tensor global_before = flat(diloco.global_parameters()).clone();
    take_step(3);
    if (rank == 0) {
      // Step 3 ran while the all-reduce was still waiting for rank 1.
      auto record = group->trace().find(issued[0].seq);
      ASSERT_TRUE(record.has_value());
      EXPECT_EQ(record->state, ddp::CollectiveRecord::State::kQueued) << "completed before step 3 ended";
      EXPECT_EQ(record->ended_ns, 0);
    }
    EXPECT_EQ(diloco.in_flight(), std::vector<size_t>{0});
    EXPECT_TRUE(flat(diloco.global_parameters()).equal(global_before)) << "the outer step ran before step 2 + tau";
    take_step(4);  // completes fragment 0, issues fragment 1
    auto record = group->trace().find(issued[0].seq);
    ASSERT_TRUE(record.has_value());
    EXPECT_EQ(record->state, ddp::CollectiveRecord::State::kCompleted);
    EXPECT_EQ(diloco.in_flight(), std::vector<size_t>{1});
    at::Tensor global_after = flat(diloco.global_parameters());
    // Fragment 0's globals moved (the first weight, 8 * 6 values), fragment 1's did not.
    EXPECT_FALSE(global_after.narrow(0, 0, 48).equal(global_before.narrow(0, 0, 48)));
    EXPECT_TRUE(global_after.narrow(0, 48, 35).equal(global_before.narrow(0, 48, 35)));
    EXPECT_TRUE(same_everywhere(*group, global_after));
    diloco.flush();
    EXPECT_TRUE(diloco.in_flight().empty());
  }, gloo_only());
  expect_all_succeeded(ranks);
}

namespace {

constexpr int64_t kResumeSteps = 14;
constexpr int64_t kCheckpointAt = 6;  // fragment 0's sync of step 6 is in flight (due at 7)

struct ResumeRun {
  torch::nn::Sequential net = make_net(21);
  torch::optim::AdamW inner{net->parameters(), torch::optim::AdamWOptions(1e-2)};
  std::unique_ptr<ddp::DiLoCo> diloco;
  explicit ResumeRun(const Group& group) {
    diloco = std::make_unique<ddp::DiLoCo>(
        net->parameters(), inner, group,
        ddp::DiLoCoOptions().sync_every(4).fragments(2).overlap_steps(1).mixing(0.25));
  }
  void steps(int64_t from, int64_t to, int rank) {
    for (int64_t step = from; step < to; ++step) {
      inner.zero_grad();
      loss_of(net, step, rank).backward();
      diloco->step();
    }
  }
};

}  // namespace

// Phase 0: a run of 14 steps, and a run that saves a snapshot (the model,
// AdamW, the DiLoCo state in Snapshot::extra) after step 6 with a fragment
// in flight. Phase 1: fresh processes restore it and take steps 7 to 14.
TEST(DiLoCoRanks, ResumedRunIsBitIdentical) {
  ddp::testing::RanksTempDir dir;
  auto phases = ddp::testing::run_phases_on_ranks(
      {{2,
        [&](const Group& group) {
          const int rank = group->rank();
          ResumeRun straight(group);
          straight.steps(0, kResumeSteps, rank);
          straight.diloco->flush();
          torch::save(flat(straight.net->parameters()), dir / ("straight_" + std::to_string(rank) + ".pt"));

          ResumeRun first(group);
          first.steps(0, kCheckpointAt, rank);
          ASSERT_EQ(first.diloco->in_flight(), std::vector<size_t>{0});
          auto snapshot = ddp::capture_snapshot(*first.net, first.inner, 0, kCheckpointAt);
          snapshot.extra = first.diloco->state_dict();
          ddp::save_snapshot(snapshot, dir / ("snapshot_" + std::to_string(rank) + ".pt"));
        }},
       {2, [&](const Group& group) {
          const int rank = group->rank();
          ResumeRun resumed(group);
          auto snapshot = ddp::load_snapshot(dir / ("snapshot_" + std::to_string(rank) + ".pt"));
          ddp::restore_snapshot(snapshot, *resumed.net, resumed.inner);
          resumed.diloco->load_state_dict(snapshot.extra);
          EXPECT_EQ(resumed.diloco->inner_step(), kCheckpointAt);
          EXPECT_EQ(resumed.diloco->in_flight(), std::vector<size_t>{0});
          resumed.steps(kCheckpointAt, kResumeSteps, rank);
          resumed.diloco->flush();
          at::Tensor expected;
          torch::load(expected, dir / ("straight_" + std::to_string(rank) + ".pt"));
          at::Tensor got = flat(resumed.net->parameters());
          EXPECT_TRUE(got.equal(expected)) << "max difference " << (got - expected).abs().max().item<float>();
        }}});
  ddp::testing::expect_phases_succeeded(phases, 2);
}

// The same resume through a distributed checkpoint and a sharded snapshot
// (every rank writes its part of one directory), with the DiLoCo built over
// the module so that the checkpoint names its tensors. Phase 1 resumes at the
// saved world size, bit for bit; phase 2 at 3 ranks: each replica takes
// replica (r mod 2)'s local state and all the same global copy and outer
// momentum, so replica 2 starts where replica 0 stood.
struct ModuleResumeRun : ResumeRun {
  explicit ModuleResumeRun(const Group& group) : ResumeRun(group) {
    diloco = std::make_unique<ddp::DiLoCo>(
        *net, inner, group, ddp::DiLoCoOptions().sync_every(4).fragments(2).overlap_steps(1).mixing(0.25));
  }
};

TEST(DiLoCoRanks, ResumedFromADistributedCheckpointOrShardedSnapshotIsBitIdentical) {
  ddp::testing::RanksTempDir dir;
  const std::string checkpoint = dir / "dcp", snapshots = dir / "snapshots";
  auto phases = ddp::testing::run_phases_on_ranks(
      {{2,
        [&](const Group& group) {
          const int rank = group->rank();
          ModuleResumeRun straight(group);
          straight.steps(0, kResumeSteps, rank);
          straight.diloco->flush();
          torch::save(flat(straight.net->parameters()), dir / ("straight_" + std::to_string(rank) + ".pt"));

          ModuleResumeRun first(group);
          first.steps(0, kCheckpointAt, rank);
          ASSERT_EQ(first.diloco->in_flight(), std::vector<size_t>{0});
          ddp::save_distributed_checkpoint(checkpoint, *first.diloco, &first.inner);
          ddp::SnapshotSaver saver(snapshots);
          saver.save(*first.diloco, &first.inner, ddp::TrainingProgress{0, kCheckpointAt, 0});
          torch::save(flat(first.net->parameters()), dir / ("local_" + std::to_string(rank) + ".pt"));
          torch::save(flat(first.diloco->global_parameters()), dir / "global.pt");
        }},
       {2,
        [&](const Group& group) {
          const int rank = group->rank();
          at::Tensor expected;
          torch::load(expected, dir / ("straight_" + std::to_string(rank) + ".pt"));
          for (const bool from_snapshot : {false, true}) {
            ModuleResumeRun resumed(group);
            if (from_snapshot) {
              auto progress = ddp::load_newest_sharded_snapshot(snapshots, *resumed.diloco, &resumed.inner);
              ASSERT_TRUE(progress.has_value());
              EXPECT_EQ(progress->step, kCheckpointAt);
            } else {
              ddp::load_distributed_checkpoint(checkpoint, *resumed.diloco, &resumed.inner);
            }
            EXPECT_EQ(resumed.diloco->inner_step(), kCheckpointAt);
            EXPECT_EQ(resumed.diloco->in_flight(), std::vector<size_t>{0});
            resumed.steps(kCheckpointAt, kResumeSteps, rank);
            resumed.diloco->flush();
            at::Tensor got = flat(resumed.net->parameters());
            EXPECT_TRUE(got.equal(expected)) << (from_snapshot ? "sharded snapshot" : "distributed checkpoint")
                                             << ": max difference " << (got - expected).abs().max().item<float>();
          }
        }},
       {3, [&](const Group& group) {
          const int rank = group->rank();
          ModuleResumeRun resumed(group);
          ddp::load_distributed_checkpoint(checkpoint, *resumed.diloco, &resumed.inner);
          at::Tensor local, global;
          torch::load(local, dir / ("local_" + std::to_string(rank % 2) + ".pt"));
          torch::load(global, dir / "global.pt");
          EXPECT_TRUE(flat(resumed.net->parameters()).equal(local)) << "replica " << rank;
          EXPECT_TRUE(flat(resumed.diloco->global_parameters()).equal(global));
          EXPECT_EQ(resumed.diloco->inner_step(), kCheckpointAt);
          resumed.steps(kCheckpointAt, kResumeSteps, rank);  // the job goes on at the new size
          resumed.diloco->flush();
          EXPECT_TRUE(same_everywhere(*group, flat(resumed.diloco->global_parameters())));
        }}});
  ddp::testing::expect_phases_succeeded(phases, 3);
}

// A DiLoCo built over a list of parameters cannot name them; a checkpoint of
// another kind is not a DiLoCo job's.
TEST(DiLoCoRanks, DistributedCheckpointErrorsNameTheCause) {
  ddp::testing::RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&](const Group& group) {
    ResumeRun by_list(group);
    const std::string error = error_of([&] { ddp::save_distributed_checkpoint(dir / "a", *by_list.diloco); });
    EXPECT_NE(error.find("needs the DiLoCo built over the module"), std::string::npos) << error;
    ModuleResumeRun run(group);
    torch::optim::SGD other(run.net->parameters(), 0.1);
    const std::string wrong = error_of([&] { ddp::save_distributed_checkpoint(dir / "b", *run.diloco, &other); });
    EXPECT_NE(wrong.find("not the inner one this DiLoCo steps"), std::string::npos) << wrong;
    ddp::DistributedDataParallel<torch::nn::Sequential> plain(make_net(3), group);
    ddp::save_distributed_checkpoint(dir / "ddp", plain);
    const std::string foreign = error_of([&] { ddp::load_distributed_checkpoint(dir / "ddp", *run.diloco); });
    EXPECT_NE(foreign.find("was not saved from a DiLoCo job"), std::string::npos) << foreign;
  });
  expect_all_succeeded(ranks);
}

// DiLoCo across the mesh's "replicate" dimension, DDP inside each row
// ("shard"): a row's ranks stay identical every step, rows differ between
// syncs and agree after each.
void run_mesh(int rows, int cols) {
  auto ranks = run_on_ranks(rows * cols, [rows, cols](const Group& group) {
    ddp::DeviceMesh mesh(group, {rows, cols}, {"replicate", "shard"});
    ddp::DistributedDataParallel<torch::nn::Sequential> model(make_net(13), mesh.group("shard"));
    torch::optim::AdamW inner(model->parameters(), torch::optim::AdamWOptions(1e-2));
    ddp::DiLoCo diloco(model->parameters(), inner, mesh.group("replicate"), ddp::DiLoCoOptions().sync_every(3));
    for (int64_t step = 0; step < 6; ++step) {
      inner.zero_grad();
      // Each rank its own data: DDP averages within the row.
      auto [x, y] = batch(step, group->rank());
      torch::nn::functional::mse_loss(model(x), y).backward();
      diloco.step();
      at::Tensor weights = flat(model->parameters());
      EXPECT_TRUE(same_everywhere(*mesh.group("shard"), weights)) << "a row's replicas differ after step " << step + 1;
      const bool synced = (step + 1) % 3 == 0;
      EXPECT_EQ(same_everywhere(*group, weights), synced) << "after step " << step + 1;
    }
    EXPECT_EQ(diloco_syncs(*mesh.group("replicate")).size(), 2u);
  });
  expect_all_succeeded(ranks);
}

TEST(DiLoCoRanks, AcrossTwoReplicasOfAOneRankDdpGroup) { run_mesh(2, 1); }
TEST(DiLoCoRanks, AcrossTheRowsOfATwoByTwoMeshWithDdpInsideEach) { run_mesh(2, 2); }

// Post-local SGD: for K steps gradients are averaged before the inner step
// (AdamW's trajectory is then DDP's), then models are averaged every H.
TEST(DiLoCoRanks, PostLocalSgdIsDdpForKStepsThenModelAveragingEveryH) {
  auto ranks = run_on_ranks(2, [](const Group& group) {
    ddp::DistributedDataParallel<torch::nn::Sequential> reference(make_net(17), group);
    torch::optim::AdamW reference_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    auto net = make_net(17);
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    ddp::DiLoCo diloco(net->parameters(), inner, group, ddp::DiLoCoOptions::post_local_sgd(3, 2));
    const int rank = group->rank();
    for (int64_t step = 0; step < 7; ++step) {
      if (step < 3) {
        reference_opt.zero_grad();
        auto [x, y] = batch(step, rank);
        torch::nn::functional::mse_loss(reference(x), y).backward();
        reference_opt.step();
      }
      at::Tensor before = flat(net->parameters());
      auto averaged = before.clone();
      inner.zero_grad();
      loss_of(net, step, rank).backward();
      diloco.step();
      at::Tensor after = flat(net->parameters());
      const int64_t done = step + 1;
      if (done <= 3) {
        EXPECT_TRUE(at::allclose(after, flat(reference->parameters()), 1e-5, 1e-6)) << "warm-up step " << done;
      } else if ((done - 3) % 2 == 0) {
        EXPECT_TRUE(same_everywhere(*group, after)) << "not averaged after step " << done;
      } else {
        EXPECT_FALSE(same_everywhere(*group, after)) << "averaged after step " << done;
      }
    }
    EXPECT_EQ(diloco_syncs(*group).size(), 2u);
  });
  expect_all_succeeded(ranks);
}

// Low-precision pseudo-gradients: at H = 1 and outer lr 1, within their
// precision of the fp32 trajectory, and the bytes that travel shrink.
TEST(DiLoCoRanks, Bf16AndInt8PseudoGradientsStayCloseToFp32) {
  auto ranks = run_on_ranks(2, [](const Group& group) {
    auto run = [&](ddp::OuterGradientDtype dtype) {
      auto net = make_net(23);
      torch::optim::SGD inner(net->parameters(), torch::optim::SGDOptions(0.05));
      ddp::DiLoCo diloco(net->parameters(), inner, group,
                         ddp::DiLoCoOptions().sync_every(2).outer_lr(1.0).outer_momentum(0.0).outer_nesterov(false)
                             .outer_gradient_dtype(dtype));
      for (int64_t step = 0; step < 8; ++step) {
        inner.zero_grad();
        loss_of(net, step, group->rank()).backward();
        diloco.step();
      }
      EXPECT_TRUE(same_everywhere(*group, flat(net->parameters())));
      return std::make_pair(flat(net->parameters()), diloco_syncs(*group).back());
    };
    auto [fp32, fp32_record] = run(ddp::OuterGradientDtype::kFloat32);
    auto [bf16, bf16_record] = run(ddp::OuterGradientDtype::kBFloat16);
    auto [int8, int8_record] = run(ddp::OuterGradientDtype::kInt8);
    EXPECT_FALSE(bf16.equal(fp32));
    EXPECT_LT((bf16 - fp32).abs().max().item<float>(), 2e-3);
    EXPECT_LT((int8 - fp32).abs().max().item<float>(), 5e-3);
    EXPECT_EQ(fp32_record.bytes, 4 * 83);
    EXPECT_EQ(bf16_record.bytes, 2 * 83);
    EXPECT_EQ(int8_record.op, "all_gather_into") << "8-bit values are gathered, then summed in fp32";
    EXPECT_EQ(int8_record.bytes, 256 + 4) << "one block of 256 values and its scale";
  });
  expect_all_succeeded(ranks);
}

TEST(DiLoCoRanks, BadConfigurationsNameTheCause) {
  auto ranks = run_on_ranks(1, [](const Group& group) {
    auto net = make_net(1);
    auto other = make_net(2);
    torch::optim::SGD inner(net->parameters(), torch::optim::SGDOptions(0.1));
    auto params = net->parameters();
    auto make = [&](ddp::DiLoCoOptions options) { ddp::DiLoCo(params, inner, group, options); };
    auto expect_error = [](const std::string& error, const std::string& expected) {
      EXPECT_NE(error.find(expected), std::string::npos) << "expected \"" << expected << "\" in: " << error;
    };
    expect_error(error_of([&] { make(ddp::DiLoCoOptions().sync_every(0)); }), "sync_every (H) is 0");
    expect_error(error_of([&] { make(ddp::DiLoCoOptions().sync_every(4).overlap_steps(4)); }),
                 "overlap_steps (tau) is 4 with sync_every (H) 4; it must be in [0, H)");
    expect_error(error_of([&] { make(ddp::DiLoCoOptions().mixing(1.5)); }), "mixing (alpha) is 1.5");
    expect_error(error_of([&] { make(ddp::DiLoCoOptions().mixing(-0.1)); }), "mixing (alpha) is -0.1");
    expect_error(error_of([&] { make(ddp::DiLoCoOptions().sync_every(2).fragments(3)); }),
                 "3 fragments but sync_every (H) is 2");
    expect_error(error_of([&] { ddp::DiLoCo(params, {{params[0], params[1]}, {params[2]}}, inner, group); }),
                 "do not cover the model: parameter 3");
    expect_error(error_of([&] {
                   ddp::DiLoCo(params, {{params[0], params[1]}, {params[1], params[2], params[3]}}, inner, group);
                 }),
                 "fragments overlap: parameter 1");
    expect_error(error_of([&] {
                   ddp::DiLoCo(params, {{params[0], params[1], params[2]}, {other->parameters()[3]}}, inner, group);
                 }),
                 "that is not one of the model's parameters");
    // An outer optimizer over the model's own parameters, not the global copy.
    expect_error(error_of([&] {
                   make(ddp::DiLoCoOptions().outer_optimizer([&](const std::vector<at::Tensor>&) {
                     return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.7));
                   }));
                 }),
                 "outer optimizer optimises a tensor of shape [8, 6] that is not in DiLoCo's global copy");
    // One over only part of it.
    expect_error(error_of([&] {
                   make(ddp::DiLoCoOptions().outer_optimizer([](const std::vector<at::Tensor>& global) {
                     return std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{global[0]},
                                                                torch::optim::SGDOptions(0.7));
                   }));
                 }),
                 "optimises 1 of the 4 global parameters");
    // A good one is accepted, and a custom outer optimizer's state round-trips.
    ddp::DiLoCo ok(params, inner, group, ddp::DiLoCoOptions().outer_optimizer([](const std::vector<at::Tensor>& g) {
      return std::make_unique<torch::optim::AdamW>(g, torch::optim::AdamWOptions(1e-3));
    }));
    expect_error(error_of([&] { ok.load_state_dict(c10::IValue(int64_t{3})); }), "needs what state_dict() returned");
  });
  expect_all_succeeded(ranks);
}

// FSDP inside each row of a 2 x 2 mesh, DiLoCo across the rows over each
// rank's shards: at H = 1 with an outer SGD of lr 1 (an average) and an inner
// SGD (linear in the gradient), the whole is DDP over all four ranks.
TEST(DiLoCoRanks, OverTheShardsOfFsdpInsideEachRowOfATwoByTwoMeshEqualsDdpOverAll) {
  auto ranks = run_on_ranks(4, [](const Group& group) {
    ddp::DistributedDataParallel<torch::nn::Sequential> reference(make_net(31), group);
    torch::optim::SGD reference_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

    ddp::DeviceMesh mesh(group, {2, 2}, {"replicate", "shard"});
    ddp::FullyShardedDataParallel<torch::nn::Sequential> model(make_net(31), mesh.group("shard"));
    torch::optim::SGD inner(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    ddp::DiLoCo diloco(model.parameters(), inner, mesh.group("replicate"),
                       ddp::DiLoCoOptions().sync_every(1).outer_lr(1.0).outer_momentum(0.0).outer_nesterov(false));
    for (int64_t step = 0; step < 6; ++step) {
      auto [x, y] = batch(step, group->rank());
      reference_opt.zero_grad();
      torch::nn::functional::mse_loss(reference(x), y).backward();
      reference_opt.step();

      inner.zero_grad();
      torch::nn::functional::mse_loss(model.forward(x), y).backward();
      diloco.step();
    }
    auto full = model.full_state_dict(/*rank0_only=*/false);
    auto expected = reference->named_parameters();
    ASSERT_EQ(full.size(), expected.size());
    for (const auto& [name, tensor] : full) {
      const at::Tensor& want = expected[name];
      EXPECT_TRUE(at::allclose(tensor, want, 1e-5, 1e-6))
          << name << ": max difference " << (tensor - want).abs().max().item<float>();
    }
  });
  expect_all_succeeded(ranks);
}
