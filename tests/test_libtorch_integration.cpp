// ddp inside LibTorch programs as people write them: the sampler in
// torch::data loaders, every kind of module under DistributedDataParallel,
// one-call checkpoints in Python's key order, warnings and errors a user
// reads. A world of one process; what needs several ranks is in
// test_integration_ranks.cpp.

#include <ddp/ddp.h>

#include <gtest/gtest.h>
#include <support/subprocess.h>

#include <torch/data/dataloader.h>
#include <torch/data/datasets/base.h>
#include <torch/data/datasets/map.h>
#include <torch/data/datasets/chunk.h>
#include <torch/data/datasets/shared.h>
#include <torch/data/samplers/sequential.h>
#include <torch/data/samplers/serialize.h>
#include <torch/data/transforms/stack.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/script.h>

#include <filesystem>
#include <map>
#include <set>

namespace fs = std::filesystem;

namespace {

// Example i is the tensor {i}, so a batch shows which indices it holds.
class IndexDataset : public torch::data::datasets::Dataset<IndexDataset> {
 public:
  explicit IndexDataset(size_t n) : n_(n) {}
  torch::data::Example<> get(size_t index) override {
    return {at::full({1}, static_cast<int64_t>(index), at::kLong), at::zeros({}, at::kLong)};
  }
  std::optional<size_t> size() const override { return n_; }

