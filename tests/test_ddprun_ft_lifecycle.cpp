// ddprun --fault-tolerance over the life of a long job (issue 36): a worker killed and restarted
// alone again and again leaves ddprun no zombie children and no extra descriptors, and its
// process group goes with it; a worker that fails at start-up twice alike (a usage error) ends
// the job in one line instead of burning every restart, while crashes by a signal and failures
// after training began are still restarted. The workers are small shell scripts: what is under
// test is ddprun's bookkeeping, not training.
#include <dirent.h>
#include <signal.h>

#include <fstream>
#include <regex>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

RunOptions job_options() {
  RunOptions options = run_options();
  options.timeout = 60s;
  return options;
}

// ddprun's children as /proc shows them: every thread's children file, each child's state.
struct Children {
  int zombies = 0;
  int total = 0;
};

Children children_of(int pid) {
  Children children;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  DIR* directory = ::opendir(tasks.c_str());
  if (directory == nullptr) return children;
  while (dirent* entry = ::readdir(directory)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream list(tasks + "/" + entry->d_name + "/children");
    for (int child; list >> child;) {
      std::ifstream stat_file("/proc/" + std::to_string(child) + "/stat");
      std::string stat;
      std::getline(stat_file, stat);
      const size_t name_end = stat.rfind(')');
      ++children.total;
      if (name_end != std::string::npos && name_end + 2 < stat.size() && stat[name_end + 2] == 'Z') {
        ++children.zombies;
      }
    }
  }
  ::closedir(directory);
  return children;
}

int open_fds(int pid) {
  int count = 0;
  DIR* directory = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (directory == nullptr) return -1;
  while (dirent* entry = ::readdir(directory)) count += entry->d_name[0] == '.' ? 0 : 1;
  ::closedir(directory);
  return count;
}

// A worker that writes DIR/pid.<RANK>.<INCARNATION> (its own pid) and DIR/child.<RANK>.<INC>
// (a child it started, in its process group), then runs `then`.
std::vector<std::string> shell_worker(const std::string& dir, const std::string& then) {
  return {"/bin/sh", "-c",
          "inc=${DDP_FT_REPLICA_ID##*/inc}; sleep 1000 & echo $! > " + dir + "/child.$RANK.$inc.tmp; mv " + dir +
              "/child.$RANK.$inc.tmp " + dir + "/child.$RANK.$inc; echo $$ > " + dir + "/pid.$RANK.$inc.tmp; mv " +
              dir + "/pid.$RANK.$inc.tmp " + dir + "/pid.$RANK.$inc; " + then};
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(DdprunFtLifecycle, RestartsLeaveNoZombieAndNoDescriptorBehind) {
  TempDir dir;
  TempDir logs;
  constexpr int kCycles = 6;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts",
                        std::to_string(kCycles), "--log-dir", logs.path()},
                       shell_worker(dir.path(), "while [ ! -e " + dir.path() + "/finish ]; do sleep 0.2; done; "
                                                "kill $!"))),
      job_options());
  ASSERT_GT(wait_for_pid_file(dir.file("pid.0.0"), 20s), 0);
  int fds_after_first_restart = -1;
  std::vector<int> grandchildren;
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    const int victim = wait_for_pid_file(dir.file("pid.1." + std::to_string(cycle)), 20s);
    ASSERT_GT(victim, 0) << "incarnation " << cycle << " of rank 1 never started: "
                         << ddp::testing::read_text_file(job.err_path);
    grandchildren.push_back(wait_for_pid_file(dir.file("child.1." + std::to_string(cycle)), 5s));
    if (cycle == 1) {
      // Once ddprun has seen the end of the killed incarnation's output.
      std::this_thread::sleep_for(300ms);
      fds_after_first_restart = open_fds(job.pid);
    }
    ASSERT_EQ(::kill(victim, SIGKILL), 0);
  }
  // The last restart is running: everything the earlier incarnations left is gone by now.
  ASSERT_GT(wait_for_pid_file(dir.file("pid.1." + std::to_string(kCycles)), 20s), 0)
      << ddp::testing::read_text_file(job.err_path);
  std::this_thread::sleep_for(300ms);
  const Children children = children_of(job.pid);
  const int fds_now = open_fds(job.pid);
  std::printf("[measure] after %d kill/restart cycles: %d zombie(s) among ddprun's %d children; %d open fds "
              "(%d after the first restart)\n",
              kCycles, children.zombies, children.total, fds_now, fds_after_first_restart);
  EXPECT_EQ(children.zombies, 0) << "ddprun keeps the killed incarnations as zombies";
  // The two workers, the watchdog and the store keeper.
  EXPECT_EQ(children.total, 4);
  EXPECT_EQ(fds_now, fds_after_first_restart) << "ddprun's descriptors grow with every restart";
  // Each killed incarnation's own child (same process group) died with it.
  for (size_t i = 0; i < grandchildren.size(); ++i) {
    EXPECT_TRUE(wait_until_dead(grandchildren[i], 5s)) << "the child of incarnation " << i << " outlived it";
  }
  std::ofstream(dir.file("finish")) << "\n";
  ProcessResult result = ddp::testing::wait_background(job, 30s);
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(count_of(result.err, "restarting it alone"), static_cast<size_t>(kCycles)) << result.describe();
  // Every incarnation of rank 1 still wrote into the one log of its rank.
  const std::string log = ddp::testing::read_text_file(logs.file("attempt_0/rank_1.log"));
  EXPECT_EQ(log.find("No such file"), std::string::npos) << log;
}

