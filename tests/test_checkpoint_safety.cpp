// What a distributed checkpoint or sharded snapshot may never do, on real
// ranks: delete what is not a checkpoint, lose the last checkpoint when two
// jobs save into one directory, keep a full disk full, prune the snapshots
// a restart needs, or fail a resume that an older snapshot could serve.
// Each rank's error is typed: where it happened, a ddp::Error; on the ranks
// that only followed, a ddp::PeerFailure (so ddprun blames the right one).
#include "support/fsdp_trainers.h"
#include "support/ranks.h"
#include "support/torch_errors.h"
#include "launch/test_seams.h"

#include <ddp/distributed_checkpoint.h>
#include <ddp/error.h>
#include <ddp/sharded_snapshot.h>
#include <ddp/snapshot_saver.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ddp::testing;
namespace fs = std::filesystem;

// What `f` threw: its message, and whether it was a PeerFailure.
struct Failure {
  std::string message;
  bool threw = false;
  bool peer = false;
};
template <typename F>
Failure failure_of(F&& f) {
  Failure failure;
  try {
    f();
  } catch (const ddp::PeerFailure& e) {
    failure = {e.what(), true, true};
  } catch (const c10::Error& e) {
    failure = {e.what_without_backtrace(), true, false};
  } catch (const std::exception& e) {
    failure = {e.what(), true, false};
  }
  return failure;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Saves a DDP checkpoint of the common small model (fsdp_trainers.h) into `dir`.
void save_into(const Group& group, const std::string& dir, int64_t steps = 1) {
  TrainSpec spec;
  spec.steps = steps;
  spec.save_dcp = dir;
  train(group, spec);
}

// A user's file, or a directory with the user's files, at DIR: the save is
// an error on every rank before anything is written, naming it, and the
// files stay. An empty directory and a previous checkpoint are replaced.
TEST(CheckpointSafety, ASaveReplacesOnlyAPreviousCheckpoint) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&dir](const Group& group) {
    if (group->rank() == 0) {
      std::ofstream(dir / "file") << "the user's";
      fs::create_directory(dir / "user");
      std::ofstream(dir / "user/notes.txt") << "the user's notes";
      fs::create_directory(dir / "empty");
    }
    group->barrier();
    for (const std::string name : {"file", "user"}) {
      const Failure failure = failure_of([&] { save_into(group, dir / name); });
      ASSERT_TRUE(failure.threw) << name;
      EXPECT_NE(failure.message.find("cannot save a checkpoint into '" + dir / name + "'"), std::string::npos)
          << failure.message;
      EXPECT_NE(failure.message.find(name == "file" ? "is a file" : "holds 'notes.txt'"), std::string::npos)
          << failure.message;
      // The rank that found it says so; the other one only followed.
      EXPECT_EQ(failure.peer, group->rank() != 0) << failure.message;
      EXPECT_FALSE(fs::exists(dir / (name + ".partial")));
      EXPECT_FALSE(fs::exists(dir / (name + ".old")));
    }
    group->barrier();
    EXPECT_EQ(read_text(dir / "file"), "the user's");
    EXPECT_EQ(read_text(dir / "user/notes.txt"), "the user's notes");

    save_into(group, dir / "empty");
    if (group->rank() == 0) {
      // What a save killed mid-write leaves: its partial directory, with a temporary.
      fs::create_directory(dir / "killed.partial");
      std::ofstream(dir / "killed.partial/shard-00002-model-00001-of-00001.safetensors.tmp.4242.a1b2c3") << "half";
    }
    group->barrier();
    save_into(group, dir / "killed");
    save_into(group, dir / "ckpt", 2);
    save_into(group, dir / "ckpt", 3);  // over the first
    TrainSpec check;
    check.steps = 0;
    check.load_dcp = dir / "ckpt";
    EXPECT_NO_THROW(train(group, check));
    EXPECT_FALSE(fs::exists(dir / "ckpt.lock"));
  });
  expect_all_succeeded(ranks);
}