 private:
  size_t n_;
};

template <typename Loader>
std::vector<int64_t> one_pass(Loader& loader) {
  std::vector<int64_t> seen;
  for (auto& batch : loader) {
    auto flat = batch.data.reshape({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) seen.push_back(flat[i].template item<int64_t>());
  }
  return seen;
}

std::string temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("ddp_integration_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

TEST(SamplerInDataLoader, EveryEpochIsPythonsShardWithoutRebuildingTheLoader) {
  for (bool drop_last : {false, true}) {
    const auto options = ddp::SamplerOptions(3, 1).seed(7).drop_last(drop_last);
    ddp::DistributedSampler sampler(50, options);
    // The loader takes a copy; set_epoch on ours reaches it.
    auto loader = torch::data::make_data_loader(IndexDataset(50).map(torch::data::transforms::Stack<>()), sampler,
                                                torch::data::DataLoaderOptions().batch_size(4).workers(2));
    for (int64_t epoch = 0; epoch < 4; ++epoch) {
      sampler.set_epoch(epoch);
      EXPECT_EQ(one_pass(*loader), ddp::distributed_sampler_indices(50, options, epoch))
          << "epoch " << epoch << " drop_last " << drop_last;
    }
  }
}

TEST(SamplerInDataLoader, LoaderDropLastDropsTheShortBatchOnly) {
  const auto options = ddp::SamplerOptions(2, 0).shuffle(false);
  ddp::DistributedSampler sampler(11, options);  // 6 indices on rank 0
  auto loader = torch::data::make_data_loader(IndexDataset(11).map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions().batch_size(4).drop_last(true));
  EXPECT_EQ(one_pass(*loader), (std::vector<int64_t>{0, 2, 4, 6}));
}

TEST(SamplerInDataLoader, SavedPositionResumesTheInterruptedEpoch) {
  const auto options = ddp::SamplerOptions(2, 1).seed(3);
  const auto dir = temp_dir("sampler");
  std::vector<int64_t> first_two_batches;
  {
    ddp::DistributedSampler sampler(40, options);
    sampler.set_epoch(5);
    auto loader = torch::data::make_data_loader(IndexDataset(40).map(torch::data::transforms::Stack<>()), sampler,
                                                torch::data::DataLoaderOptions().batch_size(3));
    int batches = 0;
    for (auto& batch : *loader) {
      for (int64_t i = 0; i < batch.data.size(0); ++i) first_two_batches.push_back(batch.data[i][0].item<int64_t>());
      if (++batches == 2) break;
    }
    EXPECT_EQ(sampler.position(), 6);
    torch::save(sampler, dir + "/sampler.pt");  // LibTorch's sampler serialisation
  }
  ddp::DistributedSampler resumed(40, options);
  torch::load(resumed, dir + "/sampler.pt");
  EXPECT_EQ(resumed.epoch(), 5);
  auto loader = torch::data::make_data_loader(IndexDataset(40).map(torch::data::transforms::Stack<>()), resumed,
                                              torch::data::DataLoaderOptions().batch_size(3));
  auto rest = one_pass(*loader);
  auto whole = ddp::distributed_sampler_indices(40, options, 5);
  first_two_batches.insert(first_two_batches.end(), rest.begin(), rest.end());
  EXPECT_EQ(first_two_batches, whole);
  // The next pass is a whole epoch again.
  EXPECT_EQ(one_pass(*loader), whole);

  ddp::DistributedSampler other_world(40, ddp::SamplerOptions(4, 1).seed(3));
  try {
    torch::load(other_world, dir + "/sampler.pt");
    FAIL() << "a sampler saved at another world size loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_replicas=2"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// Data that does not fit in memory: a ChunkDataset reads chunks lazily, and
// ddp::DistributedSampler as its chunk sampler gives each rank its own
// chunks, Python's shard of the chunk indices.
class CountingChunkReader : public torch::data::datasets::ChunkDataReader<int64_t> {
 public:
  using BatchType = std::vector<int64_t>;
  static constexpr size_t kChunks = 10;
  static constexpr int64_t kPerChunk = 4;
  std::vector<int64_t> read_chunk(size_t chunk) override {
    std::vector<int64_t> examples;
    for (int64_t i = 0; i < kPerChunk; ++i) examples.push_back(static_cast<int64_t>(chunk) * 100 + i);
    return examples;
  }
  size_t chunk_count() override { return kChunks; }
  void reset() override {}
};

TEST(SamplerInDataLoader, ShardsTheChunksOfAChunkDataset) {
  std::multiset<int64_t> all_chunks;
  for (int64_t rank = 0; rank < 3; ++rank) {
    const auto options = ddp::SamplerOptions(3, rank).seed(11);
    ddp::DistributedSampler chunk_sampler(0, options);  // the dataset resets it to the chunk count
    chunk_sampler.set_epoch(2);
    using Chunks = torch::data::datasets::ChunkDataset<CountingChunkReader, ddp::DistributedSampler,
                                                       torch::data::samplers::SequentialSampler>;
    auto dataset = torch::data::datasets::make_shared_dataset<Chunks>(
        CountingChunkReader(), chunk_sampler, torch::data::samplers::SequentialSampler(0),
        torch::data::datasets::ChunkDatasetOptions(/*preloader_count=*/1, /*batch_size=*/4));
    auto loader = torch::data::make_data_loader(dataset, torch::data::DataLoaderOptions().batch_size(4));
    std::set<int64_t> chunks;
    for (auto& batch : *loader) {
      for (int64_t example : batch) chunks.insert(example / 100);
    }
    auto expected = ddp::distributed_sampler_indices(CountingChunkReader::kChunks, options, 2);
    EXPECT_EQ(chunks, std::set<int64_t>(expected.begin(), expected.end())) << "rank " << rank;
    all_chunks.insert(expected.begin(), expected.end());
  }
  for (int64_t c = 0; c < static_cast<int64_t>(CountingChunkReader::kChunks); ++c) EXPECT_GE(all_chunks.count(c), 1u);
}

// docs/chunk_datasets.md: 10 chunks on 3 ranks pad to 12 slots, so the
// first 2 chunks of the epoch's order are read whole, twice; drop_last reads
// 9 chunks, each once.
TEST(SamplerInDataLoader, PaddingRepeatsWholeChunks) {
  for (bool drop_last : {false, true}) {
    std::map<int64_t, int> examples_per_chunk;
    for (int64_t rank = 0; rank < 3; ++rank) {
      const auto options = ddp::SamplerOptions(3, rank).seed(11).drop_last(drop_last);
      ddp::DistributedSampler chunk_sampler(0, options);
      using Chunks = torch::data::datasets::ChunkDataset<CountingChunkReader, ddp::DistributedSampler,
                                                         torch::data::samplers::SequentialSampler>;
      auto dataset = torch::data::datasets::make_shared_dataset<Chunks>(
          CountingChunkReader(), chunk_sampler, torch::data::samplers::SequentialSampler(0),
          torch::data::datasets::ChunkDatasetOptions(/*preloader_count=*/1, /*batch_size=*/4));
      auto loader = torch::data::make_data_loader(dataset, torch::data::DataLoaderOptions().batch_size(4));
      for (auto& batch : *loader) {
        for (int64_t example : batch) ++examples_per_chunk[example / 100];
      }
    }
    auto order = ddp::distributed_sampler_indices(CountingChunkReader::kChunks, ddp::SamplerOptions(1, 0).seed(11), 0);
    int twice = 0, once = 0, never = 0;
    for (int64_t c = 0; c < static_cast<int64_t>(CountingChunkReader::kChunks); ++c) {
      const int n = examples_per_chunk[c];
      EXPECT_EQ(n % CountingChunkReader::kPerChunk, 0) << "chunk " << c << " was read in part";
      twice += n == 2 * CountingChunkReader::kPerChunk;
      once += n == CountingChunkReader::kPerChunk;
      never += n == 0;
    }
    SCOPED_TRACE(drop_last ? "drop_last" : "padded");
    EXPECT_EQ(twice, drop_last ? 0 : 2);
    EXPECT_EQ(once, drop_last ? 9 : 8);
    EXPECT_EQ(never, drop_last ? 1 : 0);
    if (!drop_last) {
      // The repeated ones are the first two of the epoch's (unpadded) order.
      EXPECT_EQ(examples_per_chunk[order[0]], 2 * CountingChunkReader::kPerChunk);
      EXPECT_EQ(examples_per_chunk[order[1]], 2 * CountingChunkReader::kPerChunk);
    }
  }
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 5));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
    fc2 = register_module("fc2", torch::nn::Linear(5, 2));
    scale = register_buffer("scale", at::ones({1}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(bn->forward(fc1->forward(x))) * scale; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Net);

std::vector<std::string> keys_of(const ddp::StateDict& state) {
  std::vector<std::string> keys;
  for (const auto& [key, value] : state) keys.push_back(key);
  return keys;
}

TEST(Checkpoints, KeyOrderIsPythonsStateDictOrder) {
  // What Python's model.state_dict() lists for the same module tree: per
  // module its own parameters, then its own buffers, then the children.
  const std::vector<std::string> python_order = {
      "scale",          "fc1.weight",      "fc1.bias",         "bn.weight", "bn.bias", "bn.running_mean",
      "bn.running_var", "bn.num_batches_tracked", "fc2.weight", "fc2.bias"};
  Net net;
  EXPECT_EQ(keys_of(ddp::state_dict(*net)), python_order);
}

TEST(Checkpoints, PythonLoadsOneCallSavesStrictlyInItsOwnKeyOrder) {
  const auto dir = temp_dir("python_order");
  torch::nn::Sequential model(torch::nn::Linear(4, 5), torch::nn::BatchNorm1d(5), torch::nn::Linear(5, 2));
  ddp::save(model, dir + "/seq.pt");
  auto r = ddp::testing::run_process(
      {DDP_PYTHON, "-c",
       "import sys, torch\n"
       "sd = torch.load(sys.argv[1], weights_only=True)\n"
       "m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))\n"
       "m.load_state_dict(sd, strict=True)\n"
       "assert list(sd.keys()) == list(m.state_dict().keys()), (list(sd), list(m.state_dict()))\n"
       "print('python order ok')\n",
       dir + "/seq.pt"});
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("python order ok"), std::string::npos) << r.describe();
  fs::remove_all(dir);
}

TEST(Checkpoints, OneCallSaveAndLoadForEveryModuleKind) {
  const auto dir = temp_dir("save");
  torch::manual_seed(1);
  Net net;
  ddp::save(net, dir + "/holder.pt");
  torch::manual_seed(2);
  Net other;
  ddp::load(other, dir + "/holder.pt");
  EXPECT_TRUE(other->fc1->weight.equal(net->fc1->weight));

  auto as_ptr = std::make_shared<NetImpl>();
  ddp::load(as_ptr, dir + "/holder.pt");
  EXPECT_TRUE(as_ptr->fc2->bias.equal(net->fc2->bias));

  torch::nn::AnyModule any(Net{});
  ddp::load(any, dir + "/holder.pt");
  EXPECT_TRUE(any.get<Net>()->fc2->weight.equal(net->fc2->weight));

  auto group = ddp::init_process_group();
  ddp::DistributedDataParallel<Net> wrapped(Net(), group);
  ddp::load(wrapped, dir + "/holder.pt");
  EXPECT_TRUE(wrapped->fc1->bias.equal(net->fc1->bias));
  ddp::save(wrapped, dir + "/wrapped.pt");
  EXPECT_EQ(keys_of(ddp::load_state_dict(dir + "/wrapped.pt")), keys_of(ddp::state_dict(*net)));

  // A wrong file fails with its cause, naming the entry.
  torch::nn::Linear small(2, 2);
  try {
    ddp::load(small, dir + "/holder.pt");
    FAIL() << "loaded a state dict into the wrong module";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'weight'"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// Plain LibTorch's gradient for the same module and data: a world of one
// must leave gradients exactly as they are.
template <typename Forward>
void expect_grads_match_plain(Forward&& forward_and_params) {
  auto [ddp_grads, plain_grads] = forward_and_params();
  ASSERT_EQ(ddp_grads.size(), plain_grads.size());
  ASSERT_FALSE(ddp_grads.empty());
  for (size_t i = 0; i < ddp_grads.size(); ++i) {
    ASSERT_TRUE(ddp_grads[i].defined());
    EXPECT_TRUE(ddp_grads[i].allclose(plain_grads[i], 0, 0)) << "parameter " << i;
  }
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().clone());
  return g;
}

TEST(AnyModuleKind, HolderSharedPtrAnyModuleAndBaseModuleTrain) {
  auto group = ddp::init_process_group();
  at::Tensor x = at::randn({6, 4});
  auto plain = [&](const std::shared_ptr<NetImpl>& reference) {
    reference->forward(x).sum().backward();
    return grads_of(reference->parameters());
  };
  torch::manual_seed(3);
  auto reference = std::make_shared<NetImpl>();
  auto expected = plain(reference);

  torch::manual_seed(3);
  ddp::DistributedDataParallel<std::shared_ptr<NetImpl>> by_ptr(std::make_shared<NetImpl>(), group);
  by_ptr(x).sum().backward();
  expect_grads_match_plain([&] { return std::make_pair(grads_of(by_ptr.parameters()), expected); });

  torch::manual_seed(3);
  ddp::DistributedDataParallel<torch::nn::AnyModule> any(torch::nn::AnyModule(Net()), group);
  any.forward(x).sum().backward();
  expect_grads_match_plain([&] { return std::make_pair(grads_of(any.parameters()), expected); });

  // A base-class pointer: the forward runs through forward_with.
  torch::manual_seed(3);
  auto concrete = std::make_shared<NetImpl>();
  ddp::DistributedDataParallel<std::shared_ptr<torch::nn::Module>> base(concrete, group);
  base.forward_with([&] { return concrete->forward(x); }).sum().backward();
  expect_grads_match_plain([&] { return std::make_pair(grads_of(base.parameters()), expected); });
}

TEST(AnyModuleKind, TorchScriptModuleTrains) {
  // A scripted module made here through torch::jit's own API stands in for
  // one from torch::jit::load (test_torchscript.cpp loads Python's).
  torch::jit::Module module("m");
  module.register_parameter("w", at::randn({4, 3}).requires_grad_(), /*is_buffer=*/false);
  module.register_parameter("b", at::zeros({3}).requires_grad_(), false);
  module.define(R"(
    def forward(self, x):
        return (x @ self.w + self.b).relu().sum()
  )");
  at::Tensor x = at::randn({5, 4});
  auto w = module.attr("w").toTensor();
  auto b = module.attr("b").toTensor();
  auto reference_w = w.detach().clone().requires_grad_();
  auto reference_b = b.detach().clone().requires_grad_();
  (x.matmul(reference_w) + reference_b).relu().sum().backward();

  auto group = ddp::init_process_group();
  ddp::DistributedDataParallel<torch::jit::Module> model(module, group, ddp::DDPOptions().find_unused_parameters(true));
  c10::IValue loss = model.forward(x);
  loss.toTensor().backward();
  ASSERT_EQ(model.parameters().size(), 2u);
  EXPECT_TRUE(w.grad().allclose(reference_w.grad()));
  EXPECT_TRUE(b.grad().allclose(reference_b.grad()));
  EXPECT_EQ(keys_of(model.state_dict()), (std::vector<std::string>{"w", "b"}));
  // The IValue-vector form works too.
  model.forward(std::vector<c10::IValue>{x});
}

TEST(SparseGradients, SparseEmbeddingIsRefusedAtConstructionNamingIt) {
  auto group = ddp::init_process_group();
  torch::nn::Sequential model(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)),
                              torch::nn::Linear(3, 1));
  try {
    ddp::DistributedDataParallel<torch::nn::Sequential> wrapped(model, group);
    FAIL() << "a sparse embedding was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'0.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sparse(false)"), std::string::npos) << e.what();
  }
}

TEST(Errors, DdpErrorsCarryNoBacktrace) {
  try {
    ddp::DistributedSampler(10, ddp::SamplerOptions(2, 5));
    FAIL();
  } catch (const std::exception& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("rank 5"), std::string::npos) << what;
    EXPECT_EQ(what.find("frame #"), std::string::npos) << what;
    EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
  }
}

}  // namespace
