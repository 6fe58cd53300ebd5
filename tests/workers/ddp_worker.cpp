// The program for tests in which a launcher must start the ranks (ddprun,
// torchrun, mpirun, ip netns exec): the first argument picks the scenario;
// each one prints a marker line the test looks for and exits 0 only on
// success. Tests that need no launcher run their ranks' code in the test
// file instead (support/ranks.h). The training scenarios are here for
// test_mpi.cpp's run of the training stack under mpirun.

#include "worker_flags.h"

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>
#include <ddp/snapshot.h>
#include <ddp/zero_redundancy_optimizer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <stdexcept>
#include <string>

namespace {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t hidden_out = 4) {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, hidden_out));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc3(torch::nn::functional::relu(fc2(torch::nn::functional::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

using worker::flag;
using worker::has_flag;

// DDP options from the command line, so one scenario covers every option.
ddp::DDPOptions options_from(int argc, char** argv) {
  double cap_mb = std::stod(flag(argc, argv, "--bucket-cap-mb", "25"));
  auto options = ddp::DDPOptions()
                     .bucket_cap_mb(cap_mb)
                     .first_bucket_cap_mb(std::min(cap_mb, 1.0))
                     .overlap_with_backward(!has_flag(argc, argv, "--no-overlap"))
                     .rebuild_buckets(!has_flag(argc, argv, "--no-rebuild"));
  std::string hook = flag(argc, argv, "--hook", "allreduce");
  if (hook == "fp16") options.comm_hook(ddp::fp16_compress_hook());
  if (hook == "bf16") options.comm_hook(ddp::bf16_compress_hook());
  return options;
}

at::Tensor flatten_parameters(torch::nn::Module& module) {
  std::vector<at::Tensor> flat;
  for (auto& p : module.parameters()) flat.push_back(p.detach().reshape({-1}));
  return at::cat(flat);
}

// Sets `module`'s parameters from a flat_parameters() vector.
void load_flat_parameters(torch::nn::Module& module, const at::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : module.parameters()) {
    p.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

// N ranks with per-rank batch b against one process with batch N*b over the
// same samples in the same order.
int equivalence(int argc, char** argv) {
  int64_t steps = std::stoll(flag(argc, argv, "--steps", "8"));
  int64_t batch = std::stoll(flag(argc, argv, "--batch", "4"));
  int64_t dataset_size = std::stoll(flag(argc, argv, "--dataset", "61"));
  double tolerance = std::stod(flag(argc, argv, "--tolerance", "1e-6"));
  auto group = ddp::init_process_group();
  const int world = group->size();

  auto generator = at::make_generator<at::CPUGeneratorImpl>(1234);
  at::Tensor features = at::randn({dataset_size, 10}, generator);
  at::Tensor labels = at::randint(0, 4, {dataset_size}, generator, at::kLong);

  // Different initial weights per rank: DDP must replace them with rank 0's.
  torch::manual_seed(100 + group->rank());
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, options_from(argc, argv));
  at::Tensor initial = flatten_parameters(*model).clone();
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-3));

  ddp::DistributedSampler sampler(dataset_size, ddp::SamplerOptions(world, group->rank()).seed(7));
  int64_t done = 0;
  for (int64_t epoch = 0; done < steps; ++epoch) {
    sampler.set_epoch(epoch);
    for (const auto& b : ddp::make_batches(sampler.indices(), batch)) {
      if (done == steps) break;
      at::Tensor idx = at::tensor(b, at::kLong);
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                                       labels.index_select(0, idx));
      loss.backward();
      optimizer.step();
      ++done;
    }
  }
  std::printf("BUCKETS %zu REBUILT %d\n", ddp_model.reducer().bucket_assignment().size(),
              ddp_model.reducer().buckets_rebuilt() ? 1 : 0);
  // Every replica must hold exactly the same weights.
  at::Tensor mine = flatten_parameters(*model);
  auto all = group->all_gather(mine);
  for (int r = 1; r < world; ++r) {
    if (!at::equal(all[r], all[0])) {
      std::printf("REPLICAS differ: rank %d vs rank 0\n", r);
      return 3;
    }
  }
  std::printf("REPLICAS identical\n");

  if (group->rank() == 0) {
    // The reference: one process, batches of world*b made of the ranks'
    // batches side by side, from the same initial weights.
    torch::manual_seed(100);
    Mlp reference;
    load_flat_parameters(*reference, initial);
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-3));
    int64_t reference_done = 0;
    for (int64_t epoch = 0; reference_done < steps; ++epoch) {
      std::vector<std::vector<std::vector<int64_t>>> per_rank;
      for (int r = 0; r < world; ++r) {
        per_rank.push_back(ddp::make_batches(
            ddp::distributed_sampler_indices(dataset_size, ddp::SamplerOptions(world, r).seed(7), epoch), batch));
      }
      for (size_t k = 0; k < per_rank[0].size() && reference_done < steps; ++k) {
        std::vector<int64_t> joint;
        for (int r = 0; r < world; ++r) joint.insert(joint.end(), per_rank[r][k].begin(), per_rank[r][k].end());
        at::Tensor idx = at::tensor(joint, at::kLong);
        reference_optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(reference->forward(features.index_select(0, idx)),
                                                         labels.index_select(0, idx));
        loss.backward();
        reference_optimizer.step();
        ++reference_done;
      }
    }
    double diff = (flatten_parameters(*reference) - mine).abs().max().item<double>();
    double moved = (mine - initial).abs().max().item<double>();
    std::printf("EQUIVALENCE max_abs_diff=%.3g moved=%.3g steps=%lld world=%d\n", diff, moved,
                static_cast<long long>(steps), world);
    if (!(diff <= tolerance) || moved < 1e-4) return 4;
  }
  group->barrier();
  return 0;
}

