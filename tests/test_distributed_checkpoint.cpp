// Distributed checkpoints (include/ddp/distributed_checkpoint.h) on real
// ranks: written by every rank in parallel, loaded at another world size and
// under another strategy, read by PyTorch's DCP at 1 and 3 ranks (FSDP2 on
// gloo), and PyTorch's dcp.save read back by C++. Steps at different world
// sizes run as phases over files in a RanksTempDir; the Python side is
// tests/python/dcp_interop.py.
#include "support/fsdp_nets.h"
#include "support/fsdp_trainers.h"
#include "support/subprocess.h"
#include "support/ranks.h"
#include "support/resume_checks.h"
#include "support/torch_errors.h"

#include <ddp/checkpoint.h>
#include <ddp/distributed_checkpoint.h>
#include <ddp/process_group.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace ddp::testing;
namespace fs = std::filesystem;


// The file of rank `rank` (from 1, as DCP numbers them) holding its first
// box of every tensor.
std::string first_file_of(const std::string& dir, int rank) {
  const std::string prefix = "shard-0000" + std::to_string(rank) + "-model-00001-of-";
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) return entry.path().string();
  }
  return "";
}

// Resumes `spec` from the checkpoint `dcp` (see resume_checks.h).
void expect_dcp_resumes_to(const Group& group, TrainSpec spec, const std::string& dcp, const std::string& reference,
                           const std::string& label) {
  spec.load_dcp = dcp;
  expect_resumes_to(group, spec, reference, label);
}

// Checkpoints written at 2 ranks by FULL_SHARD, ZeRO-1 and DDP load at 3
// ranks and at 1 under every other strategy and land where uninterrupted DDP
// does; each FULL_SHARD rank reads about its share of the bytes, not all.
TEST(DistributedCheckpoint, ReshardsAcrossWorldSizesAndStrategies) {
  RanksTempDir dir;
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         for (const std::string model : {"seq", "tiny", "wrapped"}) {
           TrainSpec reference;
           reference.model = model;
           auto trained = train(group, reference);
           if (group->rank() == 0) ddp::save_state_dict(trained.state, dir / (model + ".ddp6.pt"));
           for (const std::string strategy : {"fsdp-full", "zero1", "ddp"}) {
             TrainSpec first = reference;
             first.strategy = strategy;
             first.steps = 3;
             first.save_dcp = dir / (model + "." + strategy);
             train(group, first);
           }
         }
         // Python's reader needs no more than the safetensors files.
         EXPECT_NE(first_file_of(dir / "seq.fsdp-full", 1), "");
         EXPECT_NE(first_file_of(dir / "seq.fsdp-full", 2), "");
         EXPECT_FALSE(fs::exists(dir / "seq.fsdp-full.partial"));
       }},
      {3,
       [&dir](const Group& group) {
         for (const std::string model : {"seq", "tiny", "wrapped"}) {
           const std::string reference = dir / (model + ".ddp6.pt");
           for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
                    {"fsdp-full", "fsdp-full"}, {"fsdp-full", "zero1"}, {"zero1", "fsdp-grad-op"},
                    {"ddp", "fsdp-full"}, {"fsdp-full", "fsdp-no-shard"}}) {
             TrainSpec s;
             s.model = model;
             s.strategy = to;
             expect_dcp_resumes_to(group, s, dir / (model + "." + from), reference, model + ": " + from + " -> " + to);
           }
         }
         TrainSpec s;
         s.strategy = "fsdp-full";
         s.load_dcp = dir / "seq.fsdp-full";
         s.steps = 0;
         const auto loaded = train(group, s).loaded;
         // A third of the parameters and Adam's moments, plus the scalar
         // steps: well under half of the checkpoint.
         EXPECT_GT(loaded.bytes_read, 0);
         EXPECT_LT(loaded.bytes_read, loaded.checkpoint_bytes * 0.4)
             << loaded.bytes_read << " of " << loaded.checkpoint_bytes << " bytes";
       }},
      {1,
       [&dir](const Group& group) {
         for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
                  {"fsdp-full", "ddp"}, {"zero1", "fsdp-full"}}) {
           TrainSpec s;
           s.strategy = to;
           expect_dcp_resumes_to(group, s, dir / ("seq." + from), dir / "seq.ddp6.pt", from + " -> " + to);
         }
       }},
  });
  expect_phases_succeeded(phases, 3);
}

