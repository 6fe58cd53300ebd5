#include <ddp/snapshot.h>
#include <ddp/snapshot_saver.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <support/hostile_files.h>
#include <support/ranks.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>
#include <ddp/checkpoint.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>

namespace fs = std::filesystem;

namespace {

using ddp::testing::error_of;

void train_steps(torch::nn::Linear& model, torch::optim::Optimizer& optimizer, int first, int count) {
  for (int s = first; s < first + count; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(s);
    at::Tensor x = at::randn({8, 5}, generator);
    at::Tensor y = at::randint(0, 3, {8}, generator, at::kLong);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    optimizer.step();
  }
}

template <typename Optimizer, typename Options>
void check_resume_is_exact(Options options) {
  auto dir = ddp::testing::make_temp_dir();
  torch::manual_seed(1);
  torch::nn::Linear straight(5, 3);
  Optimizer straight_opt(straight->parameters(), options);
  train_steps(straight, straight_opt, 0, 10);

  torch::manual_seed(1);
  torch::nn::Linear first(5, 3);
  Optimizer first_opt(first->parameters(), options);
  train_steps(first, first_opt, 0, 4);
  ddp::save_snapshot(ddp::capture_snapshot(*first, first_opt, 3, 4), dir + "/s.pt");

  torch::manual_seed(99);  // different weights: the snapshot must replace them
  torch::nn::Linear resumed(5, 3);
  Optimizer resumed_opt(resumed->parameters(), options);
  auto snapshot = ddp::load_snapshot(dir + "/s.pt");
  EXPECT_EQ(snapshot.epoch, 3);
  EXPECT_EQ(snapshot.step, 4);
  EXPECT_EQ(snapshot.sampler_epoch, 4);
  ddp::restore_snapshot(snapshot, *resumed, resumed_opt);
  train_steps(resumed, resumed_opt, 4, 6);
  EXPECT_TRUE(at::equal(resumed->weight, straight->weight));
  EXPECT_TRUE(at::equal(resumed->bias, straight->bias));
  fs::remove_all(dir);
}

TEST(Snapshot, AdamResumesBitIdentically) { check_resume_is_exact<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)); }
TEST(Snapshot, AdamWWithAmsgradResumesBitIdentically) {
  check_resume_is_exact<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).amsgrad(true));
}
TEST(Snapshot, SgdWithMomentumResumesBitIdentically) {
  check_resume_is_exact<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9));
}

TEST(Snapshot, RestoresTheRngState) {
  auto dir = ddp::testing::make_temp_dir();
  torch::nn::Linear model(2, 2);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  torch::manual_seed(7);
  ddp::save_snapshot(ddp::capture_snapshot(*model, optimizer, 0, 0), dir + "/s.pt");
  at::Tensor expected = at::rand({4});
  at::rand({100});
  ddp::restore_snapshot(ddp::load_snapshot(dir + "/s.pt"), *model, optimizer);
  EXPECT_TRUE(at::equal(at::rand({4}), expected));
  fs::remove_all(dir);
}

class SnapshotFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = ddp::testing::make_temp_dir();
    saver = std::make_unique<ddp::SnapshotSaver>(dir);
    torch::manual_seed(0);
    train_steps(model, optimizer, 0, 2);
  }
  void TearDown() override {
    saver.reset();
    fs::remove_all(dir);
  }
  std::string write(int64_t epoch) { return saver->save(ddp::capture_snapshot(*model, optimizer, epoch, epoch * 10)); }
  std::string dir;
  std::unique_ptr<ddp::SnapshotSaver> saver;  // keep 2
  torch::nn::Linear model{5, 3};
  torch::optim::Adam optimizer{model->parameters(), torch::optim::AdamOptions(1e-3)};
};

TEST_F(SnapshotFiles, KeepsTheTwoNewest) {
  write(0);
  write(10);
  write(20);
  EXPECT_FALSE(fs::exists(dir + "/snapshot_0.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_10.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_20.pt"));
  EXPECT_EQ(ddp::load_newest_snapshot(dir)->epoch, 20);
}

