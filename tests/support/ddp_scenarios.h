// DDP's behaviour scenarios, each one rank's code with its assertions, run
// over Gloo by the DDP, no-hangs and ZeRO tests (run_on_ranks) and over MPI
// by test_mpi.cpp (under mpirun): one copy of each, whichever transport
// carries it. Each is called on every rank with the same arguments.
#pragma once

#include <support/ddp_models.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/zero_redundancy_optimizer.h>

#include "training/distributed_sampler_impl.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddp::testing {

// The engine's options, so one scenario covers every combination. A cap of
// 0.0003 MB gives each of Mlp's layers its own bucket.
struct Engine {
  double bucket_cap_mb = 25;
  bool bucket_view = false;
  bool find_unused = false;
  bool overlap = true;
  bool rebuild = true;
  std::string hook = "allreduce";

  ddp::DDPOptions options() const {
    auto o = ddp::DDPOptions()
                 .bucket_cap_mb(bucket_cap_mb)
                 .first_bucket_cap_mb(std::min(bucket_cap_mb, 1.0))
                 .gradient_as_bucket_view(bucket_view)
                 .find_unused_parameters(find_unused)
                 .overlap_with_backward(overlap)
                 .rebuild_buckets(rebuild);
    if (hook == "fp16") o.comm_hook(ddp::fp16_compress_hook());
    if (hook == "bf16") o.comm_hook(ddp::bf16_compress_hook());
    return o;
  }
};

struct Equivalence {
  int64_t steps = 8;
  int64_t batch = 4;
  int64_t dataset = 61;
  Engine engine;
  std::optional<size_t> buckets;  // the bucket count expected after training
};

// N ranks with per-rank batch b against one process with batch N*b over the
// same samples in the same order, from rank 0's initial weights.
inline void expect_equivalence(const std::shared_ptr<ProcessGroup>& group, const Equivalence& c,
                               const std::string& label = "") {
  SCOPED_TRACE(label);
  const int world = group->size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1234);
  at::Tensor features = at::randn({c.dataset, 10}, generator);
  at::Tensor labels = at::randint(0, 4, {c.dataset}, generator, at::kLong);

  // Different initial weights per rank: DDP must replace them with rank 0's.
  torch::manual_seed(100 + group->rank());
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, c.engine.options());
  at::Tensor initial = flatten_parameters(*model).clone();
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-3));
  ddp::DistributedSampler sampler(c.dataset, ddp::SamplerOptions(world, group->rank()).seed(7));
  int64_t done = 0;
  for (int64_t epoch = 0; done < c.steps; ++epoch) {
    sampler.set_epoch(epoch);
    for (const auto& b : ddp::make_batches(sampler.indices(), c.batch)) {
      if (done == c.steps) break;
      at::Tensor idx = at::tensor(b, at::kLong);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                           labels.index_select(0, idx))
          .backward();
      optimizer.step();
      ++done;
    }
  }
  if (c.buckets) EXPECT_EQ(ddp_model.bucket_assignment().size(), *c.buckets);
  EXPECT_EQ(ddp_model.buckets_rebuilt(), c.engine.rebuild);
  if (c.engine.bucket_view) {
    // zero_grad() ran every step, and still every gradient lives in its bucket's memory.
    size_t inside = 0;
    for (auto& p : model->parameters()) {
      auto* data = static_cast<const char*>(p.grad().data_ptr());
      for (size_t b = 0; b < ddp_model.bucket_assignment().size(); ++b) {
        auto* begin = static_cast<const char*>(ddp_model.bucket_buffer(b).data_ptr());
        if (data >= begin && data < begin + ddp_model.bucket_buffer(b).nbytes()) ++inside;
      }
    }
    EXPECT_EQ(inside, model->parameters().size());
  }
  at::Tensor mine = flatten_parameters(*model);
  expect_replicas_identical(group, mine, label);

  if (group->rank() == 0) {
    // Batches of world*b made of the ranks' batches side by side.
    Mlp reference;
    load_flat_parameters(*reference, initial);
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-3));
    int64_t reference_done = 0;
    for (int64_t epoch = 0; reference_done < c.steps; ++epoch) {
      std::vector<std::vector<std::vector<int64_t>>> per_rank;
      for (int r = 0; r < world; ++r) {
        per_rank.push_back(ddp::make_batches(
            ddp::distributed_sampler_indices(c.dataset, ddp::SamplerOptions(world, r).seed(7), epoch), c.batch));
      }
      for (size_t k = 0; k < per_rank[0].size() && reference_done < c.steps; ++k) {
        std::vector<int64_t> joint;
        for (int r = 0; r < world; ++r) joint.insert(joint.end(), per_rank[r][k].begin(), per_rank[r][k].end());
        at::Tensor idx = at::tensor(joint, at::kLong);
        reference_optimizer.zero_grad();
        torch::nn::functional::cross_entropy(reference->forward(features.index_select(0, idx)),
                                             labels.index_select(0, idx))
            .backward();
        reference_optimizer.step();
        ++reference_done;
      }
    }
    EXPECT_LE((flatten_parameters(*reference) - mine).abs().max().item<double>(), 1e-6);
    EXPECT_GE((mine - initial).abs().max().item<double>(), 1e-4) << "training did not move the weights";
  }
  group->barrier();
}