// Two jobs of 2 ranks each save into one DIR, 4 rounds each, while a fifth
// process watches DIR: it never goes missing, a job that meets the other
// gets an error naming it (host, pid), and DIR loads at the end.
TEST(CheckpointSafety, TwoJobsSavingIntoOneDirectoryNeverLeaveItMissing) {
  RanksTempDir dir;
  RanksOptions options;
  options.timeout = std::chrono::seconds(240);
  auto ranks = run_on_ranks(
      5,
      [&dir](const Group& world) {
        // The lock is held this long before each commit: the jobs surely meet.
        ddp::detail::test_seams().checkpoint_commit_delay = std::chrono::milliseconds(300);
        const int job = world->rank() / 2;  // 0 and 1 save; 2 watches
        auto group = world->split(job);
        const std::string target = dir / "ckpt";
        if (job == 0) save_into(group, target);  // a checkpoint to start from
        world->barrier();
        if (job == 2) {
          int missing = 0, looks = 0;
          while (!fs::exists(dir / "job0.done") || !fs::exists(dir / "job1.done")) {
            ++looks;
            if (!fs::exists(target)) ++missing;
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
          EXPECT_EQ(missing, 0) << "DIR was missing in " << missing << " of " << looks << " looks";
        } else {
          int saved = 0, refused = 0;
          for (int round = 0; round < 4; ++round) {
            const Failure failure = failure_of([&] { save_into(group, target, 1 + round); });
            if (!failure.threw) {
              ++saved;
              continue;
            }
            ++refused;
            EXPECT_NE(failure.message.find("another job is saving a checkpoint into '" + target + "'"),
                      std::string::npos)
                << failure.message;
            if (group->rank() == 0) {
              EXPECT_NE(failure.message.find("pid "), std::string::npos) << failure.message;
              EXPECT_FALSE(failure.peer) << failure.message;
            } else {
              EXPECT_TRUE(failure.peer) << failure.message;
            }
          }
          std::cout << "job " << job << ": saved " << saved << ", refused " << refused << "\n";
          group->barrier();
          if (group->rank() == 0) std::ofstream(dir / ("job" + std::to_string(job) + ".done")) << saved;
        }
        world->barrier();
        if (world->rank() == 0) {
          // The jobs met at least once, or this test showed nothing.
          const int saved = std::stoi(read_text(dir / "job0.done")) + std::stoi(read_text(dir / "job1.done"));
          EXPECT_LT(saved, 8) << "the two jobs never met";
          EXPECT_GT(saved, 0);
          EXPECT_FALSE(fs::exists(target + ".partial"));
          EXPECT_FALSE(fs::exists(target + ".old"));
        }
        if (job < 2) {
          TrainSpec check;
          check.steps = 0;
          check.load_dcp = target;
          EXPECT_NO_THROW(train(group, check));
        }
      },
      options);
  expect_all_succeeded(ranks);
}

// Where the file system has no atomic exchange, a commit interrupted between
// its two renames leaves the previous checkpoint as DIR.old and no DIR: a
// load reads DIR.old, and the next save puts it back before replacing it.
TEST(CheckpointSafety, ACommitInterruptedBetweenItsRenamesIsRecovered) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&dir](const Group& group) {
    save_into(group, dir / "ckpt", 2);
    group->barrier();
    if (group->rank() == 0) fs::rename(dir / "ckpt", dir / "ckpt.old");
    group->barrier();
    TrainSpec check;
    check.steps = 0;
    check.load_dcp = dir / "ckpt";
    EXPECT_NO_THROW(train(group, check));
    save_into(group, dir / "ckpt", 3);
    group->barrier();
    EXPECT_TRUE(fs::exists(dir / "ckpt"));
    EXPECT_FALSE(fs::exists(dir / "ckpt.old"));
    EXPECT_NO_THROW(train(group, check));
  });
  expect_all_succeeded(ranks);
}

