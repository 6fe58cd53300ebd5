#include <ddp/snapshot_saver.h>

#include <ddp/error.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <support/ranks.h>
#include <support/subprocess.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "checkpoint/snapshot_retention.h"
#include "launch/test_seams.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

using namespace std::chrono_literals;

// Holds each write of the asynchronous savers made in one test back by
// `delay`, through the library's test seam (src/launch/test_seams.h); a saver reads
// it when its thread starts, so declare this before the saver.
class ScopedWriteDelay {
 public:
  explicit ScopedWriteDelay(std::chrono::milliseconds delay) {
    ddp::detail::test_seams().async_snapshot_write_delay = delay;
  }
  ~ScopedWriteDelay() { ddp::detail::test_seams().async_snapshot_write_delay = std::chrono::milliseconds(0); }
  ScopedWriteDelay(const ScopedWriteDelay&) = delete;
  ScopedWriteDelay& operator=(const ScopedWriteDelay&) = delete;
};

void train_steps(torch::nn::Linear& model, torch::optim::Optimizer& optimizer, int first, int count) {
  for (int s = first; s < first + count; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(s);
    at::Tensor x = at::randn({8, 16}, generator);
    at::Tensor y = at::randint(0, 8, {8}, generator, at::kLong);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    optimizer.step();
  }
}

void expect_same(const c10::IValue& a, const c10::IValue& b, const std::string& where) {
  ASSERT_EQ(a.tagKind(), b.tagKind()) << where;
  if (a.isTensor()) {
    EXPECT_TRUE(torch::equal(a.toTensor(), b.toTensor())) << where;
  } else if (a.isGenericDict()) {
    auto x = a.toGenericDict(), y = b.toGenericDict();
    ASSERT_EQ(x.size(), y.size()) << where;
    for (auto i = x.begin(), j = y.begin(); i != x.end(); ++i, ++j) {
      expect_same(i->key(), j->key(), where);
      expect_same(i->value(), j->value(), where + "/" + i->key().tagKind());
    }
  } else if (a.isList()) {
    auto x = a.toListRef(), y = b.toListRef();
    ASSERT_EQ(x.size(), y.size()) << where;
    for (size_t k = 0; k < x.size(); ++k) expect_same(x[k], y[k], where + "[" + std::to_string(k) + "]");
  } else {
    EXPECT_EQ(a, b) << where;
  }
}

// A snapshot whose one tensor, `numel` copies of `value`, says which save
// it came from and whether it is whole.
ddp::Snapshot filled(int64_t epoch, int64_t numel, float value) {
  ddp::Snapshot s;
  s.epoch = epoch;
  s.step = 10 * (epoch + 1);
  s.sampler_epoch = epoch + 1;
  s.model = {{"weight", at::full({numel}, value)}};
  return s;
}

// Staging: what is written is the state at the moment save() was called,
// although training changes the parameters, the Adam moments and the extra
// tensors in place while the write waits. Skipping the copy fails this.
TEST(SnapshotSaver, AnAsyncSaveWritesTheStateOfTheMomentSaveWasCalled) {
  ScopedWriteDelay delay(300ms);  // training runs first, surely
  const std::string reference_dir = ddp::testing::make_temp_dir();
  const std::string async_dir = ddp::testing::make_temp_dir();
  torch::manual_seed(0);
  torch::nn::Linear model(16, 8);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
  train_steps(model, optimizer, 0, 3);

  ddp::Snapshot now = ddp::capture_snapshot(*model, optimizer, 2, 3);
  c10::impl::GenericDict extra(c10::StringType::get(), c10::TensorType::get());
  at::Tensor ema = at::ones({4});
  extra.insert("ema", ema);
  now.extra = extra;
  // On this thread, before any change.
  const std::string reference = ddp::SnapshotSaver(reference_dir).save(now);

  ddp::SnapshotSaver writer(async_dir, ddp::SnapshotOptions().async_write(true));
  writer.save(now);
  const at::Tensor weight_at_save = model->weight.detach().clone();
  train_steps(model, optimizer, 3, 5);
  ema.add_(1);
  extra.insert("added later", at::zeros({1}));
  ASSERT_FALSE(torch::equal(model->weight, weight_at_save)) << "training did not change the parameters";
  writer.wait();

  ddp::Snapshot expected = ddp::load_snapshot(reference);
  ddp::Snapshot written = ddp::load_snapshot(async_dir + "/snapshot_2.pt");
  EXPECT_EQ(written.step, 3);
  ASSERT_EQ(written.model.size(), expected.model.size());
  for (size_t k = 0; k < expected.model.size(); ++k) {
    EXPECT_EQ(written.model[k].first, expected.model[k].first);
    EXPECT_TRUE(torch::equal(written.model[k].second, expected.model[k].second)) << expected.model[k].first;
  }
  expect_same(written.optimizer, expected.optimizer, "optimizer");
  expect_same(written.extra, expected.extra, "extra");
  EXPECT_TRUE(torch::equal(written.rng_state, expected.rng_state));
  fs::remove_all(reference_dir);
  fs::remove_all(async_dir);
}