TEST_F(SnapshotFiles, TruncatedNewestFallsBackToThePreviousOne) {
  write(10);
  auto newest = write(20);
  fs::resize_file(newest, fs::file_size(newest) - 100);
  std::vector<std::string> skipped;
  auto snapshot = ddp::load_newest_snapshot(dir, &skipped);
  ASSERT_TRUE(snapshot.has_value());
  EXPECT_EQ(snapshot->epoch, 10);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("snapshot_20.pt"), std::string::npos) << skipped[0];
}

TEST_F(SnapshotFiles, FlippedByteIsCaughtByTheChecksum) {
  auto path = write(5);
  // Corrupt one byte of the model's weights: the zip container's layout is
  // intact, only the contents changed.
  auto state = ddp::state_dict(*model);
  at::Tensor weight = state[0].second.contiguous();
  std::string needle(static_cast<const char*>(weight.data_ptr()), 16);
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  std::string contents((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  auto at_pos = contents.find(needle);
  ASSERT_NE(at_pos, std::string::npos);
  file.seekp(static_cast<std::streamoff>(at_pos + 3));
  file.put(static_cast<char>(contents[at_pos + 3] ^ 0x10));
  file.close();
  auto message = error_of([&] { ddp::load_snapshot(path); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_TRUE(message.find("checksum") != std::string::npos || message.find("CRC") != std::string::npos ||
              message.find("not a complete") != std::string::npos)
      << message;
}

TEST_F(SnapshotFiles, RefusesOtherFilesWithReasons) {
  ddp::save_state_dict(ddp::state_dict(*model), dir + "/weights.pt");
  auto message = error_of([&] { ddp::load_snapshot(dir + "/weights.pt"); });
  EXPECT_NE(message.find("it has no 'format' entry"), std::string::npos) << message;

  c10::impl::GenericDict future(c10::AnyType::get(), c10::AnyType::get());
  future.insert("format", std::string("ddp.snapshot"));
  future.insert("version", int64_t{99});
  ddp::save_value(future, dir + "/future.pt");
  message = error_of([&] { ddp::load_snapshot(dir + "/future.pt"); });
  EXPECT_NE(message.find("format version 99"), std::string::npos) << message;

  EXPECT_FALSE(ddp::load_newest_snapshot(dir + "/nowhere").has_value());
}

TEST_F(SnapshotFiles, AnInterruptedSaveLeavesThePreviousSnapshotLoadable) {
  write(10);
  // A crash mid-save leaves at most a temporary file next to the snapshots.
  std::ofstream(dir + "/snapshot_20.pt.tmp.12345") << "half a file";
  auto snapshot = ddp::load_newest_snapshot(dir);
  ASSERT_TRUE(snapshot.has_value());
  EXPECT_EQ(snapshot->epoch, 10);
}

// Issue 12 item 7: an unreadable file named like a snapshot used to count as one of the two
// kept, so the valid fallback was deleted after one save.
TEST_F(SnapshotFiles, AJunkFileNamedLikeASnapshotNeverPushesOutTheValidFallback) {
  write(10);
  std::ofstream(dir + "/snapshot_9999.pt") << "not a snapshot";
  auto newest = write(20);
  EXPECT_TRUE(fs::exists(dir + "/snapshot_10.pt")) << "the valid fallback was deleted";
  EXPECT_TRUE(fs::exists(newest));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_9999.pt")) << "a file that is not ours to judge was deleted";
  // Once two valid ones are newer, the oldest valid one goes, the junk stays.
  write(30);
  EXPECT_FALSE(fs::exists(dir + "/snapshot_10.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_20.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_30.pt"));
  EXPECT_EQ(ddp::load_newest_snapshot(dir)->epoch, 30);
}

// A damaged newer snapshot does not count either: the valid one before it survives.
TEST_F(SnapshotFiles, ADamagedSnapshotDoesNotCountTowardTheKeptOnes) {
  write(10);
  auto damaged = write(20);
  fs::resize_file(damaged, fs::file_size(damaged) / 2);
  write(30);
  EXPECT_TRUE(fs::exists(dir + "/snapshot_10.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_30.pt"));
}

// The saver's one retention policy on snapshot files: a valid snapshot of
// another model neither counts nor goes, and the one this process resumed
// from stays.
TEST_F(SnapshotFiles, AnotherModelsSnapshotAndTheOneResumedFromAreNeverPruned) {
  const std::string foreign = dir + "/snapshot_7.pt";
  ddp::save_snapshot(ddp::capture_snapshot(ddp::StateDict{{"another", at::ones({2})}}, c10::IValue(), 7, 5), foreign);
  const std::string resumed = write(1);  // step 10
  ASSERT_EQ(ddp::load_newest_snapshot(dir)->epoch, 1);
  write(2);
  write(3);
  write(4);
  EXPECT_TRUE(fs::exists(foreign)) << "another model's snapshot was removed";
  EXPECT_TRUE(fs::exists(resumed)) << "the snapshot resumed from was removed";
  EXPECT_FALSE(fs::exists(dir + "/snapshot_2.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_3.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_4.pt"));
}

// Issue 12 item 8: temporaries of killed writers ("<name>.tmp.<pid>") are removed at the next
// successful save in their directory; those of live processes, and other files, stay.
TEST_F(SnapshotFiles, StaleTemporariesOfDeadWritersAreRemovedAtTheNextSave) {
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);  // now dead, and reaped
  const std::string dead = std::to_string(child);
  std::ofstream(dir + "/model_225.pt.tmp." + dead) << "half a file";
  std::ofstream(dir + "/snapshot_7.pt.tmp." + dead) << "half a file";
  std::ofstream(dir + "/model_9.pt.tmp." + dead + ".3f9a20c1") << "half a file, named as writers now name them";
  std::ofstream(dir + "/model_1.pt.tmp.1") << "pid 1 is alive";  // init: never stale
  std::ofstream(dir + "/notes.tmp.txt") << "not our pattern";
  fs::create_directory(dir + "/keep.tmp." + dead);  // not a file we write
  write(3);
  EXPECT_FALSE(fs::exists(dir + "/model_225.pt.tmp." + dead));
  EXPECT_FALSE(fs::exists(dir + "/snapshot_7.pt.tmp." + dead));
  EXPECT_FALSE(fs::exists(dir + "/model_9.pt.tmp." + dead + ".3f9a20c1"));
  EXPECT_TRUE(fs::exists(dir + "/model_1.pt.tmp.1"));
  EXPECT_TRUE(fs::exists(dir + "/notes.tmp.txt"));
  EXPECT_TRUE(fs::exists(dir + "/keep.tmp." + dead));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_3.pt"));
}

// Issue 34 item 5: links planted at the names a snapshot's writer used
// (its old temporary, "<name>.tmp.<pid>", and the snapshot's own name) made
// every snapshot overwrite the links' target, then become a link to it.
TEST_F(SnapshotFiles, LinksPlantedAtSnapshotNamesAreNeverFollowed) {
  const std::string victim = dir + "/victim.txt";
  std::ofstream(victim) << "precious";
  auto victim_text = [&] {
    std::ifstream in(victim);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  for (int epoch = 0; epoch < 4; ++epoch) {
    fs::create_symlink(victim, dir + "/snapshot_" + std::to_string(epoch) + ".pt.tmp." + std::to_string(::getpid()));
    const std::string written = write(epoch);
    EXPECT_FALSE(fs::is_symlink(written)) << written;
  }
  EXPECT_EQ(victim_text(), "precious");
  EXPECT_EQ(ddp::load_newest_snapshot(dir)->epoch, 3);

  const std::string planted = dir + "/snapshot_8.pt";
  fs::create_symlink(victim, planted);
  auto message = error_of([&] { write(8); });
  EXPECT_NE(message.find("'" + planted + "': it is a symbolic link"), std::string::npos) << message;
  EXPECT_EQ(victim_text(), "precious");
  EXPECT_EQ(ddp::load_newest_snapshot(dir)->epoch, 3);
}

// Issue 12 item 10: a legacy (non-zip) torch.save file is named as such, with the conversion,
// not reported as an incomplete or corrupt file.
TEST_F(SnapshotFiles, ALegacyTorchSaveFileIsNamedWithItsConversion) {
  const std::string legacy = dir + "/legacy.pt";
  auto made = ddp::testing::run_process(
      {DDP_PYTHON, "-c",
       "import sys, torch\n"
       "torch.save({'w': torch.ones(2)}, sys.argv[1], _use_new_zipfile_serialization=False)\n",
       legacy});
  ASSERT_EQ(made.exit_code, 0) << made.describe();
  auto message = error_of([&] { ddp::load_state_dict(legacy); });
  EXPECT_NE(message.find("'" + legacy + "': it was written in torch.save's legacy (non-zip) format"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("_use_new_zipfile_serialization=True"), std::string::npos) << message;
  EXPECT_EQ(message.find("not a complete torch.save file"), std::string::npos) << message;
}

TEST_F(SnapshotFiles, PythonLoadsTheOptimizerStateIntoTorchOptim) {
  auto path = write(3);
  auto result = ddp::testing::run_process(
      {DDP_PYTHON, "-c",
       "import sys, torch\n"
       "s = torch.load(sys.argv[1])\n"  // weights_only=True
       "p = s['payload']\n"
       "model = torch.nn.Linear(5, 3)\n"
       "model.load_state_dict(p['model'])\n"
       "opt = torch.optim.Adam(model.parameters(), lr=0.5)\n"
       "opt.load_state_dict(p['optimizer'])\n"
       "print('format', s['format'], 'version', s['version'], 'epoch', p['epoch'], 'step', p['step'])\n"
       "print('lr', opt.param_groups[0]['lr'], 'adam_step', float(opt.state[model.weight]['step']))\n",
       path});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.out.find("format ddp.snapshot version 1 epoch 3 step 30"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("lr 0.001 adam_step 2.0"), std::string::npos) << result.out;
}

}  // namespace

namespace {

TEST(Snapshot, AFailedOptimizerLoadChangesNothing) {
  torch::manual_seed(0);
  torch::nn::Linear model(5, 3);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  train_steps(model, optimizer, 0, 2);
  auto good = ddp::optimizer_state_dict(optimizer);
  // The second parameter's moment has the wrong shape.
  auto bad = good.toGenericDict().copy();
  auto state = bad.at("state").toGenericDict().copy();
  auto second = state.at(int64_t{1}).toGenericDict().copy();
  second.insert_or_assign("exp_avg", at::zeros({7}));
  state.insert_or_assign(int64_t{1}, second);
  bad.insert_or_assign("state", state);
  auto groups = bad.at("param_groups").toListRef();
  auto group = groups[0].toGenericDict().copy();
  group.insert_or_assign("lr", 0.5);
  c10::impl::GenericList new_groups(c10::AnyType::get());
  new_groups.push_back(group);
  bad.insert_or_assign("param_groups", new_groups);

  auto message = error_of([&] { ddp::load_optimizer_state_dict(optimizer, bad); });
  EXPECT_NE(message.find("'exp_avg' of parameter 1 has shape [7]"), std::string::npos) << message;
  // Neither the learning rate nor any parameter's state changed.
  auto& options = static_cast<torch::optim::AdamOptions&>(optimizer.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(options.lr(), 1e-3);
  auto after = ddp::optimizer_state_dict(optimizer).toGenericDict().at("state").toGenericDict();
  for (const auto& item : good.toGenericDict().at("state").toGenericDict()) {
    EXPECT_TRUE(at::equal(item.value().toGenericDict().at("exp_avg").toTensor(),
                          after.at(item.key()).toGenericDict().at("exp_avg").toTensor()));
  }
  // Loading SGD state into Adam names the cause.
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train_steps(model, sgd, 0, 1);
  message = error_of([&] { ddp::load_optimizer_state_dict(optimizer, ddp::optimizer_state_dict(sgd)); });
  EXPECT_NE(message.find("different optimizer"), std::string::npos) << message;
}

}  // namespace

namespace {

// A zip that the zip reader itself cannot open: its version record's number
// overflows std::stoull (the bare "stoull" that once lost a run's progress).
void write_overflowing_version(const std::string& path) {
  ddp::testing::write_zip(path, {{"data.pkl", std::string("\x80\x02}.", 4)}, {"version", "99999999999999999999999\n"}});
}

// Issue 21 item 1: one bad file cost every snapshot, the run restarted at
// epoch 0, and from then on the fresh epoch-0 snapshots (the most recently
// written) won over epoch 29's at every restart.
TEST_F(SnapshotFiles, ABadFileIsSkippedAloneAndTheFurthestRecordedStepWins) {
  const std::string good = write(29);  // step 290
  const std::string bad = dir + "/snapshot_30.pt";
  write_overflowing_version(bad);
  write(0);  // a run that started over: steps 0, then 10, written later
  const std::string fresh = write(1);
  EXPECT_TRUE(fs::exists(good)) << "pruning dropped the snapshot furthest along";
  EXPECT_TRUE(fs::exists(fresh));
  EXPECT_FALSE(fs::exists(dir + "/snapshot_0.pt"));
  EXPECT_TRUE(fs::exists(bad)) << "a file that is not ours to judge was deleted";
  auto now = fs::file_time_type::clock::now();
  fs::last_write_time(good, now - std::chrono::hours(1));
  fs::last_write_time(bad, now + std::chrono::minutes(1));

  std::vector<std::string> skipped;
  auto snapshot = ddp::load_newest_snapshot(dir, &skipped);
  ASSERT_TRUE(snapshot.has_value());
  EXPECT_EQ(snapshot->epoch, 29);
  EXPECT_EQ(snapshot->step, 290);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("'" + bad + "': its version record is not a number in range"), std::string::npos)
      << skipped[0];
}

// The same through the collective overload: rank 0 scans, every rank gets epoch 29.
TEST(SnapshotRanks, RankZeroSkipsABadFileAndEveryRankResumesFromTheFurthestStep) {
  const char* given = std::getenv("DDP_TEST_SNAPSHOT_DIR");
  std::string dir = given ? given : "";
  if (dir.empty()) {  // the test process sets the directory up; the ranks only read it
    dir = ddp::testing::make_temp_dir();
    torch::manual_seed(0);
    torch::nn::Linear model(5, 3);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    ddp::SnapshotSaver saver(dir);
    saver.save(ddp::capture_snapshot(*model, optimizer, 29, 290));
    write_overflowing_version(dir + "/snapshot_30.pt");
    saver.save(ddp::capture_snapshot(*model, optimizer, 0, 10));
  }
  ddp::testing::RanksOptions options;
  options.env = {{"DDP_TEST_SNAPSHOT_DIR", dir}};
  options.timeout = std::chrono::seconds(60);
  auto ranks = ddp::testing::run_on_ranks(
      2,
      [&](const std::shared_ptr<ddp::ProcessGroup>& group) {
        std::vector<std::string> skipped;
        auto snapshot = ddp::load_newest_snapshot(dir, *group, &skipped);
        ASSERT_TRUE(snapshot.has_value());
        EXPECT_EQ(snapshot->epoch, 29);
        EXPECT_EQ(snapshot->step, 290);
        if (group->rank() == 0) {
          ASSERT_EQ(skipped.size(), 1u);
          EXPECT_NE(skipped[0].find("snapshot_30.pt': its version record"), std::string::npos) << skipped[0];
        }
      },
      options);
  ddp::testing::expect_all_succeeded(ranks);
  fs::remove_all(dir);
}

}  // namespace