// Rank 1's disk is full (a file size limit) during a save: rank 1's error
// says so and is not a PeerFailure, rank 0's is; DIR.partial is removed and
// the previous checkpoint still loads.
TEST(CheckpointSafety, AFailedWriteRemovesItsPartialDirectory) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&dir](const Group& group) {
    save_into(group, dir / "ckpt");
    rlimit original{};
    ::getrlimit(RLIMIT_FSIZE, &original);
    if (group->rank() == 1) {
      ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit then fails with EFBIG
      rlimit small = original;
      small.rlim_cur = 64;
      ::setrlimit(RLIMIT_FSIZE, &small);
    }
    const Failure failure = failure_of([&] { save_into(group, dir / "ckpt", 2); });
    if (group->rank() == 1) ::setrlimit(RLIMIT_FSIZE, &original);
    ASSERT_TRUE(failure.threw);
    EXPECT_EQ(failure.peer, group->rank() == 0) << failure.message;
    if (group->rank() == 0) {
      EXPECT_NE(failure.message.find("rank 1 failed to write its part of the checkpoint"), std::string::npos)
          << failure.message;
    }
    group->barrier();
    EXPECT_FALSE(fs::exists(dir / "ckpt.partial"));
    EXPECT_FALSE(fs::exists(dir / "ckpt.lock"));
    TrainSpec check;
    check.steps = 0;
    check.load_dcp = dir / "ckpt";
    EXPECT_NO_THROW(train(group, check));
  });
  expect_all_succeeded(ranks);
}

// Every file of rank 1 gone from a DDP checkpoint with Adam's state: the
// load names them, instead of a tensor "too small for the model" or a
// parameter whose optimizer state "has no 'step'".
TEST(CheckpointSafety, ALoadNamesTheFilesOfAMissingRank) {
  RanksTempDir dir;
  auto ranks = run_on_ranks(2, [&dir](const Group& group) {
    save_into(group, dir / "ckpt", 2);
    group->barrier();
    if (group->rank() == 0) {
      for (const auto& entry : fs::directory_iterator(dir / "ckpt")) {
        if (entry.path().filename().string().rfind("shard-00002-", 0) == 0) fs::remove(entry.path());
      }
    }
    group->barrier();
    TrainSpec check;
    check.steps = 0;
    check.load_dcp = dir / "ckpt";
    const std::string error = error_of([&] { train(group, check); });
    EXPECT_NE(error.find("lacks every file of rank 1 of the 2 that wrote it (shard-00002-model-*.safetensors)"),
              std::string::npos)
        << error;
  });
  expect_all_succeeded(ranks);
}

// --- sharded snapshots ----------------------------------------------------

// DDP over one Linear whose weights all hold one value, so that a snapshot
// says which save it came from.
struct Marked {
  Marked(const Group& group, int64_t in, int64_t out)
      : model(torch::nn::Linear(in, out), group), optimizer(model->parameters(), torch::optim::AdamOptions(1e-2)) {}
  void mark(double value) {
    at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.fill_(value);
  }
  double value() { return model->parameters()[0].view({-1})[0].item<double>(); }
  std::string save(const std::string& dir, int64_t step, int keep) {
    mark(static_cast<double>(step));
    ddp::SnapshotSaver saver(dir, ddp::SnapshotOptions().keep(keep));
    return saver.save(model, &optimizer, ddp::TrainingProgress{0, step, 0});
  }
  ddp::DistributedDataParallel<torch::nn::Linear> model;
  torch::optim::Adam optimizer;
};

std::string snapshot(const RanksTempDir& dir, int64_t step) { return ddp::detail::sharded_snapshot_path(dir.path(), step); }

// The first file of `shard` (rank + 1) in `path`.
std::string file_of(const std::string& path, int shard) {
  const std::string prefix = "shard-0000" + std::to_string(shard) + "-model-00001-of-";
  for (const auto& entry : fs::directory_iterator(path)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) return entry.path().string();
  }
  return "";
}

bool mentions(const std::vector<std::string>& messages, const std::string& what) {
  for (const auto& m : messages) {
    if (m.find(what) != std::string::npos) return true;
  }
  return false;
}