// k micro-batches under no_sync() plus one synced backward give the
// gradient of one batch k+1 times larger (times k+1, as losses are means).
inline void expect_no_sync_matches_one_batch(const std::shared_ptr<ProcessGroup>& group, int64_t micro,
                                             Engine engine) {
  const int64_t batch = 4;
  const int world = group->size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(99);
  const int64_t rows_per_step = (micro + 1) * batch * world;
  at::Tensor features = at::randn({rows_per_step, 10}, generator);
  at::Tensor labels = at::randint(0, 4, {rows_per_step}, generator, at::kLong);
  torch::manual_seed(5);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, engine.options());
  // Micro-batch m of rank r: rows [(m*world + r)*batch, +batch).
  auto rows = [&](int64_t m, int r) { return at::arange((m * world + r) * batch, (m * world + r + 1) * batch); };
  {
    auto guard = ddp_model.no_sync();
    for (int64_t m = 0; m < micro; ++m) {
      auto idx = rows(m, group->rank());
      torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                           labels.index_select(0, idx))
          .backward();
    }
  }
  // Nothing was communicated yet: local gradients still differ.
  auto local = group->all_gather(model->fc1->weight.grad());
  EXPECT_FALSE(at::equal(local[0], local[1])) << "no_sync() communicated";
  auto idx = rows(micro, group->rank());
  torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)), labels.index_select(0, idx))
      .backward();

  // One process, one batch of every sample, mean loss.
  Mlp reference;
  load_flat_parameters(*reference, flatten_parameters(*model));
  torch::nn::functional::cross_entropy(reference->forward(features), labels).backward();
  auto got = model->parameters();
  auto want = reference->parameters();
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_LE((got[k].grad() / static_cast<double>(micro + 1) - want[k].grad()).abs().max().item<double>(), 1e-6)
        << "parameter " << k;
  }
}

// Parameters used on some ranks only, and one used nowhere.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(4, 4));
    left = register_module("left", torch::nn::Linear(4, 2));
    right = register_module("right", torch::nn::Linear(4, 2));
    never = register_module("never", torch::nn::Linear(4, 2));
  }
  at::Tensor forward(const at::Tensor& x, bool use_right) {
    auto h = trunk(x);
    return use_right ? left(h) + right(h) : left(h);
  }
  torch::nn::Linear trunk{nullptr}, left{nullptr}, right{nullptr}, never{nullptr};
};
TORCH_MODULE(Branchy);

// Branchy under DDP with find_unused_parameters, from the same weights on
// every rank, and an input that differs by rank.
struct BranchyUnderDdp {
  BranchyUnderDdp(const std::shared_ptr<ProcessGroup>& group, bool bucket_view)
      : model(seeded()), ddp_model(model, group, options(bucket_view)), x(at::full({2, 4}, 1.0 + group->rank())) {}
  Branchy model;
  ddp::DistributedDataParallel<Branchy> ddp_model;
  at::Tensor x;

 private:
  static Branchy seeded() {
    torch::manual_seed(3);
    return Branchy();
  }
  static ddp::DDPOptions options(bool bucket_view) {
    Engine engine;
    engine.bucket_view = bucket_view;
    return engine.options().find_unused_parameters(true);
  }
};