// k micro-batches under no_sync() plus one synced backward must give the
// gradient of one batch k+1 times larger (times k+1, as losses are means).
int no_sync(int argc, char** argv) {
  int64_t micro = std::stoll(flag(argc, argv, "--micro", "3"));
  int64_t batch = 4;
  auto group = ddp::init_process_group();
  const int world = group->size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(99);
  int64_t per_step = (micro + 1) * batch * world;
  at::Tensor features = at::randn({per_step, 10}, generator);
  at::Tensor labels = at::randint(0, 4, {per_step}, generator, at::kLong);
  torch::manual_seed(5);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, options_from(argc, argv));
  // Micro-batch m of rank r: rows [(m*world + r)*batch, +batch).
  auto rows = [&](int64_t m, int r) { return at::arange((m * world + r) * batch, (m * world + r + 1) * batch); };
  {
    auto guard = ddp_model.no_sync();
    for (int64_t m = 0; m < micro; ++m) {
      auto idx = rows(m, group->rank());
      torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                           labels.index_select(0, idx)).backward();
    }
  }
  // Nothing was communicated yet: local gradients still differ.
  auto local = group->all_gather(model->fc1->weight.grad());
  bool differ = world > 1 && !at::equal(local[0], local[1]);
  auto idx = rows(micro, group->rank());
  torch::nn::functional::cross_entropy(ddp_model.forward(features.index_select(0, idx)),
                                       labels.index_select(0, idx)).backward();
  std::printf("NO_SYNC local_grads_differ=%d\n", differ ? 1 : 0);

  // Reference: one process, one batch of every sample, mean loss.
  torch::manual_seed(5);
  Mlp reference;
  load_flat_parameters(*reference, flatten_parameters(*model));
  torch::nn::functional::cross_entropy(reference->forward(features), labels).backward();
  double diff = 0;
  auto got = model->parameters();
  auto want = reference->parameters();
  for (size_t k = 0; k < got.size(); ++k) {
    diff = std::max(diff, (got[k].grad() / static_cast<double>(micro + 1) - want[k].grad()).abs().max().item<double>());
  }
  std::printf("NO_SYNC max_abs_diff=%.3g\n", diff);
  return (differ && diff <= 1e-6) ? 0 : 6;
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

