// FSDP's deferred construction on real ranks (support/ranks.h): a model
// given as one factory per unit is built, synchronised and sharded one unit
// at a time, equals the same model built whole, loads a full checkpoint file
// by reading only each rank's bytes, and trains under an address-space cap
// that DDP of the same model cannot live in.
#include "support/ranks.h"
#include "support/torch_errors.h"
#include "support/subprocess.h"

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/process_group.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>

#include <gtest/gtest.h>

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace ddp::testing;
using ddp::DeferredSequential;
using Sequential = torch::nn::Sequential;
using DeferredFsdp = ddp::FullyShardedDataParallel<Sequential>;


// A line of /proc/self/status ("VmHWM", "VmSize", ...) in bytes.
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// Bytes this process has read through read(2) and pread(2) so far.
int64_t bytes_read_so_far() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

void barrier(ddp::ProcessGroup& group) {
  at::Tensor token = at::zeros({1});
  group.all_reduce(token);
}

// A block of two layers: a child of a Sequential needs a forward with fixed
// types (AnyModule's rule), which a nested Sequential lacks.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(33, 17));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({17})));
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(norm(fc(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Block);

// A child holding an fsdp_unit of its own.
struct WrapsAUnitImpl : torch::nn::Module {
  WrapsAUnitImpl() { inner = register_module("inner", ddp::fsdp_unit(torch::nn::Linear(3, 3))); }
  at::Tensor forward(const at::Tensor& x) { return inner->forward(x); }
  std::shared_ptr<ddp::FsdpUnitImpl<torch::nn::Linear>> inner;
};
TORCH_MODULE(WrapsAUnit);

// Children with parameters, one without (ReLU: no unit of its own), a
// block of several modules and buffers (BatchNorm's running statistics).
std::vector<std::pair<std::string, DeferredSequential::Factory>> small_children() {
  DeferredSequential children;
  children.add([] { return torch::nn::Linear(10, 33); })
      .add([] { return Block(); })
      .add([] { return torch::nn::ReLU(); })
      .add([] { return torch::nn::BatchNorm1d(17); })
      .add([] { return torch::nn::Linear(17, 5); });
  return children.children();
}

DeferredSequential deferred(const std::vector<std::pair<std::string, DeferredSequential::Factory>>& children) {
  DeferredSequential out;
  for (const auto& [name, factory] : children) out.add(name, factory);
  return out;
}

// The same model built whole, every child with parameters a unit of its own.
Sequential built_whole(const std::vector<std::pair<std::string, DeferredSequential::Factory>>& children) {
  Sequential whole;
  for (const auto& [name, factory] : children) whole->push_back(name, factory());
  return whole;
}

void train(DeferredFsdp& model, torch::optim::Optimizer& optimizer, int rank, int64_t steps, int64_t in_features,
           int64_t batch = 6) {
  for (int64_t step = 0; step < steps; ++step) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(100 * step + rank);
    at::Tensor x = at::randn({batch, in_features}, generator);
    optimizer.zero_grad();
    at::Tensor out = model.forward(x);
    torch::nn::functional::mse_loss(out, at::zeros_like(out)).backward();
    optimizer.step();
  }
}

// A model given as factories is built one unit at a time: when a factory
// runs, every unit built before has given its full storage back. Each
// rank's factories draw other values (seeded by rank), and rank 0's are the
// ones every rank ends with: the shards, the unit names and three Adam steps
// equal those of the same Sequential built whole from rank 0's seed and
// wrapped the old way, exactly. Without sync_module_states, factories seeded
// alike build the same model too. At 3 ranks, so shards are padded.
TEST(FsdpDeferred, BuildsOneUnitAtATimeAndTrainsLikeTheModelBuiltWhole) {
  auto ranks = run_on_ranks(3, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    const auto children = small_children();
    torch::manual_seed(17);
    DeferredFsdp whole(built_whole(children), group, ddp::FSDPOptions().units({"0", "1", "3", "4"}));

    // The factories, watched: each one checks that the modules the earlier
    // ones built hold no storage any more.
    auto built = std::make_shared<std::vector<std::shared_ptr<torch::nn::Module>>>();
    auto unfreed = std::make_shared<int>(0);
    DeferredSequential watched;
    for (const auto& [name, factory] : children) {
      watched.add(name, [factory = factory, built, unfreed] {
        for (const auto& module : *built) {
          for (const auto& p : module->parameters()) *unfreed += p.storage().nbytes() > 0 ? 1 : 0;
        }
        torch::nn::AnyModule module = factory();
        built->push_back(module.ptr());
        return module;
      });
    }
    torch::manual_seed(17 + group->rank());  // rank 0's draws must win
    DeferredFsdp model(watched, group);
    EXPECT_EQ(*unfreed, 0) << "a unit still held its full parameters when the next one was built";
    EXPECT_EQ(built->size(), children.size());
    EXPECT_EQ(model.unit_names(), whole.unit_names());

    torch::manual_seed(17);
    DeferredFsdp seeded(deferred(children), group, ddp::FSDPOptions().sync_module_states(false));

    auto expect_same = [](DeferredFsdp& a, DeferredFsdp& b, const std::string& what) {
      auto shards_a = a.parameters(), shards_b = b.parameters();
      ASSERT_EQ(shards_a.size(), shards_b.size());
      for (size_t u = 0; u < shards_a.size(); ++u) {
        EXPECT_TRUE(at::equal(shards_a[u], shards_b[u])) << what << ": unit " << u;
      }
      auto state_a = a.full_state_dict(false), state_b = b.full_state_dict(false);
      ASSERT_EQ(state_a.size(), state_b.size());
      for (size_t i = 0; i < state_a.size(); ++i) {
        EXPECT_EQ(state_a[i].first, state_b[i].first);
        EXPECT_TRUE(at::equal(state_a[i].second, state_b[i].second)) << what << ": " << state_a[i].first;
      }
    };
    expect_same(model, whole, "built");
    expect_same(seeded, whole, "built, seeded alike");

    torch::optim::Adam whole_optimizer(whole.parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
    train(whole, whole_optimizer, group->rank(), 3, 10);
    train(model, optimizer, group->rank(), 3, 10);
    expect_same(model, whole, "trained");
  });
  expect_all_succeeded(ranks);
}

TEST(FsdpDeferred, RefusesSizeOptionsAndNestedUnits) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    auto sized = error_of([&] { DeferredFsdp(deferred(small_children()), group, ddp::FSDPOptions().min_num_params(9)); });
    EXPECT_NE(sized.find("every child is a unit of its own"), std::string::npos) << sized;
    auto nested = error_of([&] {
      DeferredFsdp(DeferredSequential().add([] { return WrapsAUnit(); }), group);
    });
    EXPECT_NE(nested.find("contains an fsdp_unit wrapper"), std::string::npos) << nested;
  });
  expect_all_succeeded(ranks);
}