// Kill during save: a process is SIGKILLed while its writer thread is
// writing a large snapshot. The previous snapshot must still be the newest
// valid one, and no file that validates may be incomplete.
TEST(SnapshotSaver, KilledMidAsyncWriteLeavesThePreviousSnapshotTheNewestValidOne) {
  constexpr int64_t kLarge = 64 << 20;  // 256 MiB of floats: the write takes a while
  if (const char* dir = std::getenv("DDP_TEST_ASYNC_KILL_DIR")) {
    // The child: one complete snapshot, then a large one the parent kills us in.
    ddp::SnapshotSaver writer(dir, ddp::SnapshotOptions().async_write(true));
    writer.save(filled(0, 1000, 1.0f));
    writer.wait();
    ddp::Snapshot large = filled(1, kLarge, 2.0f);
    writer.save(large);
    large.model[0].second.fill_(3.0f);  // training goes on
    std::this_thread::sleep_for(120s);
    ::_exit(3);  // never killed: the parent fails on the exit code
  }
  const std::string dir = ddp::testing::make_temp_dir();
  ddp::testing::RunOptions run;
  run.env = {{"DDP_TEST_ASYNC_KILL_DIR", dir}};
  auto child = ddp::testing::start_background(
      {ddp::testing::detail::self_executable(), "--gtest_filter=" + ddp::testing::detail::current_test_name()}, run);

  // Killed as soon as the temporary file of the large snapshot has bytes.
  std::optional<fs::path> temporary;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!temporary && std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.rfind("snapshot_1.pt.tmp.", 0) == 0 && fs::file_size(it->path(), ec) > 0) temporary = it->path();
    }
    if (!temporary) std::this_thread::sleep_for(200us);
  }
  ::kill(child.pid, SIGKILL);
  auto result = ddp::testing::wait_background(child, 60s);
  ASSERT_TRUE(temporary.has_value()) << "the large snapshot's temporary file never appeared\n" << result.describe();
  EXPECT_EQ(result.term_signal, SIGKILL) << result.describe();
  ASSERT_FALSE(fs::exists(dir + "/snapshot_1.pt")) << "the kill came after the rename: nothing was tested";
  std::error_code ec;
  const auto left = fs::file_size(*temporary, ec);
  std::cout << "killed with " << left << " bytes of the temporary file written\n";

  std::vector<std::string> skipped;
  auto newest = ddp::load_newest_snapshot(dir, &skipped);
  ASSERT_TRUE(newest.has_value());
  EXPECT_EQ(newest->epoch, 0);
  EXPECT_EQ(newest->step, 10);
  EXPECT_TRUE(torch::equal(newest->model[0].second, at::full({1000}, 1.0f)));

  // Every file that validates, the temporary one too, is one whole snapshot.
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::optional<ddp::Snapshot> loaded;
    try {
      loaded = ddp::load_snapshot(entry.path().string());
    } catch (const c10::Error&) {
      continue;
    }
    const bool first = loaded->epoch == 0 && torch::equal(loaded->model[0].second, at::full({1000}, 1.0f));
    const bool second = loaded->epoch == 1 && torch::equal(loaded->model[0].second, at::full({kLarge}, 2.0f));
    EXPECT_TRUE(first || second) << entry.path() << " validates but is not a whole snapshot";
  }
  fs::remove_all(dir);
}