int find_unused(int argc, char** argv) {
  auto group = ddp::init_process_group();
  torch::manual_seed(3);
  Branchy model;
  ddp::DistributedDataParallel<Branchy> ddp_model(model, group, options_from(argc, argv).find_unused_parameters(true));
  at::Tensor x = at::full({2, 4}, 1.0 + group->rank());
  // Only rank 0 uses `right`; nobody uses `never`.
  ddp_model.forward(x, group->rank() == 0).sum().backward();
  bool never_untouched = !model->never->weight.grad().defined();
  auto right_grads = group->all_gather(model->right->weight.grad());
  bool right_same = at::equal(right_grads[0], right_grads[1]);
  // Rank 0's local gradient of `right`, halved, is the average.
  bool right_is_average = true;
  if (group->rank() == 0) {
    torch::manual_seed(3);
    Branchy copy;
    load_flat_parameters(*copy, flatten_parameters(*model));
    copy->forward(x, true).sum().backward();
    right_is_average = at::allclose(model->right->weight.grad(), copy->right->weight.grad() / group->size());
  }
  // A second iteration where every rank uses `right`.
  ddp_model.forward(x, true).sum().backward();
  std::printf("FIND_UNUSED never_untouched=%d right_same=%d right_is_average=%d\n", never_untouched, right_same,
              right_is_average);
  return (never_untouched && right_same && right_is_average) ? 0 : 7;
}

// One backward through a communication hook against the exact average of
// the ranks' local gradients, gathered separately.
int hook_gradients(int argc, char** argv) {
  double tolerance = std::stod(flag(argc, argv, "--tolerance", "1e-6"));
  auto group = ddp::init_process_group();
  torch::manual_seed(11);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group, options_from(argc, argv));
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
  std::printf("HOOK max_rel_err=%.3g\n", worst);
  group->barrier();
  return worst <= tolerance ? 0 : 8;
}

// Rank 1 stops answering (SIGSTOP) after joining; rank 0's next collective
// must fail with the operation and the timeout named.
int stall(int, char**) {
  auto group = ddp::init_process_group();
  group->barrier();
  if (group->rank() == 1) std::raise(SIGSTOP);
  at::Tensor t = at::ones({4});
  group->all_reduce(t);
  std::printf("NO TIMEOUT\n");
  return 0;
}

// Rank 1's loss turns NaN at step 2; all ranks must act together.
int nonfinite(int argc, char** argv) {
  auto policy = ddp::parse_nonfinite_policy(flag(argc, argv, "--policy", "skip"));
  auto group = ddp::init_process_group();
  torch::manual_seed(2);
  Mlp model;
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
  torch::optim::Adam optimizer(ddp_model->parameters(), torch::optim::AdamOptions(1e-2));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(5 + group->rank());
  int skipped = 0;
  for (int step = 0; step < 5; ++step) {
    at::Tensor x = at::randn({4, 10}, generator);
    at::Tensor y = at::randint(0, 4, {4}, generator, at::kLong);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(ddp_model.forward(x), y);
    if (step == 2 && group->rank() == 1) loss = loss * std::nan("");
    if (!ddp::check_loss_is_finite(loss, *group, policy, "step " + std::to_string(step))) {
      ++skipped;
      continue;
    }
    loss.backward();
    optimizer.step();
  }
  auto all = group->all_gather(flatten_parameters(*model));
  bool finite = at::isfinite(all[0]).all().item<bool>();
  bool same = at::equal(all[0], all[1]);
  std::printf("NONFINITE skipped=%d finite=%d identical=%d\n", skipped, finite, same);
  return (skipped == 1 && finite && same) ? 0 : 9;
}

// Rank r has 3 + 2r batches; Join keeps the ranks together and the result
// equals one process averaging whatever gradients each step had.
int join(int, char**) {
  auto group = ddp::init_process_group();
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
  std::printf("JOIN rank %d trained %lld shadowed %lld\n", group->rank(), static_cast<long long>(join.steps()),
              static_cast<long long>(join.shadowed_steps()));
  auto all = group->all_gather(flatten_parameters(*model));
  bool same = true;
  for (auto& t : all) same = same && at::equal(t, all[0]);
  if (group->rank() == 0) {
    // Step k: the sum of the losses of the ranks that still had batch k,
    // divided by the world size (absent ranks contribute zero gradients).
    torch::manual_seed(4);
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
    double diff = (flatten_parameters(*reference) - all[0]).abs().max().item<double>();
    std::printf("JOIN identical=%d max_abs_diff=%.3g\n", same, diff);
    if (!(diff <= 1e-6)) return 10;
  }
  return same ? 0 : 10;
}