// DDP with find_unused_parameters where only rank 0 uses `right` and no rank
// uses `never`: `never` gets no gradient, `right` rank 0's halved, and a
// second iteration that uses `right` everywhere still synchronises.
inline void expect_unused_parameters_per_rank_handled(const std::shared_ptr<ProcessGroup>& group,
                                                      bool bucket_view) {
  BranchyUnderDdp branchy(group, bucket_view);
  Branchy& model = branchy.model;
  auto& ddp_model = branchy.ddp_model;
  const at::Tensor& x = branchy.x;
  // Only rank 0 uses `right`; nobody uses `never`.
  ddp_model.forward(x, group->rank() == 0).sum().backward();
  EXPECT_FALSE(model->never->weight.grad().defined());
  auto right_grads = group->all_gather(model->right->weight.grad());
  EXPECT_TRUE(at::equal(right_grads[0], right_grads[1]));
  if (group->rank() == 0) {
    // Rank 0's local gradient of `right`, halved, is the average.
    Branchy copy;
    load_flat_parameters(*copy, flatten_parameters(*model));
    copy->forward(x, true).sum().backward();
    EXPECT_TRUE(at::allclose(model->right->weight.grad(), copy->right->weight.grad() / group->size()));
  }
  // A second iteration where every rank uses `right` still synchronises.
  ddp_model.forward(x, true).sum().backward();
  expect_replicas_identical(group, model->right->weight.grad(), "second iteration");
}

// One backward through a communication hook against the exact average of
// the ranks' local gradients, gathered separately: the largest relative error.
inline double hook_error(const std::shared_ptr<ProcessGroup>& group, const std::string& hook) {
  Engine engine;
  engine.hook = hook;
  torch::manual_seed(11);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, engine.options());
  torch::manual_seed(11);
  Mlp local;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(17 + group->rank());
  at::Tensor x = at::randn({8, 10}, generator);
  at::Tensor y = at::randint(0, 4, {8}, generator, at::kLong);
  torch::nn::functional::cross_entropy(ddp_model.forward(x), y).backward();
  torch::nn::functional::cross_entropy(local->forward(x), y).backward();
  double worst = 0;
  auto got = model->parameters();
  auto mine = local->parameters();
  for (size_t k = 0; k < got.size(); ++k) {
    at::Tensor exact = at::zeros_like(mine[k]);
    for (auto& g : group->all_gather(mine[k].grad())) exact += g;
    exact /= group->size();
    double scale = exact.abs().max().item<double>();
    worst = std::max(worst, (got[k].grad() - exact).abs().max().item<double>() / std::max(scale, 1e-12));
  }
  return worst;
}

// Rank 1's loss turns NaN at step 2; all ranks act together. Returns how
// many steps were skipped.
// With `carry_loss`, the check rides on the gradient all-reduce
// (DDPOptions::carry_loss, note_loss) instead of an all-reduce of its own:
// backward runs, and the step is skipped after it. `collectives`, when
// given, receives how many collectives the 5 steps issued.
inline int train_with_a_nan(const std::shared_ptr<ProcessGroup>& group, ddp::NonFinitePolicy policy,
                            bool carry_loss = false, uint64_t* collectives = nullptr) {
  torch::manual_seed(2);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, ddp::DDPOptions().carry_loss(carry_loss));
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-2));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(5 + group->rank());
  int skipped = 0;
  const uint64_t first = group->trace().last_entered();
  for (int step = 0; step < 5; ++step) {
    at::Tensor x = at::randn({4, 10}, generator);
    at::Tensor y = at::randint(0, 4, {4}, generator, at::kLong);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(ddp_model.forward(x), y);
    if (step == 2 && group->rank() == 1) loss = loss * std::nan("");
    if (carry_loss) {
      ddp_model.note_loss(loss);
      loss.backward();
      if (!ddp::check_loss_is_finite(ddp_model.reduced_loss(), policy, "step " + std::to_string(step))) {
        ++skipped;
        continue;
      }
    } else {
      if (!ddp::check_loss_is_finite(loss, *group, policy, "step " + std::to_string(step))) {
        ++skipped;
        continue;
      }
      loss.backward();
    }
    optimizer.step();
  }
  if (collectives) *collectives = group->trace().last_entered() - first;
  at::Tensor weights = flatten_parameters(*model);
  EXPECT_TRUE(at::isfinite(weights).all().item<bool>());
  expect_replicas_identical(group, weights);
  return skipped;
}