// Factories that build different shapes on different ranks: every rank is
// told, in FSDP's words, which parameter differs by its name in the whole
// model ("1.weight", not the child's own "weight"), and which factory to fix.
// Eagerly wrapped, a model that differs is refused in FSDP's name too.
TEST(FsdpDeferred, FactoriesThatBuildOtherShapesOnSomeRanksAreNamedByTheirFullNames) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    const int64_t width = group->rank() == 0 ? 4 : 5;
    const std::string deferred_error = error_of([&] {
      DeferredFsdp(DeferredSequential()
                       .add([] { return torch::nn::Linear(3, 4); })
                       .add([width] { return torch::nn::Linear(4, width); }),
                   group);
    });
    EXPECT_NE(deferred_error.find("ddp: FullyShardedDataParallel needs the same model on every rank, but parameter "
                                  "'1.weight' has shape [4, 4] on rank 0 but [5, 4] on rank 1"),
              std::string::npos)
        << deferred_error;
    EXPECT_NE(deferred_error.find("Make the DeferredSequential factory of child '1' build the same module"),
              std::string::npos)
        << deferred_error;
    EXPECT_EQ(deferred_error.find("DistributedDataParallel"), std::string::npos) << deferred_error;

    Sequential eager(torch::nn::Linear(3, 4), torch::nn::Linear(4, width));
    const std::string eager_error = error_of([&] { DeferredFsdp(eager, group); });
    EXPECT_NE(eager_error.find("ddp: FullyShardedDataParallel needs the same model on every rank, but parameter "
                               "'1.weight' has shape [4, 4] on rank 0 but [5, 4] on rank 1"),
              std::string::npos)
        << eager_error;
  });
  expect_all_succeeded(ranks);
}