// Captures TORCH_WARN on this thread's handler.
class WarningCapture : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

// A directory into which every write fails on the writer thread: each
// snapshot's final path is taken by a directory that is not empty.
std::string blocked_directory(const std::string& root, std::initializer_list<int> epochs,
                              const std::string& name = "blocked") {
  const std::string dir = root + "/" + name;
  for (int epoch : epochs) fs::create_directories(dir + "/snapshot_" + std::to_string(epoch) + ".pt/occupied");
  return dir;
}

// A failed write on the writer thread surfaces from wait(), or from the next
// save(), as a ddp::Error that names the file; the destructor only warns.
TEST(SnapshotSaver, AnAsyncWriteErrorSurfacesFromWaitOrTheNextSave) {
  const std::string root = ddp::testing::make_temp_dir();
  const std::string blocked = blocked_directory(root, {0, 1});
  ddp::SnapshotSaver writer(blocked, ddp::SnapshotOptions().async_write(true));
  writer.save(filled(0, 10, 1.0f));  // returns: the write fails later, on the thread
  try {
    writer.wait();
    ADD_FAILURE() << "wait() did not throw";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + blocked + "/snapshot_0.pt' failed"), std::string::npos) << e.what();
  }

  writer.save(filled(1, 10, 1.0f));
  while (writer.pending() > 0) std::this_thread::sleep_for(1ms);
  try {
    writer.save(filled(2, 10, 1.0f));
    ADD_FAILURE() << "save() did not throw the earlier error";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + blocked + "/snapshot_1.pt' failed"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(blocked + "/snapshot_2.pt")) << "a save() that threw queued its snapshot";

  // Reported once; the saver goes on working.
  writer.save(filled(3, 10, 1.0f));
  EXPECT_NO_THROW(writer.wait());
  EXPECT_TRUE(fs::exists(blocked + "/snapshot_3.pt"));

  const std::string also_blocked = blocked_directory(root, {4}, "also_blocked");
  WarningCapture warnings;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    EXPECT_NO_THROW({
      ddp::SnapshotSaver unwatched(also_blocked, ddp::SnapshotOptions().async_write(true));
      unwatched.save(filled(4, 10, 1.0f));
    });
  }
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find(also_blocked + "/snapshot_4.pt"), std::string::npos) << warnings.messages[0];
  fs::remove_all(root);
}