TEST(DdprunFtLifecycle, AUsageErrorEndsTheJobInOneLineInsteadOfBurningRestarts) {
  // Every rank's program refuses its arguments: each is restarted once to see it fail alike, and
  // the first to fail twice ends the job, long before --max-restarts 8 is used up.
  TempDir logs;
  const auto started = std::chrono::steady_clock::now();
  ProcessResult result = ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts", "8",
                                 "--log-dir", logs.path(), "/bin/sh", "-c",
                                 "echo \"train: unknown option --epocs\" >&2; exit 64"},
                                job_options());
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 20s);
  EXPECT_LE(count_of(result.err, "restarting it alone"), 2u) << result.describe();
  EXPECT_EQ(count_of(result.err, "failed at start-up again"), 1u) << result.describe();
  static const std::regex kLine(
      R"(ddprun: fault tolerance: rank (\d) \(local rank \d, pid \d+, replica node0-[0-9a-f]{8}/\d/inc1\) failed at )"
      R"(start-up again with exit code 64, as its previous incarnation did, and never trained \(no committed step\): )"
      R"(it would fail the same way each time \(a bad argument\? a missing file\?\), so ddprun stops restarting it )"
      R"(and ends the job; its last line: train: unknown option --epocs; its log: (\S+))");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.err, match, kLine)) << result.describe();
  EXPECT_EQ(match[2].str(), logs.file("attempt_0/rank_" + match[1].str() + ".log"));
  // That line is the verdict: no root-cause block repeats it.
  EXPECT_EQ(result.err.find("root cause"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("used up"), std::string::npos) << result.describe();
}