// Rank r has 3 + 2r batches; Join keeps the ranks together and the result
// equals one process averaging whatever gradients each step had.
inline void expect_join_matches_one_process(const std::shared_ptr<ProcessGroup>& group) {
  const int world = group->size();
  torch::manual_seed(4);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
  at::Tensor initial = flatten_parameters(*model).clone();
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-2));
  auto batch_of = [](int rank, int k) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + k);
    return std::make_pair(at::randn({4, 10}, generator), at::randint(0, 4, {4}, generator, at::kLong));
  };
  auto batches_of = [](int rank) { return 3 + 2 * rank; };
  auto join = ddp_model.join();
  for (int k = 0; k < batches_of(group->rank()); ++k) {
    join.step();
    auto [x, y] = batch_of(group->rank(), k);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(ddp_model.forward(x), y).backward();
    optimizer.step();
  }
  join.finish();
  EXPECT_EQ(join.steps(), batches_of(group->rank()));
  EXPECT_EQ(join.shadowed_steps(), batches_of(world - 1) - batches_of(group->rank()));
  at::Tensor mine = flatten_parameters(*model);
  expect_replicas_identical(group, mine);
  if (group->rank() == 0) {
    // Step k: the sum of the losses of the ranks that still had batch k,
    // divided by the world size (absent ranks contribute zero gradients).
    Mlp reference;
    load_flat_parameters(*reference, initial);
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-2));
    for (int k = 0; k < batches_of(world - 1); ++k) {
      reference_optimizer.zero_grad();
      at::Tensor total = at::zeros({});
      for (int r = 0; r < world; ++r) {
        if (k >= batches_of(r)) continue;
        auto [x, y] = batch_of(r, k);
        total = total + torch::nn::functional::cross_entropy(reference->forward(x), y);
      }
      (total / world).backward();
      reference_optimizer.step();
    }
    EXPECT_LE((flatten_parameters(*reference) - mine).abs().max().item<double>(), 1e-6);
  }
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                               std::vector<at::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  if (kind == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// ZeRO-1 (each rank steps its shard) against plain DDP with the full
// optimizer: the same weights, bit for bit, state only for this rank's
// shard, and the same optimizer state once consolidated. Returns rank 0's
// consolidated state.
inline c10::IValue expect_zero_matches_full_optimizer(const std::shared_ptr<ProcessGroup>& group,
                                                      const std::string& kind) {
  SCOPED_TRACE(kind);
  const int64_t steps = 6;
  auto make = [&](std::vector<at::Tensor> params) { return make_optimizer(kind, std::move(params)); };
  torch::manual_seed(8);
  Mlp sharded_model;
  torch::manual_seed(8);
  Mlp full_model;
  ddp::DistributedDataParallel<Mlp> sharded(sharded_model, group);
  ddp::DistributedDataParallel<Mlp> full(full_model, group);
  ddp::ZeroRedundancyOptimizer zero_optimizer(sharded->parameters(), group, make);
  auto full_optimizer = make(full->parameters());
  for (int64_t s = 0; s < steps; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(100 * s + group->rank());
    at::Tensor x = at::randn({6, 10}, generator);
    at::Tensor y = at::randint(0, 4, {6}, generator, at::kLong);
    zero_optimizer.zero_grad();
    torch::nn::functional::cross_entropy(sharded.forward(x), y).backward();
    zero_optimizer.step();
    full_optimizer->zero_grad();
    torch::nn::functional::cross_entropy(full.forward(x), y).backward();
    full_optimizer->step();
  }
  EXPECT_TRUE(at::equal(flatten_parameters(*sharded_model), flatten_parameters(*full_model)));
  expect_replicas_identical(group, flatten_parameters(*sharded_model));
  const size_t owned = zero_optimizer.local_indices().size();
  const size_t all = sharded->parameters().size();
  EXPECT_EQ(all, 6u);
  EXPECT_LT(owned, all) << "rank " << group->rank() << " owns every parameter";
  EXPECT_EQ(zero_optimizer.local_optimizer().state().size(), owned);
  at::Tensor total = at::full({1}, static_cast<int64_t>(owned), at::kLong);
  group->all_reduce(total);
  EXPECT_EQ(total.item<int64_t>(), 6) << "every parameter has exactly one owner";

  auto consolidated = zero_optimizer.consolidate_state_dict(0);
  if (group->rank() == 0) {
    auto reference = ddp::optimizer_state_dict(*full_optimizer).toGenericDict().at("state").toGenericDict();
    auto merged = consolidated.toGenericDict().at("state").toGenericDict();
    EXPECT_EQ(merged.size(), 6u);
    EXPECT_EQ(reference.size(), merged.size());
    for (const auto& item : reference) {
      auto mine = merged.at(item.key()).toGenericDict();
      for (const auto& field : item.value().toGenericDict()) {
        EXPECT_TRUE(at::equal(field.value().toTensor(), mine.at(field.key()).toTensor()))
            << "state " << item.key().toInt() << " " << field.key().toStringRef();
      }
    }
  }
  group->barrier();
  return consolidated;
}

}  // namespace ddp::testing