// PyTorch reads a C++ FULL_SHARD checkpoint of 2 ranks at 1 rank (a plain
// module) and at 3 (FSDP2 on gloo): the loaded model's output matches C++'s
// within 1e-6, and its next 3 Adam steps land where C++'s DDP does. C++ at
// 2 ranks reads what dcp.save wrote at 3 and lands there too.
TEST(DistributedCheckpoint, PythonReadsOursAndWeReadPythonsAtOtherWorldSizes) {
  RanksTempDir dir;
  const std::string script = std::string(DDP_SOURCE_DIR) + "/tests/python/dcp_interop.py";
  auto phases = run_phases_on_ranks({
      {2,
       [&](const Group& group) {
         auto reference = train(group, TrainSpec{});
         TrainSpec init;
         init.steps = 0;
         auto initial = train(group, init);
         TrainSpec first;
         first.strategy = "fsdp-full";
         first.steps = 3;
         first.save_dcp = dir / "cpp";
         auto trained = train(group, first);
         if (group->rank() == 0) {
           ddp::save_state_dict(reference.state, dir / "ddp6.pt");
           ddp::save_state_dict(initial.state, dir / "init.pt");
           // The C++ model's output on a fixed batch, from its full weights.
           auto model = torch::nn::Sequential(torch::nn::Linear(10, 33), torch::nn::ReLU(), torch::nn::Linear(33, 17),
                                              torch::nn::Tanh(), torch::nn::Linear(17, 5));
           ddp::load_state_dict(*model, trained.state);
           at::Tensor x = global_batch(99).first;
           ddp::save_state_dict({{"x", x}, {"output", model->forward(x).detach()}}, dir / "io.pt");
         }
       }},
      // Python, alone: no C++ rank waits on it.
      {1,
       [&](const Group&) {
         const std::vector<std::vector<std::string>> runs = {
             {DDP_PYTHON, script, "load", dir / "cpp", dir / "io.pt", dir / "py1.pt"},
             {DDP_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", script, "load",
              dir / "cpp", dir / "io.pt", dir / "py3.pt"},
             {DDP_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", script, "save",
              dir / "init.pt", dir / "python3"}};
         // Python must not see this rank's own process-group variables.
         RunOptions options;
         options.unset_env = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                              "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID"};
         for (const auto& command : runs) {
           auto r = run_process(command, options);
           ASSERT_EQ(r.exit_code, 0) << r.describe();
         }
         at::Tensor cpp_output;
         for (auto& [key, tensor] : ddp::load_state_dict(dir / "io.pt")) {
           if (key == "output") cpp_output = tensor;
         }
         const auto ddp6 = ddp::load_state_dict(dir / "ddp6.pt");
         for (const std::string out : {"py1.pt", "py3.pt"}) {
           ddp::StateDict final_state;
           at::Tensor output;
           for (auto& [key, tensor] : ddp::load_state_dict(dir / out)) {
             if (key == "output") output = tensor;
             else final_state.emplace_back(key.substr(6), tensor);  // "final."
           }
           ASSERT_TRUE(output.defined()) << out;
           EXPECT_LE((output - cpp_output).abs().max().item<double>(), 1e-6) << out;
           EXPECT_LE(max_difference(ddp6, final_state), 1e-5) << out << ": Python's 3 steps after the load";
         }
       }},
      {2,
       [&dir](const Group& group) {
         TrainSpec s;
         s.strategy = "fsdp-full";
         expect_dcp_resumes_to(group, s, dir / "python3", dir / "ddp6.pt", "dcp.save at 3 ranks -> C++ FSDP");
         s.strategy = "ddp";
         expect_dcp_resumes_to(group, s, dir / "python3", dir / "ddp6.pt", "dcp.save at 3 ranks -> C++ DDP");
       }},
  });
  expect_phases_succeeded(phases, 3);
}

// Loads that cannot work say why; a second save replaces the first whole.
TEST(DistributedCheckpoint, RefusesWhatItCannotLoadAndReplacesWhole) {
  RanksTempDir dir;
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         TrainSpec save;
         save.strategy = "fsdp-full";
         save.steps = 3;
         save.save_dcp = dir / "ckpt";
         train(group, save);
         save.steps = 4;
         auto second = train(group, save).state;  // over the first
         TrainSpec check;
         check.strategy = "ddp";
         check.steps = 0;
         check.load_dcp = dir / "ckpt";
         if (group->rank() == 0) EXPECT_EQ(max_difference(second, train(group, check).state), 0.0);
         else train(group, check);
         EXPECT_FALSE(fs::exists(dir / "ckpt.partial"));
         EXPECT_FALSE(fs::exists(dir / "ckpt.old"));

         TrainSpec other;
         other.strategy = "fsdp-full";
         other.model = "tiny";
         other.load_dcp = dir / "ckpt";
         std::string error = error_of([&] { train(group, other); });
         EXPECT_NE(error.find("'model.0.weight' has shape [33, 10] in the checkpoint but [1, 10] in the model"),
                   std::string::npos)
             << error;
         other.model = "seq";
         other.load_dcp = dir / "nowhere";
         error = error_of([&] { train(group, other); });
         EXPECT_NE(error.find("no checkpoint directory"), std::string::npos) << error;
         group->barrier();
         if (group->rank() == 0) {
           // A truncated file: named, with what is wrong with it.
           fs::copy(dir / "ckpt", dir / "cut");
           const auto victim = first_file_of(dir / "cut", 2);
           fs::resize_file(victim, fs::file_size(victim) / 2);
         }
         group->barrier();
         other.load_dcp = dir / "cut";
         error = error_of([&] { train(group, other); });
         EXPECT_NE(error.find(fs::path(first_file_of(dir / "cut", 2)).filename().string()), std::string::npos) << error;
         EXPECT_NE(error.find("truncated"), std::string::npos) << error;
       }},
  });
  expect_phases_succeeded(phases, 1);
}

}  // namespace
