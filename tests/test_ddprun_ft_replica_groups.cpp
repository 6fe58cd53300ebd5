// ddprun --fault-tolerance --ft-replica-size S (fault-tolerant HSDP, torchft's model): a node's
// workers form replica groups of S consecutive local ranks that share one DDP_FT_REPLICA_ID and
// fail and restart as one unit. A member's failure kills the rest of its group at once and starts
// all S again as the group's next incarnation, for one restart; the other groups train on with
// their pids. The workers are small shell scripts: what is under test is ddprun's bookkeeping.
#include <signal.h>

#include <fstream>
#include <regex>

#include "support/ddprun_fixtures.h"

namespace {

using namespace ddprun_tests;

RunOptions job_options(EnvAssignments env = {}) {
  RunOptions options = run_options(std::move(env));
  options.timeout = 60s;
  return options;
}

// Ends a background ddprun that an early ASSERT left running (its workers die with it).
struct JobGuard {
  BackgroundProcess& job;
  bool finished = false;
  ProcessResult finish(std::chrono::milliseconds timeout) {
    finished = true;
    return ddp::testing::wait_background(job, timeout);
  }
  ~JobGuard() {
    if (!finished) ddp::testing::wait_background(job, 1ms);
  }
};

// A worker that writes, each file whole (a temporary renamed), DIR/env.<LOCAL_RANK>.<INC> (what
// it was told), DIR/child.<LOCAL_RANK>.<INC> (a child it started, in its process group) and
// DIR/pid.<LOCAL_RANK>.<INC> (its own pid, last), then runs `then` ($! is the child).
std::vector<std::string> shell_worker(const std::string& dir, const std::string& then) {
  const std::string put = "f() { mv \"" + dir + "/$1.tmp\" \"" + dir + "/$1\"; }; ";
  return {"/bin/sh", "-c",
          put + "inc=${DDP_FT_REPLICA_ID##*/inc}; inc=${inc:-0}; me=$LOCAL_RANK.$inc; "
                "echo \"RANK=$RANK LOCAL_RANK=$LOCAL_RANK ID=$DDP_FT_REPLICA_ID SIZE=${DDP_FT_REPLICA_SIZE-unset} "
                "INITIAL=$DDP_FT_INITIAL_REPLICAS\" > " + dir + "/env.$me.tmp; f env.$me; "
                "sleep 1000 & echo $! > " + dir + "/child.$me.tmp; f child.$me; "
                "echo \"local rank $LOCAL_RANK is $DDP_FT_REPLICA_ID\"; echo $$ > " + dir + "/pid.$me.tmp; f pid.$me; " +
              then};
}

// Waits for `finish` in DIR, then stops its child and exits 0.
std::string until_finished(const std::string& dir) {
  return "while [ ! -e " + dir + "/finish ]; do sleep 0.1; done; kill $!";
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// KEY=VALUE words of a worker's env.<LOCAL_RANK>.<INC> file; empty if it is not there.
std::map<std::string, std::string> recorded_env(const TempDir& dir, int local_rank, int incarnation) {
  std::map<std::string, std::string> variables;
  std::ifstream file(dir.file("env." + std::to_string(local_rank) + "." + std::to_string(incarnation)));
  for (std::string word; file >> word;) {
    const size_t equals = word.find('=');
    variables[word.substr(0, equals)] = word.substr(equals + 1);
  }
  return variables;
}

int pid_of(const TempDir& dir, const std::string& what, int local_rank, int incarnation,
           std::chrono::milliseconds timeout = 20s) {
  return wait_for_pid_file(dir.file(what + "." + std::to_string(local_rank) + "." + std::to_string(incarnation)),
                           timeout);
}

void touch(const std::string& path) { std::ofstream(path) << "\n"; }

bool exists(const std::string& path) { return std::ifstream(path).good(); }

TEST(DdprunFtReplicaGroups, AKilledMemberRestartsItsWholeGroupAsOneRestartWhileTheOtherGroupKeepsItsPids) {
  TempDir dir;
  TempDir logs;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "4", "--ft-replica-size", "2",
                        "--max-restarts", "2", "--log-dir", logs.path()},
                       shell_worker(dir.path(), until_finished(dir.path())))),
      job_options());
  JobGuard guard{job};
  int first[4];
  for (int local_rank = 0; local_rank < 4; ++local_rank) {
    first[local_rank] = pid_of(dir, "pid", local_rank, 0);
    ASSERT_GT(first[local_rank], 0) << "local rank " << local_rank << " never started: "
                                    << read_text_file(job.err_path);
  }
  // Every member of a group has the group's id, named by its first local rank.
  const std::string id0 = recorded_env(dir, 0, 0)["ID"];
  static const std::regex kGroup0(R"((node0-[0-9a-f]{8})/0/inc0)");
  std::smatch match;
  ASSERT_TRUE(std::regex_match(id0, match, kGroup0)) << id0;
  const std::string node = match[1];
  for (int local_rank = 0; local_rank < 4; ++local_rank) {
    auto env = recorded_env(dir, local_rank, 0);
    SCOPED_TRACE("local rank " + std::to_string(local_rank));
    EXPECT_EQ(env["RANK"], std::to_string(local_rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(local_rank));
    EXPECT_EQ(env["ID"], node + (local_rank < 2 ? "/0/inc0" : "/2/inc0"));
    EXPECT_EQ(env["SIZE"], "2");
    EXPECT_EQ(env["INITIAL"], "2") << "DDP_FT_INITIAL_REPLICAS counts groups, not workers";
  }
  const int first_child2 = pid_of(dir, "child", 2, 0);

  // Local rank 3 dies: local rank 2 cannot go on without it, and both come back as inc1.
  ASSERT_EQ(::kill(first[3], SIGKILL), 0);
  const int second2 = pid_of(dir, "pid", 2, 1);
  const int second3 = pid_of(dir, "pid", 3, 1);
  ASSERT_GT(second2, 0) << "local rank 2 was not restarted with its group: " << read_text_file(job.err_path);
  ASSERT_GT(second3, 0) << read_text_file(job.err_path);
  EXPECT_NE(second2, first[2]);
  EXPECT_NE(second3, first[3]);
  EXPECT_TRUE(wait_until_dead(first[2], 5s)) << "local rank 2's old incarnation outlived its group's failure";
  EXPECT_TRUE(wait_until_dead(first_child2, 5s)) << "the child of local rank 2's old incarnation outlived it";
  for (int local_rank : {2, 3}) {
    auto env = recorded_env(dir, local_rank, 1);
    EXPECT_EQ(env["RANK"], std::to_string(local_rank));
    EXPECT_EQ(env["ID"], node + "/2/inc1");
    EXPECT_EQ(env["SIZE"], "2");
    EXPECT_EQ(env["INITIAL"], "2");
  }
  // The other group was not touched.
  EXPECT_TRUE(ddp::testing::process_alive(first[0]));
  EXPECT_TRUE(ddp::testing::process_alive(first[1]));
  EXPECT_FALSE(exists(dir.file("pid.0.1")));
  EXPECT_FALSE(exists(dir.file("pid.1.1")));

  // Both members die in the same instant: still one failure, one restart, the second of two.
  // ddprun is held stopped meanwhile, so that it finds both ended in one look.
  ASSERT_EQ(::kill(job.pid, SIGSTOP), 0);
  ::kill(second2, SIGKILL);
  ::kill(second3, SIGKILL);
  const bool both_dead = wait_until_dead(second2, 5s) && wait_until_dead(second3, 5s);
  ASSERT_EQ(::kill(job.pid, SIGCONT), 0);
  ASSERT_TRUE(both_dead);
  ASSERT_GT(pid_of(dir, "pid", 2, 2), 0) << read_text_file(job.err_path);
  ASSERT_GT(pid_of(dir, "pid", 3, 2), 0) << read_text_file(job.err_path);
  EXPECT_EQ(recorded_env(dir, 3, 2)["ID"], node + "/2/inc2");
  EXPECT_TRUE(ddp::testing::process_alive(first[0]));
  EXPECT_TRUE(ddp::testing::process_alive(first[1]));

  touch(dir.file("finish"));
  ProcessResult result = guard.finish(30s);
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  static const std::regex kLine(
      R"(ddprun: fault tolerance: rank 3 \(local rank 3, pid (\d+), replica (node0-[0-9a-f]{8})/2/inc0\) failed: )"
      R"(killed by signal 9 \(SIGKILL\); restarting its replica group \(local ranks 2-3\) as replica )"
      R"((node0-[0-9a-f]{8})/2/inc1 \(restart 1 of 2\); 2 other worker\(s\) of this node go on)");
  ASSERT_TRUE(std::regex_search(result.err, match, kLine)) << result.describe();
  EXPECT_EQ(std::stoi(match[1]), first[3]);
  EXPECT_EQ(match[2], node);
  EXPECT_EQ(match[3], node);
  EXPECT_NE(result.err.find("restarting its replica group (local ranks 2-3) as replica " + node +
                            "/2/inc2 (restart 2 of 2)"),
            std::string::npos)
      << result.describe();
  // The members ddprun killed are no failures of their own: one line per group failure.
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 2u) << result.describe();
  EXPECT_EQ(result.err.find("restarting it alone"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("used up"), std::string::npos) << result.describe();
  EXPECT_EQ(result.err.find("stopped rank"), std::string::npos) << result.describe();
  // Each rank keeps one log, which every incarnation of it appended to.
  for (int local_rank : {2, 3}) {
    const std::string log = read_text_file(logs.file("attempt_0/rank_" + std::to_string(local_rank) + ".log"));
    for (int incarnation = 0; incarnation < 3; ++incarnation) {
      EXPECT_NE(log.find("local rank " + std::to_string(local_rank) + " is " + node + "/2/inc" +
                         std::to_string(incarnation)),
                std::string::npos)
          << log;
    }
  }
  EXPECT_EQ(count_of(read_text_file(logs.file("attempt_0/rank_0.log")), "local rank 0 is"), 1u);
  // No orphan: every incarnation and every child it started is gone.
  for (int local_rank = 0; local_rank < 4; ++local_rank) {
    for (int incarnation = 0; incarnation < 3; ++incarnation) {
      for (const std::string what : {"pid", "child"}) {
        const std::string name = what + "." + std::to_string(local_rank) + "." + std::to_string(incarnation);
        if (!exists(dir.file(name))) continue;
        EXPECT_TRUE(wait_until_dead(wait_for_pid_file(dir.file(name), 1s), 5s)) << name << " outlived the job";
      }
    }
  }
}