TEST(DdprunFtLifecycle, AStartUpFailureOfOneRankStopsTheOthersAndLeavesNoOrphan) {
  // Rank 1 misses its data file; rank 0 would train for a minute.
  TempDir dir;
  const auto started = std::chrono::steady_clock::now();
  ProcessResult result =
      ddprun(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts", "5"},
                  shell_worker(dir.path(), "if [ $RANK = 1 ]; then cat " + dir.path() +
                                               "/no-such-data.bin; exit 2; fi; sleep 60 & wait")),
             job_options());
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s) << "rank 0 was not stopped";
  EXPECT_EQ(count_of(result.err, "restarting it alone"), 1u) << result.describe();
  EXPECT_NE(result.err.find("rank 1 (local rank 1, pid "), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("/1/inc1) failed at start-up again with exit code 2"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("no-such-data.bin: No such file or directory; its output is on the console above"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("stopped rank 0"), std::string::npos) << result.describe();
  // Nothing any incarnation started lives on.
  for (const std::string name : {"pid.0.0", "child.0.0", "pid.1.0", "child.1.0", "pid.1.1", "child.1.1"}) {
    const int pid = wait_for_pid_file(dir.file(name), 1s);
    ASSERT_GT(pid, 0) << name << ": " << result.describe();
    EXPECT_TRUE(wait_until_dead(pid, 5s)) << name << " outlived the job";
  }
}

TEST(DdprunFtLifecycle, CrashesFailuresAfterTrainingAndChangingExitCodesAreStillRestarted) {
  struct Case {
    std::string what;
    std::string rank1;  // what rank 1 does, every incarnation
    size_t restarts;    // of rank 1, out of --max-restarts 2
    bool used_up;       // then "--max-restarts 2 used up", rank 0 finishes, the job succeeds
  };
  const std::vector<Case> cases = {
      {"killed by a signal at start-up", "kill -9 $$", 2, true},
      // ddp's fault-tolerance layer creates DDP_FT_PROGRESS_FILE at the first committed step.
      {"failed after its first committed step",
       "[ -n \"$DDP_FT_PROGRESS_FILE\" ] && [ ! -e \"$DDP_FT_PROGRESS_FILE\" ] && touch \"$DDP_FT_PROGRESS_FILE\" "
       "&& exit 2; exit 9",
       2, true},
      {"failed after it was let into a generation",
       "echo \"ddp: membership: replica $DDP_FT_REPLICA_ID joined at step 3, healed from x (10 bytes) in 1 ms; 2 "
       "replicas\" >&2; for i in 1 2 3 4 5 6; do echo \"saving shard $i\" >&2; done; exit 2",
       2, true},
      {"failed after its log named a step", "echo \"step 12 loss 0.5\"; exit 2", 2, true},
      // Exit codes 2, 3, 3: the second failure differs from the first, the third repeats it.
      {"failed at start-up with another exit code", "[ $inc = 0 ] && exit 2; exit 3", 2, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir dir;
    ProcessResult result =
        ddprun(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts", "2"},
                    shell_worker(dir.path(), "if [ $RANK = 1 ]; then " + c.rank1 + "; fi; sleep 1; kill $!")),
               job_options());
    EXPECT_EQ(count_of(result.err, "restarting it alone"), c.restarts) << result.describe();
    if (c.used_up) {
      EXPECT_EQ(result.exit_code, 0) << result.describe();
      EXPECT_EQ(result.err.find("start-up again"), std::string::npos) << result.describe();
      EXPECT_NE(result.err.find("not restarting it (--max-restarts 2 used up)"), std::string::npos)
          << result.describe();
    } else {
      EXPECT_EQ(result.exit_code, 1) << result.describe();
      EXPECT_NE(result.err.find("/1/inc2) failed at start-up again with exit code 3"), std::string::npos)
          << result.describe();
    }
  }
}

TEST(DdprunFtLifecycle, EveryIncarnationGetsItsOwnFreshProgressFile) {
  TempDir dir;
  TempDir logs;
  ProcessResult result = ddprun(
      {"--standalone", "--fault-tolerance", "--nproc-per-node", "1", "--max-restarts", "1", "--log-dir", logs.path(),
       "/bin/sh", "-c",
       "echo \"progress=$DDP_FT_PROGRESS_FILE exists=$([ -e \"$DDP_FT_PROGRESS_FILE\" ] && echo yes || echo no)\"; "
       "touch \"$DDP_FT_PROGRESS_FILE\"; case $DDP_FT_REPLICA_ID in */inc0) kill -9 $$;; esac"},
      job_options());
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_NE(result.out.find("progress=" + logs.file("attempt_0/rank_0.trained") + " exists=no"), std::string::npos)
      << result.describe();
  EXPECT_NE(result.out.find("progress=" + logs.file("attempt_0/rank_0.inc1.trained") + " exists=no"),
            std::string::npos)
      << result.describe();
  // Without --fault-tolerance no worker is told of one.
  ProcessResult plain = ddprun({"--standalone", "/bin/sh", "-c", "echo \"progress=${DDP_FT_PROGRESS_FILE:-unset}\""});
  EXPECT_NE(plain.out.find("progress=unset"), std::string::npos) << plain.describe();
}

}  // namespace