// Good snapshots at steps 10 and 20; newer ones that cannot serve: 30 lacks
// a file of rank 1, 40 holds another model, 50 has a truncated file. A
// resume takes 20 and names the three; a missing file is named as such.
// Pruning then counts only this run's valid snapshots, never removes the
// damaged or foreign ones, nor the one resumed from; a restart takes the
// newest the run wrote.
TEST(CheckpointSafety, ResumeSkipsSnapshotsThatCannotServeAndPruningKeepsTheGoodOnes) {
  RanksTempDir dir;
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         Marked job(group, 8, 15);
         for (int64_t step : {10, 20, 30}) job.save(dir.path(), step, 0);
         Marked other(group, 4, 3);
         other.save(dir.path(), 40, 2);  // another model: prunes none of ours
         job.save(dir.path(), 50, 0);
         group->barrier();
         for (int64_t step : {10, 20, 30, 40, 50}) EXPECT_TRUE(fs::exists(snapshot(dir, step))) << step;
         if (group->rank() == 0) {
           fs::remove(file_of(snapshot(dir, 30), 2));
           const std::string cut = file_of(snapshot(dir, 50), 2);
           fs::resize_file(cut, fs::file_size(cut) / 2);
         }
         group->barrier();
       }},
      {2,
       [&dir](const Group& group) {
         Marked job(group, 8, 15);
         std::vector<std::string> skipped;
         auto resumed = ddp::load_newest_sharded_snapshot(dir.path(), job.model, &job.optimizer, &skipped);
         ASSERT_TRUE(resumed.has_value());
         EXPECT_EQ(resumed->step, 20);
         EXPECT_EQ(job.value(), 20.0);
         std::string all;
         for (const auto& s : skipped) all += s + "\n";
         EXPECT_EQ(skipped.size(), 3u) << all;
         EXPECT_TRUE(mentions(skipped, "sharded_step_000000000050")) << all;
         EXPECT_TRUE(mentions(skipped, "sharded_step_000000000040")) << all;
         EXPECT_TRUE(mentions(skipped, "lacks 'shard-00002-model-00001-of-00002.safetensors'")) << all;

         // A missing file, loaded directly: named, not blamed on the model.
         const std::string error = error_of([&] { ddp::load_distributed_checkpoint(snapshot(dir, 30), job.model); });
         EXPECT_NE(error.find("lacks 'shard-00002-model-00001-of-00002.safetensors'"), std::string::npos) << error;
         EXPECT_EQ(error.find("in the model"), std::string::npos) << error;

         job.save(dir.path(), 21, 2);
         group->barrier();
         EXPECT_FALSE(fs::exists(snapshot(dir, 10)));  // the one too many of this run
         for (int64_t step : {20, 21, 30, 40, 50}) EXPECT_TRUE(fs::exists(snapshot(dir, step))) << step;
         job.save(dir.path(), 22, 2);
         group->barrier();
         EXPECT_TRUE(fs::exists(snapshot(dir, 20))) << "the snapshot resumed from was removed";
         for (int64_t step : {21, 22, 30, 40, 50}) EXPECT_TRUE(fs::exists(snapshot(dir, step))) << step;
       }},
      {2,
       [&dir](const Group& group) {
         Marked job(group, 8, 15);
         auto resumed = ddp::load_newest_sharded_snapshot(dir.path(), job.model, &job.optimizer);
         ASSERT_TRUE(resumed.has_value());
         EXPECT_EQ(resumed->step, 22);
         EXPECT_EQ(job.value(), 22.0);
       }},
  });
  expect_phases_succeeded(phases, 3);
}

// Sharded snapshots are written on the calling thread only: a saver with
// async_write refuses them on every rank, before anything is written.
TEST(CheckpointSafety, ASaverWithAsyncWriteRefusesShardedSnapshotsOnEveryRank) {
  RanksTempDir dir;
  auto phases = run_phases_on_ranks({
      {2,
       [&dir](const Group& group) {
         Marked job(group, 4, 3);
         ddp::SnapshotSaver saver(dir.path(), ddp::SnapshotOptions().async_write(true));
         const std::string error =
             error_of([&] { saver.save(job.model, &job.optimizer, ddp::TrainingProgress{0, 1, 0}); });
         EXPECT_NE(error.find("a sharded snapshot cannot be written asynchronously"), std::string::npos) << error;
         group->barrier();
         EXPECT_FALSE(fs::exists(snapshot(dir, 1)));
       }},
  });
  expect_phases_succeeded(phases, 1);
}

}  // namespace