// ZeRO-1 (each rank steps its shard) against plain DDP with the full
// optimizer: the same weights, bit for bit, and the same optimizer state once
// consolidated.
int zero(int argc, char** argv) {
  std::string kind = flag(argc, argv, "--optimizer", "adam");
  int64_t steps = std::stoll(flag(argc, argv, "--steps", "6"));
  auto group = ddp::init_process_group();
  auto make = [&](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
    if (kind == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  };
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
  bool same_weights = at::equal(flatten_parameters(*sharded_model), flatten_parameters(*full_model));
  auto all = group->all_gather(flatten_parameters(*sharded_model));
  bool replicas = true;
  for (auto& t : all) replicas = replicas && at::equal(t, all[0]);
  // State only for this rank's shard.
  size_t states = zero_optimizer.local_optimizer().state().size();
  std::printf("ZERO rank %d owns %zu of %zu parameters, holds state for %zu, same_weights=%d replicas=%d\n",
              group->rank(), zero_optimizer.local_indices().size(), sharded->parameters().size(), states,
              same_weights, replicas);
  auto consolidated = zero_optimizer.consolidate_state_dict(0);
  bool same_state = true;
  if (group->rank() == 0) {
    auto reference = ddp::optimizer_state_dict(*full_optimizer).toGenericDict().at("state").toGenericDict();
    auto merged = consolidated.toGenericDict().at("state").toGenericDict();
    same_state = reference.size() == merged.size();
    for (const auto& item : reference) {
      auto mine = merged.at(item.key()).toGenericDict();
      for (const auto& field : item.value().toGenericDict()) {
        same_state = same_state && at::equal(field.value().toTensor(), mine.at(field.key()).toTensor());
      }
    }
    std::printf("ZERO consolidated %zu states, same_state=%d\n", merged.size(), same_state);
  }
  group->barrier();
  bool ok = same_weights && replicas && states == zero_optimizer.local_indices().size() && same_state;
  return ok ? 0 : 11;
}

int ready(int, char**) {
  auto group = ddp::init_process_group();
  at::Tensor one = at::ones({1});
  group->all_reduce(one);
  std::printf("READY rank %d of %d sum %g\n", group->rank(), group->size(), one.item<double>());
  group->barrier();
  return 0;
}

int throw_on_rank(int argc, char** argv) {
  int failing = std::stoi(flag(argc, argv, "--rank", "1"));
  auto group = ddp::init_process_group();
  if (group->rank() == failing) throw std::runtime_error("deliberate failure on rank " + std::to_string(failing));
  // The others block in collectives that can never complete.
  for (;;) {
    at::Tensor t = at::ones({1});
    group->all_reduce(t);
  }
}

int mismatch(int, char**) {
  auto group = ddp::init_process_group();
  Mlp model(group->rank() == 1 ? 5 : 4);
  ddp::DistributedDataParallel<Mlp> ddp_model(model, group);
  std::printf("NO ERROR\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) {
    std::cerr << "usage: ddp_worker ready|throw|stall|equivalence|mismatch|no_sync|find_unused|hook_gradients|nonfinite|join|zero [flags]\n";
    return 2;
  }
  std::string mode = argv[1];
  try {
    if (mode == "equivalence") return equivalence(argc, argv);
    if (mode == "ready") return ready(argc, argv);
    if (mode == "throw") return throw_on_rank(argc, argv);
    if (mode == "mismatch") return mismatch(argc, argv);
    if (mode == "no_sync") return no_sync(argc, argv);
    if (mode == "stall") return stall(argc, argv);
    if (mode == "nonfinite") return nonfinite(argc, argv);
    if (mode == "join") return join(argc, argv);
    if (mode == "zero") return zero(argc, argv);
    if (mode == "hook_gradients") return hook_gradients(argc, argv);
    if (mode == "find_unused") return find_unused(argc, argv);
    std::cerr << "unknown mode " << mode << "\n";
    return 2;
  } catch (const std::exception& e) {
    // ddp's errors carry their cause and fix; no C++ backtrace is printed.
    return ddp::report_failure(e);
  }
}