TEST(DdprunFtReplicaGroups, WithRestartsUsedUpTheWholeGroupIsStoppedAndTheOtherGroupFinishes) {
  TempDir dir;
  BackgroundProcess job = ddp::testing::start_background(
      ddprun_argv(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "4", "--ft-replica-size", "2",
                        "--max-restarts", "0"},
                       shell_worker(dir.path(), until_finished(dir.path())))),
      job_options());
  JobGuard guard{job};
  int first[4];
  for (int local_rank = 0; local_rank < 4; ++local_rank) {
    first[local_rank] = pid_of(dir, "pid", local_rank, 0);
    ASSERT_GT(first[local_rank], 0) << read_text_file(job.err_path);
  }
  const int child3 = pid_of(dir, "child", 3, 0);
  ASSERT_EQ(::kill(first[2], SIGKILL), 0);
  EXPECT_TRUE(wait_until_dead(first[3], 5s)) << "local rank 3 went on without its group: "
                                             << read_text_file(job.err_path);
  EXPECT_TRUE(wait_until_dead(child3, 5s)) << "local rank 3's child outlived its group";
  // The other group trains on.
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(ddp::testing::process_alive(first[0]));
  EXPECT_TRUE(ddp::testing::process_alive(first[1]));
  EXPECT_FALSE(exists(dir.file("pid.2.1")));
  EXPECT_FALSE(exists(dir.file("pid.3.1")));
  touch(dir.file("finish"));
  ProcessResult result = guard.finish(30s);
  // As for a worker given up alone: the job succeeds when the workers still running finish.
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  static const std::regex kLine(
      R"(ddprun: fault tolerance: rank 2 \(local rank 2, pid \d+, replica node0-[0-9a-f]{8}/2/inc0\) failed: )"
      R"(killed by signal 9 \(SIGKILL\); not restarting it \(--max-restarts 0 used up\); stopped the rest of its )"
      R"(replica group \(local ranks 2-3\) too; 2 other worker\(s\) of this node go on)");
  EXPECT_TRUE(std::regex_search(result.err, kLine)) << result.describe();
  EXPECT_EQ(count_of(result.err, "fault tolerance: rank"), 1u) << result.describe();
  EXPECT_EQ(result.err.find("root cause"), std::string::npos) << result.describe();
}