// save() waits for room while the previous write runs; when that write
// fails (a full disk, say), save() throws its error and queues nothing,
// rather than starting one more write that would fail the same way.
TEST(SnapshotSaver, AnAsyncSaveThatWaitedForRoomThrowsTheErrorOfTheWriteThatMadeIt) {
  ScopedWriteDelay delay(300ms);
  const std::string root = ddp::testing::make_temp_dir();
  const std::string blocked = blocked_directory(root, {0});
  // queue_depth 1: the second save waits for the first write.
  ddp::SnapshotSaver writer(blocked, ddp::SnapshotOptions().async_write(true));
  writer.save(filled(0, 10, 1.0f));
  try {
    writer.save(filled(1, 10, 1.0f));
    ADD_FAILURE() << "save() queued a snapshot after the write it waited for had failed";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + blocked + "/snapshot_0.pt' failed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(writer.pending(), 0u);
  EXPECT_NO_THROW(writer.wait());  // reported once
  EXPECT_FALSE(fs::exists(blocked + "/snapshot_1.pt"));
  fs::remove_all(root);
}

// save() makes the snapshot directory, and one it cannot make is an error
// of that very call, naming it, not of a write on the thread.
TEST(SnapshotSaver, SaveMakesItsDirectoryOrSaysAtOnceThatItCannot) {
  const std::string root = ddp::testing::make_temp_dir();
  for (bool async_write : {false, true}) {
    const std::string made = root + "/new/" + (async_write ? "async" : "sync");
    ddp::SnapshotSaver saver(made, ddp::SnapshotOptions().async_write(async_write));
    saver.save(filled(0, 10, 1.0f));
    EXPECT_NO_THROW(saver.wait());
    EXPECT_TRUE(fs::exists(made + "/snapshot_0.pt")) << made;
  }

  { std::ofstream(root + "/file") << "a file, not a directory"; }
  ddp::SnapshotSaver writer(root + "/file/sub", ddp::SnapshotOptions().async_write(true));
  try {
    writer.save(filled(1, 10, 1.0f));
    ADD_FAILURE() << "save() accepted a directory that cannot exist";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create the snapshot directory '" + root + "/file/sub'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(writer.pending(), 0u);
  EXPECT_NO_THROW(writer.wait());
  fs::remove_all(root);
}

// The queue is bounded: with queue_depth(2), a third save() waits until the
// writer has finished the first.
TEST(SnapshotSaver, AnAsyncSaveWaitsWhileTheQueueIsFull) {
  ScopedWriteDelay delay(400ms);
  const std::string dir = ddp::testing::make_temp_dir();
  ddp::SnapshotSaver writer(dir, ddp::SnapshotOptions().async_write(true).queue_depth(2).keep(3));
  writer.save(filled(0, 10, 1.0f));
  writer.save(filled(1, 10, 1.0f));
  EXPECT_EQ(writer.pending(), 2u);
  EXPECT_FALSE(fs::exists(dir + "/snapshot_0.pt"));

  const auto start = std::chrono::steady_clock::now();
  writer.save(filled(2, 10, 1.0f));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(fs::exists(dir + "/snapshot_0.pt")) << "save() returned while the queue was full";
  EXPECT_GE(waited, 200ms);
  EXPECT_LE(writer.pending(), 2u);
  writer.wait();
  EXPECT_EQ(writer.pending(), 0u);
  for (int epoch = 0; epoch < 3; ++epoch) EXPECT_TRUE(fs::exists(dir + "/snapshot_" + std::to_string(epoch) + ".pt"));
  fs::remove_all(dir);
}

TEST(SnapshotSaver, OneSaverPerDirectory) {
  const std::string dir = ddp::testing::make_temp_dir();
  auto first = std::make_unique<ddp::SnapshotSaver>(dir, ddp::SnapshotOptions().async_write(true));
  first->save(filled(0, 10, 1.0f));
  try {
    ddp::SnapshotSaver second(dir + "/.");
    ADD_FAILURE() << "a second saver was let into the directory";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("another SnapshotSaver is already writing into"), std::string::npos)
        << e.what();
  }
  first.reset();  // waits for its write and gives the directory up
  ddp::SnapshotSaver second(dir);
  second.save(filled(1, 10, 1.0f));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_0.pt"));
  EXPECT_TRUE(fs::exists(dir + "/snapshot_1.pt"));
  fs::remove_all(dir);
}

TEST(SnapshotSaver, OptionsAreChecked) {
  const std::string dir = ddp::testing::make_temp_dir();
  auto message = [](const std::string& directory, const ddp::SnapshotOptions& options = {}) -> std::string {
    try {
      ddp::SnapshotSaver saver(directory, options);
    } catch (const ddp::Error& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(message(dir, ddp::SnapshotOptions().async_write(true).queue_depth(0))
                .find("queue_depth must be at least 1, got 0"),
            std::string::npos);
  EXPECT_NE(message(dir, ddp::SnapshotOptions().keep(-1))
                .find("keep must be at least 0 (0 keeps every snapshot), got -1"),
            std::string::npos);
  EXPECT_NE(message("").find("needs a directory"), std::string::npos);
  fs::remove_all(dir);
}

std::string contents_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Async is only where the write runs: the same saves, sync and async, leave
// the same files, byte for byte, and prune alike, around a file that is not
// a snapshot, a snapshot of another model and a damaged one.
TEST(SnapshotSaver, AsyncAndSyncSavesLeaveTheSameFilesAndPruneAlike) {
  const std::string root = ddp::testing::make_temp_dir();
  const std::string sync_dir = root + "/sync";
  const std::string async_dir = root + "/async";
  for (const auto& dir : {sync_dir, async_dir}) {
    fs::create_directories(dir);
    std::ofstream(dir + "/snapshot_9999.pt") << "not a snapshot";
    ddp::Snapshot foreign = filled(500, 3, 5.0f);
    foreign.step = 1;
    foreign.model = {{"another", at::ones({3})}};
    ddp::save_snapshot(foreign, dir + "/snapshot_500.pt");
  }
  {
    ddp::SnapshotSaver sync(sync_dir, ddp::SnapshotOptions().keep(2));
    ddp::SnapshotSaver async(async_dir, ddp::SnapshotOptions().keep(2).async_write(true));
    for (int epoch = 0; epoch < 6; ++epoch) {
      ddp::Snapshot snapshot = filled(epoch, 100, static_cast<float>(epoch));
      EXPECT_EQ(sync.save(snapshot), sync_dir + "/snapshot_" + std::to_string(epoch) + ".pt");
      EXPECT_EQ(async.save(snapshot), async_dir + "/snapshot_" + std::to_string(epoch) + ".pt");
      if (epoch == 2) {
        async.wait();
        for (const auto& dir : {sync_dir, async_dir}) fs::resize_file(dir + "/snapshot_2.pt", 100);
      }
    }
    async.wait();
  }
  auto names = [](const std::string& dir) {
    std::set<std::string> found;
    for (const auto& entry : fs::directory_iterator(dir)) found.insert(entry.path().filename().string());
    return found;
  };
  const std::set<std::string> expected{"snapshot_9999.pt", "snapshot_500.pt", "snapshot_2.pt", "snapshot_4.pt",
                                       "snapshot_5.pt"};
  EXPECT_EQ(names(sync_dir), expected);
  EXPECT_EQ(names(async_dir), expected);
  for (const auto& name : expected) {
    EXPECT_EQ(contents_of(sync_dir + "/" + name), contents_of(async_dir + "/" + name)) << name;
  }
  fs::remove_all(root);
}

// The one retention policy, on its own: after a save at step 50 with keep 3,
// the two other snapshots of this run furthest along stay and the rest of
// this run's go, except the one resumed from. One ahead of the one written
// counts but never goes; those that are not ours (damaged, of another model,
// links) neither count nor go.
TEST(SnapshotRetention, KeepsTheNewestOfThisRunAndNothingThatIsNotOurs) {
  auto at = [](const std::string& path, int64_t step, bool ours, bool resumed = false) {
    ddp::detail::SnapshotOnDisk s;
    s.path = path;
    s.step = step;
    s.epoch = step / 10;
    s.ours = ours;
    s.resumed_from = resumed;
    return s;
  };
  ddp::detail::SnapshotListing listing;
  listing.written = at("w50", 50, true);
  listing.others = {at("a20", 20, true), at("b60", 60, true), at("c40", 40, true),  at("d45", 45, false),
                    at("e10", 10, true), at("f5", 5, true, true), at("g30", 30, true), at("h1", 1, false)};
  using Paths = std::vector<std::string>;
  EXPECT_EQ(ddp::detail::snapshots_to_remove(listing, 3), (Paths{"g30", "a20", "e10"}));
  EXPECT_EQ(ddp::detail::snapshots_to_remove(listing, 1), (Paths{"c40", "g30", "a20", "e10"}));
  EXPECT_EQ(ddp::detail::snapshots_to_remove(listing, 0), Paths{}) << "keep 0 keeps every snapshot";
  EXPECT_EQ(ddp::detail::snapshots_to_remove(listing, 10), Paths{});
  // The step decides before the epoch; at the same step, the later epoch is further along.
  listing.others = {at("same_step_earlier_epoch", 50, true), at("x", 49, true)};
  listing.others[0].epoch = 4;
  EXPECT_EQ(ddp::detail::snapshots_to_remove(listing, 1), (Paths{"same_step_earlier_epoch", "x"}));
  listing.others[0].epoch = 5;
  EXPECT_EQ(ddp::detail::snapshots_to_remove(listing, 1), Paths{"x"}) << "a tie is not behind the one written";
}

}  // namespace