// A full checkpoint file goes straight into the shards: each of 2 ranks
// reads about half of the file's bytes (/proc/self/io, the kernel's count),
// where ddp::load_state_dict reads all of them, and ends with the shards
// that loading the whole state dict gives. A file Python's torch.save wrote
// (OrderedDict with _metadata) loads too; an entry missing or extra is
// refused before anything changes.
TEST(FsdpDeferred, LoadsAFullCheckpointFileReadingOnlyThisRanksBytes) {
  RanksTempDir dir;
  const std::string python_file = dir / "python.pt";
  if (!in_rank_process()) {
    auto made = run_process({DDP_PYTHON, "-c",
                             "import sys, torch\n"
                             "torch.manual_seed(3)\n"
                             "net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), "
                             "torch.nn.BatchNorm1d(48), torch.nn.Linear(48, 7))\n"
                             "net[2].running_mean.uniform_()\n"
                             "torch.save(net.state_dict(), sys.argv[1])\n",
                             python_file});
    ASSERT_EQ(made.exit_code, 0) << made.describe();
  }
  auto ranks = run_on_ranks(2, [&](const std::shared_ptr<ddp::ProcessGroup>& group) {
    at::set_num_threads(1);
    auto big = [] {
      DeferredSequential layers;
      for (int i = 0; i < 4; ++i) layers.add([] { return torch::nn::Linear(1024, 1023); });
      return layers;
    };
    const std::string path = dir / "full.pt";
    {
      torch::manual_seed(7);
      DeferredFsdp source(big(), group);
      auto full = source.full_state_dict();  // on rank 0
      if (group->rank() == 0) ddp::save_state_dict(full, path);
      barrier(*group);
    }
    const auto file_bytes = static_cast<int64_t>(std::filesystem::file_size(path));

    torch::manual_seed(0);
    DeferredFsdp model(big(), group);
    const int64_t before = bytes_read_so_far();
    model.load_full_state_dict_file(path);
    const int64_t read_by_shards = bytes_read_so_far() - before;
    const int64_t before_whole = bytes_read_so_far();
    auto state = ddp::load_state_dict(path);
    const int64_t read_whole = bytes_read_so_far() - before_whole;
    std::printf("rank %d: file %lld bytes, load_full_state_dict_file read %lld, load_state_dict read %lld\n",
                group->rank(), static_cast<long long>(file_bytes), static_cast<long long>(read_by_shards),
                static_cast<long long>(read_whole));
    EXPECT_GE(read_whole, file_bytes * 95 / 100) << "the kernel's count does not see the reads";
    EXPECT_LT(read_by_shards, file_bytes * 52 / 100);
    EXPECT_GT(read_by_shards, file_bytes * 45 / 100);

    torch::manual_seed(1);
    DeferredFsdp reference(big(), group);
    reference.load_full_state_dict(state);
    auto shards = model.parameters(), expected = reference.parameters();
    for (size_t u = 0; u < shards.size(); ++u) EXPECT_TRUE(at::equal(shards[u], expected[u])) << "unit " << u;

    // Python's file, into a model with buffers and a child without a unit.
    DeferredSequential python_children;
    python_children.add([] { return torch::nn::Linear(64, 48); })
        .add([] { return torch::nn::ReLU(); })
        .add([] { return torch::nn::BatchNorm1d(48); })
        .add([] { return torch::nn::Linear(48, 7); });
    DeferredFsdp from_python(python_children, group);
    from_python.load_full_state_dict_file(python_file);
    auto python_state = ddp::load_state_dict(python_file);
    auto loaded = from_python.full_state_dict(/*rank0_only=*/false);
    ASSERT_EQ(loaded.size(), python_state.size());
    std::map<std::string, at::Tensor> by_name(python_state.begin(), python_state.end());
    for (const auto& [name, tensor] : loaded) {
      ASSERT_TRUE(by_name.count(name)) << name;
      EXPECT_TRUE(at::equal(tensor, by_name[name])) << name;
    }

    // Refusals name the entry and change nothing.
    const std::string missing = dir / "missing.pt", extra = dir / "extra.pt";
    if (group->rank() == 0) {
      auto fewer = python_state;
      fewer.erase(fewer.begin());
      ddp::save_state_dict(fewer, missing);
      auto more = python_state;
      more.emplace_back("surplus", at::ones({2}));
      ddp::save_state_dict(more, extra);
    }
    barrier(*group);
    auto before_refusal = from_python.parameters();
    std::vector<at::Tensor> kept;
    for (const auto& shard : before_refusal) kept.push_back(shard.detach().clone());
    auto no_entry = error_of([&] { from_python.load_full_state_dict_file(missing); });
    EXPECT_NE(no_entry.find("no entry '0.weight'"), std::string::npos) << no_entry;
    auto surplus = error_of([&] { from_python.load_full_state_dict_file(extra); });
    EXPECT_NE(surplus.find("'surplus' that the model lacks"), std::string::npos) << surplus;
    for (size_t u = 0; u < kept.size(); ++u) EXPECT_TRUE(at::equal(before_refusal[u], kept[u]));
  });
  expect_all_succeeded(ranks);
}