TEST(DdprunFtReplicaGroups, WhenEveryGroupIsGivenUpTheJobFailsAtOnce) {
  // The only group: rank 1 fails after training; rank 0 would wait a minute but is stopped with it.
  TempDir dir;
  const auto started = std::chrono::steady_clock::now();
  ProcessResult result =
      ddprun(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--ft-replica-size", "2",
                   "--max-restarts", "0"},
                  shell_worker(dir.path(), "if [ $RANK = 1 ]; then echo 'step 4 loss 0.3'; exit 3; fi; sleep 60")),
             job_options());
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s) << "rank 0 was not stopped with its group";
  EXPECT_NE(result.err.find("failed: exit code 3 (its last step: 4); not restarting it (--max-restarts 0 used up); "
                            "stopped the rest of its replica group (local ranks 0-1) too; 0 other worker(s) of this "
                            "node go on"),
            std::string::npos)
      << result.describe();
  EXPECT_NE(result.err.find("root cause"), std::string::npos) << result.describe();
  EXPECT_NE(result.err.find("exit code 3"), std::string::npos) << result.describe();
}

TEST(DdprunFtReplicaGroups, AGroupThatFailsAtStartUpTwiceAlikeEndsTheJob) {
  // A usage error in every rank: the group is restarted once to see it fail alike, then the job
  // ends in one line, long before --max-restarts 8 is used up. The rank that fails first takes
  // turns (rank 1 in inc0, rank 0 in inc1), the other one ddprun kills: the group's failure at
  // start-up is each new member's to repeat.
  TempDir logs;
  const auto started = std::chrono::steady_clock::now();
  ProcessResult result = ddprun({"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--ft-replica-size",
                                 "2", "--max-restarts", "8", "--log-dir", logs.path(), "/bin/sh", "-c",
                                 "inc=${DDP_FT_REPLICA_ID##*/inc}; [ $(( (inc + RANK) % 2 )) = 0 ] && sleep 10; "
                                 "echo \"train: unknown option --epocs\" >&2; exit 64"},
                                job_options());
  EXPECT_EQ(result.exit_code, 1) << result.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 20s);
  EXPECT_EQ(count_of(result.err, "restarting its replica group (local ranks 0-1)"), 1u) << result.describe();
  EXPECT_NE(result.err.find("(restart 1 of 8)"), std::string::npos) << result.describe();
  static const std::regex kLine(
      R"(rank 0 \(local rank 0, pid \d+, replica node0-[0-9a-f]{8}/0/inc1\) failed at start-up again with exit )"
      R"(code 64, as its replica group's previous incarnation did, and never trained)");
  EXPECT_TRUE(std::regex_search(result.err, kLine)) << result.describe();
  EXPECT_EQ(count_of(result.err, "failed at start-up again"), 1u) << result.describe();
}