// --- under a memory cap ------------------------------------------------------

// 16 units of Linear(2048, 2048): 268 MB of fp32 weights, 537 MB of Adam
// state. DDP needs the weights and Adam state whole (805 MB) before any
// gradient. At 2 ranks FSDP keeps per rank half the weights, half their
// gradients and half the Adam state (537 MB, all fp32) plus, during
// backward, each unit's flat gradient until backward ends (fsdp_step.cpp's
// finish_group): as much as the weights again in fp32. Computing in bf16
// (param_dtype; the shards, their gradients and Adam stay fp32) halves that,
// which is what lets FSDP fit under a cap that the fp32 weights and Adam
// state do not.
constexpr int kCapUnits = 16;
constexpr int64_t kCapWidth = 2048;
constexpr int64_t kUnitBytes = (kCapWidth * kCapWidth + kCapWidth) * 4;
constexpr int64_t kWeightBytes = kCapUnits * kUnitBytes;
constexpr int64_t kCapBudget = 720LL << 20;
static_assert(kCapBudget < 3 * kWeightBytes, "the cap must not hold the weights and Adam state");

ddp::FSDPOptions capped_options_fsdp() { return ddp::FSDPOptions().param_dtype(at::kBFloat16).output_dtype(at::kFloat); }

DeferredSequential capped_model() {
  DeferredSequential layers;
  for (int i = 0; i < kCapUnits; ++i) layers.add([] { return torch::nn::Linear(kCapWidth, kCapWidth); });
  return layers;
}

// What training does before the cap, so the cap measures the model alone:
// the threads a step starts (and the malloc arenas they reserve) exist
// before the cap is set. Big allocations are mmapped, so what a tensor frees
// goes back at once.
void warm_up(const std::shared_ptr<ddp::ProcessGroup>& group) {
  at::set_num_threads(1);
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  {
    DeferredFsdp tiny(DeferredSequential().add([] { return torch::nn::Linear(64, 64); }), group, capped_options_fsdp());
    torch::optim::Adam optimizer(tiny.parameters());
    train(tiny, optimizer, group->rank(), 1, 64);
  }
  Sequential plain(torch::nn::Linear(64, 64));
  ddp::DistributedDataParallel<Sequential> tiny(plain, group);
  torch::optim::Adam optimizer(tiny->parameters());
  optimizer.zero_grad();
  tiny.forward(at::ones({2, 64})).sum().backward();
  optimizer.step();
}

// Caps this process's address space at what it maps now plus `budget`.
void cap_address_space(int64_t budget) {
  const int64_t mapped = status_bytes("VmSize");
  ASSERT_GT(mapped, 0);
  rlimit limit{static_cast<rlim_t>(mapped + budget), static_cast<rlim_t>(mapped + budget)};
  ASSERT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
  std::printf("rank cap: %lld MiB mapped before, cap %lld MiB above that\n", static_cast<long long>(mapped >> 20),
              static_cast<long long>(budget >> 20));
}

RanksOptions capped_options() {
  RanksOptions options;
  options.timeout = std::chrono::seconds(150);
  options.grace_after_failure = std::chrono::seconds(10);
  options.collective_timeout_seconds = 60;
  return options;
}

// DDP of the capped model runs out of memory under the cap, says so, and
// every rank exits (non-zero) instead of hanging.
TEST(FsdpDeferredUnderMemoryCap, DdpOfTheSameModelRunsOutOfMemory) {
  auto ranks = run_on_ranks(
      2,
      [](const std::shared_ptr<ddp::ProcessGroup>& group) {
        warm_up(group);
        cap_address_space(kCapBudget);
        torch::manual_seed(0);
        Sequential net;
        for (int i = 0; i < kCapUnits; ++i) net->push_back(torch::nn::Linear(kCapWidth, kCapWidth));
        std::printf("the whole model fits: %lld MiB\n", static_cast<long long>(kWeightBytes >> 20));
        std::fflush(stdout);
        ddp::DistributedDataParallel<Sequential> model(net, group);
        torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
        for (int64_t step = 0; step < 3; ++step) {
          optimizer.zero_grad();
          at::Tensor out = model.forward(at::randn({6, kCapWidth}));
          torch::nn::functional::mse_loss(out, at::zeros_like(out)).backward();
          optimizer.step();
        }
        ADD_FAILURE() << "DDP trained under a cap that cannot hold its weights and Adam state";
      },
      capped_options());
  std::string errors;
  for (const auto& rank : ranks) {
    EXPECT_FALSE(rank.timed_out) << describe_ranks(ranks);
    EXPECT_NE(rank.exit_code, 0) << describe_ranks(ranks);
    // The cap holds the model's weights; DDP's copies and state do not fit.
    EXPECT_NE(rank.out.find("the whole model fits"), std::string::npos) << describe_ranks(ranks);
    errors += rank.err;
  }
  EXPECT_NE(errors.find("memory"), std::string::npos) << describe_ranks(ranks);
  if (std::getenv("DDP_TEST_SHOW_RANKS")) std::printf("%s", describe_ranks(ranks).c_str());  // where each failed
}

// The same model trains at 2 ranks under the cap when built deferred, and
// ends where the model built whole (the old way, without a cap) ends: each
// rank's shards within 1e-6 (in fact equal). Phase 0 trains the old way and
// saves each rank's shards; phase 1 trains under the cap and compares.
TEST(FsdpDeferredUnderMemoryCap, DeferredFsdpTrainsTheModelAndMatchesTheModelBuiltWhole) {
  RanksTempDir dir;
  auto shards_file = [&](int rank) { return dir / ("shards_" + std::to_string(rank) + ".pt"); };
  auto train_capped_model = [](DeferredFsdp& model, int rank) {
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-3));
    train(model, optimizer, rank, 3, kCapWidth);
    optimizer.zero_grad();
  };
  auto phases = run_phases_on_ranks(
      {RanksPhase{2,
                  [&](const std::shared_ptr<ddp::ProcessGroup>& group) {
                    at::set_num_threads(1);
                    torch::manual_seed(0);
                    Sequential whole;
                    const auto layers = capped_model();
                    for (const auto& [name, factory] : layers.children()) whole->push_back(name, factory());
                    DeferredFsdp model(whole, group, capped_options_fsdp().min_num_params(1));
                    train_capped_model(model, group->rank());
                    ddp::StateDict shards;
                    for (const auto& shard : model.parameters()) shards.emplace_back(std::to_string(shards.size()), shard);
                    ddp::save_state_dict(shards, shards_file(group->rank()));
                    std::printf("rank %d old way: peak RSS %lld MiB\n", group->rank(),
                                static_cast<long long>(status_bytes("VmHWM") >> 20));
                  }},
       RanksPhase{2,
                  [&](const std::shared_ptr<ddp::ProcessGroup>& group) {
                    warm_up(group);
                    const int64_t rss_before = status_bytes("VmRSS");
                    const int64_t mapped = status_bytes("VmSize");
                    cap_address_space(kCapBudget);
                    torch::manual_seed(0);
                    DeferredFsdp model(capped_model(), group, capped_options_fsdp());
                    std::printf("rank %d deferred: RSS %lld MiB after construction (%lld before)\n", group->rank(),
                                static_cast<long long>(status_bytes("VmRSS") >> 20),
                                static_cast<long long>(rss_before >> 20));
                    train_capped_model(model, group->rank());
                    std::printf("rank %d deferred: peak RSS %lld MiB\n", group->rank(),
                                static_cast<long long>(status_bytes("VmHWM") >> 20));
                    std::printf("rank %d deferred: peak address space %lld MiB above the mapped before the cap\n",
                                group->rank(), static_cast<long long>((status_bytes("VmPeak") - mapped) >> 20));
                    auto expected = ddp::load_state_dict(shards_file(group->rank()));
                    auto shards = model.parameters();
                    ASSERT_EQ(expected.size(), shards.size());
                    double largest = 0;
                    for (size_t u = 0; u < shards.size(); ++u) {
                      largest = std::max(largest, (shards[u].detach() - expected[u].second).abs().max().item<double>());
                    }
                    std::printf("rank %d deferred: largest difference from the old way %g\n", group->rank(), largest);
                    EXPECT_LE(largest, 1e-6);
                  }}},
      capped_options());
  ASSERT_EQ(phases.size(), 2u) << describe_ranks(phases.front());
  expect_all_succeeded(phases[0]);
  expect_all_succeeded(phases[1]);
  // DDP_TEST_SHOW_RANKS=1: the ranks' measurements (peak RSS, the difference).
  if (std::getenv("DDP_TEST_SHOW_RANKS")) {
    std::printf("%s%s", describe_ranks(phases[0]).c_str(), describe_ranks(phases[1]).c_str());
  }
}

}  // namespace