TEST(DdprunFtReplicaGroups, FlagErrorsNameTheCauseAndExit2) {
  struct Case {
    std::vector<std::string> args;
    EnvAssignments env;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--fault-tolerance", "--ft-replica-size", "0"}, {},
       "invalid value '0' for --ft-replica-size: expected a positive integer, the workers in one replica group"},
      {{"--fault-tolerance", "--ft_replica_size", "two"}, {},
       "invalid value 'two' for --ft_replica_size: expected a positive integer"},
      {{"--fault-tolerance"}, {{"PET_FT_REPLICA_SIZE", "-1"}},
       "invalid value '-1' for PET_FT_REPLICA_SIZE: expected a positive integer"},
      {{"--ft-replica-size", "2"}, {},
       "--ft-replica-size 2 makes replica groups that fail and restart as one unit, which only --fault-tolerance "
       "does; add --fault-tolerance (or PET_FAULT_TOLERANCE=1), or drop --ft-replica-size"},
      {{"--fault-tolerance", "--ft-replica-size", "3"}, {},
       "--ft-replica-size 3 does not divide --nproc-per-node 4: a replica group is 3 consecutive local ranks of one "
       "node; give --ft-replica-size a divisor of 4 (1, 2, 4), or change --nproc-per-node"},
      {{"--fault-tolerance", "--ft-replica-size", "8"}, {}, "--ft-replica-size 8 does not divide --nproc-per-node 4"},
  };
  TempDir dir;
  for (const Case& c : cases) {
    std::vector<std::string> args = {"--standalone", "--nproc-per-node", "4"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    args.insert(args.end(), {"/bin/sh", "-c", "touch " + dir.file("started")});
    ProcessResult result = ddprun(args, run_options(c.env));
    SCOPED_TRACE(c.message);
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find("ddprun: " + c.message), std::string::npos) << result.describe();
    EXPECT_FALSE(exists(dir.file("started"))) << "a worker started despite the error";
  }
}

TEST(DdprunFtReplicaGroups, PetFtReplicaSizeSetsItAndTheCommandLineWins) {
  TempDir dir;
  ProcessResult result = ddprun(
      with({"--standalone", "--fault-tolerance", "--nproc-per-node", "4"}, shell_worker(dir.path(), "kill $!")),
      job_options({{"PET_FT_REPLICA_SIZE", "4"}}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  for (int local_rank = 0; local_rank < 4; ++local_rank) {
    auto env = recorded_env(dir, local_rank, 0);
    EXPECT_TRUE(std::regex_match(env["ID"], std::regex("node0-[0-9a-f]{8}/0/inc0"))) << env["ID"];
    EXPECT_EQ(env["SIZE"], "4");
    EXPECT_EQ(env["INITIAL"], "1");
  }
  TempDir other;
  result = ddprun(with({"--standalone", "--fault-tolerance", "--nproc-per-node", "4", "--ft-replica-size", "2"},
                       shell_worker(other.path(), "kill $!")),
                  job_options({{"PET_FT_REPLICA_SIZE", "4"}}));
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(recorded_env(other, 3, 0)["SIZE"], "2");
  EXPECT_EQ(recorded_env(other, 3, 0)["INITIAL"], "2");
}

TEST(DdprunFtReplicaGroups, SizeOneKeepsTodaysIdsAndRestartsAWorkerAlone) {
  for (const bool explicit_one : {false, true}) {
    SCOPED_TRACE(explicit_one ? "--ft-replica-size 1" : "no --ft-replica-size");
    TempDir dir;
    std::vector<std::string> args = {"--standalone", "--fault-tolerance", "--nproc-per-node", "2", "--max-restarts",
                                     "1"};
    if (explicit_one) args.insert(args.end(), {"--ft-replica-size", "1"});
    // Rank 1's first incarnation kills itself once rank 0 has started; the others finish.
    ProcessResult result =
        ddprun(with(args, shell_worker(dir.path(), "if [ $RANK = 1 ] && [ $inc = 0 ]; then while [ ! -e " +
                                                       dir.path() + "/pid.0.0 ]; do sleep 0.05; done; kill -9 $$; "
                                                       "fi; sleep 1; kill $!")),
               job_options());
    ASSERT_EQ(result.exit_code, 0) << result.describe();
    std::smatch match;
    const std::string id0 = recorded_env(dir, 0, 0)["ID"];
    ASSERT_TRUE(std::regex_match(id0, match, std::regex(R"((node0-[0-9a-f]{8})/0/inc0)"))) << id0;
    const std::string node = match[1];
    EXPECT_EQ(recorded_env(dir, 1, 0)["ID"], node + "/1/inc0");
    EXPECT_EQ(recorded_env(dir, 1, 1)["ID"], node + "/1/inc1");
    for (const auto& env : {recorded_env(dir, 0, 0), recorded_env(dir, 1, 0), recorded_env(dir, 1, 1)}) {
      EXPECT_EQ(env.at("SIZE"), "1");
      EXPECT_EQ(env.at("INITIAL"), "2");
    }
    // Rank 0 ran once: nobody else was restarted.
    EXPECT_FALSE(exists(dir.file("pid.0.1")));
    EXPECT_NE(result.err.find("restarting it alone as replica " + node + "/1/inc1 (restart 1 of 1); 1 other "
                              "worker(s) of this node go on"),
              std::string::npos)
        << result.describe();
    EXPECT_EQ(result.err.find("replica group"), std::string::npos) << result.describe();
  }
  // Without --fault-tolerance no worker is told of a replica size.
  TempDir dir;
  ProcessResult plain = ddprun(with({"--standalone", "--nproc-per-node", "1"}, shell_worker(dir.path(), "kill $!")));
  ASSERT_EQ(plain.exit_code, 0) << plain.describe();
  EXPECT_EQ(recorded_env(dir, 0, 0)["SIZE"], "unset");
}

}  // namespace
