// The Wine example started by the launchers of real clusters: Open MPI's
// mpirun, a single-host Slurm (slurmctld and slurmd configured and started
// here), and two "nodes" in network namespaces joined by a veth pair. Each
// test skips, saying why, when its tools or privileges are missing.

#include <ddp/process_group.h>

#include <gtest/gtest.h>
#include <support/launch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

bool have(const std::string& program) {
  return run_process({"sh", "-c", "command -v " + program}, one_rank({}, std::chrono::seconds(10))).exit_code == 0;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The reference: the same job under ddprun on one host.
struct Reference {
  std::vector<std::string> losses;
  std::string dir;  // holds model_final.pt; removed by the test
};
Reference reference_run(int ranks, const std::vector<std::string>& args) {
  auto dir = make_temp_dir("cluster_ref");
  std::vector<std::string> full = args;
  full.insert(full.end(), {"--checkpoint-dir", dir});
  auto r = run_process(under_ddprun(ranks, "wine_ddp", full), one_rank({}));
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  return Reference{loss_lines(r.out), dir};
}

TEST(Cluster, MpirunStartsRanksThatFindEachOther) {
  if (!have("mpirun")) GTEST_SKIP() << "mpirun (Debian's openmpi-bin) is not installed";
  auto dir = make_temp_dir("mpi");
  auto r = run_process({"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x",
                        "OMP_NUM_THREADS", bin_path("wine_ddp"), "30", "10", "--checkpoint-dir", dir},
                       one_rank({{"MASTER_PORT", std::to_string(free_port())}, {"OMP_NUM_THREADS", "1"}},
                                std::chrono::seconds(120)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto ref = reference_run(2, {"30", "10"});
  EXPECT_EQ(loss_lines(r.out), ref.losses);
  EXPECT_EQ(compare_state_dicts(dir + "/model_final.pt", ref.dir + "/model_final.pt"), "identical");
  fs::remove_all(dir);
  fs::remove_all(ref.dir);
}

class SlurmCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* tool : {"slurmctld", "slurmd", "srun", "sinfo"}) {
      if (!have(tool)) GTEST_SKIP() << tool << " (Debian's slurm-wlm) is not installed";
    }
    if (geteuid() != 0) GTEST_SKIP() << "starting slurmd needs root";
    dir_ = make_temp_dir("slurm");
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    std::string hostname(host);
    hostname = hostname.substr(0, hostname.find('.'));
    for (const char* sub : {"state", "spool", "log"}) fs::create_directories(dir_ + "/" + sub);
    conf_ = dir_ + "/slurm.conf";
    std::ofstream conf(conf_);
    conf << "ClusterName=ddptest\n"
         << "SlurmctldHost=" << hostname << "\n"
         << "SlurmctldPort=" << free_port() << "\n"
         << "SlurmdPort=" << free_port() << "\n"
         << "SlurmUser=root\nSlurmdUser=root\n"
         << "AuthType=auth/none\nCredType=cred/none\n"
         << "StateSaveLocation=" << dir_ << "/state\n"
         << "SlurmdSpoolDir=" << dir_ << "/spool\n"
         << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\n"
         << "SlurmdPidFile=" << dir_ << "/slurmd.pid\n"
         << "SlurmctldLogFile=" << dir_ << "/log/slurmctld.log\n"
         << "SlurmdLogFile=" << dir_ << "/log/slurmd.log\n"
         << "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\n"
         << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
         << "MpiDefault=none\nReturnToService=2\n"
         << "NodeName=" << hostname << " CPUs=2 State=UNKNOWN\n"
         << "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
    conf.close();
    auto env = one_rank({{"SLURM_CONF", conf_}});
    controller_ = start_background({"slurmctld", "-D", "-i", "-f", conf_}, env);
    node_daemon_ = start_background({"slurmd", "-D", "-f", conf_}, env);
    for (int attempt = 0; attempt < 60; ++attempt) {
      auto info = run_process({"sinfo", "-h", "-o", "%t"}, env);
      if (info.exit_code == 0 && info.out.find("idle") != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    std::string why = "slurmctld/slurmd did not come up within 30 s; slurmd log: " +
                      file_bytes(dir_ + "/log/slurmd.log").substr(0, 2000);
    TearDown();
    GTEST_SKIP() << why;
  }

  void TearDown() override {
    for (auto* daemon : {&node_daemon_, &controller_}) {
      if (daemon->pid > 0) {
        kill(-daemon->pid, SIGTERM);
        wait_background(*daemon, std::chrono::seconds(10));
        daemon->pid = -1;
      }
    }
    if (!dir_.empty()) fs::remove_all(dir_);
    dir_.clear();
  }

  std::string dir_, conf_;
  BackgroundProcess controller_, node_daemon_;
};

TEST_F(SlurmCluster, SrunAloneStartsRanksThatFindEachOther) {
  auto out_dir = make_temp_dir("slurm_wine");
  // No ddprun and no RANK/WORLD_SIZE: the ranks read SLURM_PROCID,
  // SLURM_STEP_NUM_TASKS, SLURM_LOCALID and the node list.
  auto r = run_process({"srun", "-n", "2", "--export=ALL", bin_path("wine_ddp"), "30", "10", "--checkpoint-dir", out_dir},
                       // One thread per rank, as ddprun gives the reference run.
                       one_rank({{"SLURM_CONF", conf_}, {"MASTER_PORT", std::to_string(free_port())},
                                 {"OMP_NUM_THREADS", "1"}},
                                std::chrono::seconds(120)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto ref = reference_run(2, {"30", "10"});
  EXPECT_EQ(loss_lines(r.out), ref.losses);
  EXPECT_EQ(compare_state_dicts(out_dir + "/model_final.pt", ref.dir + "/model_final.pt"), "identical");
  fs::remove_all(out_dir);
  fs::remove_all(ref.dir);
}

TEST_F(SlurmCluster, TheSbatchTemplateRunsAJob) {
  auto out_dir = make_temp_dir("sbatch_wine");
  auto r = run_process({"sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--output=" + out_dir + "/job.out",
                        std::string(DDP_SOURCE_DIR) + "/scripts/slurm/ddp.sbatch", bin_path("wine_ddp"), "20", "10",
                        "--checkpoint-dir", out_dir},
                       one_rank({{"SLURM_CONF", conf_}}, std::chrono::seconds(120)));
  std::string job_out = file_bytes(out_dir + "/job.out");
  ASSERT_EQ(r.exit_code, 0) << r.describe() << job_out;
  EXPECT_NE(job_out.find("2 tasks, master port"), std::string::npos) << job_out;
  EXPECT_EQ(loss_lines(job_out).size(), 20u) << job_out;  // rank 0 alone logs
  EXPECT_NE(job_out.find("Test accuracy:"), std::string::npos) << job_out;
  fs::remove_all(out_dir);
}

TEST_F(SlurmCluster, TheMpiSbatchTemplateRunsAJobOverMpi) {
  if (!ddp::mpi_available()) GTEST_SKIP() << "this build of ddp has no MPI (libopenmpi-dev)";
  auto out_dir = make_temp_dir("sbatch_mpi_wine");
  auto r = run_process({"sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--output=" + out_dir + "/job.out",
                        std::string(DDP_SOURCE_DIR) + "/scripts/slurm/ddp-mpi.sbatch", bin_path("wine_ddp"), "20",
                        "10", "--checkpoint-dir", out_dir},
                       one_rank({{"SLURM_CONF", conf_}}, std::chrono::seconds(180)));
  std::string job_out = file_bytes(out_dir + "/job.out");
  ASSERT_EQ(r.exit_code, 0) << r.describe() << job_out;
  EXPECT_NE(job_out.find("2 tasks over mpi"), std::string::npos) << job_out;
  auto ref = reference_run(2, {"20", "10"});
  EXPECT_EQ(loss_lines(job_out), ref.losses) << job_out;
  EXPECT_EQ(compare_state_dicts(out_dir + "/model_final.pt", ref.dir + "/model_final.pt"), "identical");
  fs::remove_all(out_dir);
  fs::remove_all(ref.dir);
}

// Two network namespaces, each a "node" with its own address, joined by a
// veth pair: ddprun on each node, rank 0's store on node 0's address.
class TwoNodes : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "creating network namespaces needs root";
    std::string id = std::to_string(getpid());
    ns_ = {"ddp_n0_" + id, "ddp_n1_" + id};
    veth_ = {"ddpv0_" + id, "ddpv1_" + id};
    // Test hosts on our own link: addresses nothing outside these
    // namespaces can reach.
    addr_ = {"10.213.77.1", "10.213.77.2"};
    std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", ns_[0]},
        {"ip", "netns", "add", ns_[1]},
        {"ip", "link", "add", veth_[0], "type", "veth", "peer", "name", veth_[1]},
        {"ip", "link", "set", veth_[0], "netns", ns_[0]},
        {"ip", "link", "set", veth_[1], "netns", ns_[1]},
    };
    for (int n = 0; n < 2; ++n) {
      steps.push_back({"ip", "netns", "exec", ns_[n], "ip", "addr", "add", addr_[n] + "/24", "dev", veth_[n]});
      steps.push_back({"ip", "netns", "exec", ns_[n], "ip", "link", "set", veth_[n], "up"});
      steps.push_back({"ip", "netns", "exec", ns_[n], "ip", "link", "set", "lo", "up"});
    }
    for (const auto& step : steps) {
      auto r = run_process(step, one_rank({}, std::chrono::seconds(20)));
      if (r.exit_code != 0) {
        std::string why = "cannot build the two-node network (" + step[0] + " " + step[1] + " " + step[2] +
                          "): " + r.err;
        TearDown();
        GTEST_SKIP() << why;
      }
    }
  }
  void TearDown() override {
    for (const auto& ns : ns_) run_process({"ip", "netns", "del", ns}, one_rank({}, std::chrono::seconds(20)));
    ns_.clear();
  }
  std::vector<std::string> ns_, veth_, addr_;
};

TEST_F(TwoNodes, FourRanksOnTwoNodesMatchFourRanksOnOne) {
  std::string port = "29555";  // inside node 0's own namespace, so always free
  std::vector<std::string> dirs = {make_temp_dir("node0"), make_temp_dir("node1")};
  std::vector<BackgroundProcess> nodes;
  for (int n = 0; n < 2; ++n) {
    nodes.push_back(start_background(
        {"ip", "netns", "exec", ns_[n], bin_path("ddprun"), "--nnodes", "2", "--node-rank", std::to_string(n),
         "--nproc-per-node", "2", "--master-addr", addr_[0], "--master-port", port, bin_path("wine_ddp"), "40", "20",
         "--checkpoint-dir", dirs[n]},
        one_rank({{"DDP_TIMEOUT_SECONDS", "60"}})));
  }
  std::vector<ProcessResult> results;
  for (auto& node : nodes) results.push_back(wait_background(node, std::chrono::seconds(120)));
  for (int n = 0; n < 2; ++n) ASSERT_EQ(results[n].exit_code, 0) << "node " << n << ": " << results[n].describe();
  // Global ranks 0,1 on node 0 and 2,3 on node 1; rank 0 logs and saves.
  EXPECT_NE(results[0].out.find("[rank0]: Epoch 39, Loss:"), std::string::npos) << results[0].out;
  EXPECT_EQ(results[1].out.find("Epoch"), std::string::npos) << results[1].out;
  EXPECT_TRUE(fs::exists(dirs[0] + "/model_final.pt"));
  EXPECT_FALSE(fs::exists(dirs[1] + "/model_final.pt"));

  auto ref = reference_run(4, {"40", "20"});
  EXPECT_EQ(loss_lines(results[0].out), ref.losses);
  EXPECT_EQ(compare_state_dicts(dirs[0] + "/model_final.pt", ref.dir + "/model_final.pt"), "identical");
  for (auto& d : dirs) fs::remove_all(d);
  fs::remove_all(ref.dir);
}

}  // namespace

namespace {

// Issue 12 item 2: a master whose packets are dropped. One network namespace holds a veth
// pair; the master's address has a static neighbour entry with a MAC address nobody owns, so
// every SYN vanishes without an answer (no RST, no ICMP). The reachability check's connect
// used to wait for the kernel's SYN retries (about 130 s) while the message said "within 5 s".
class BlackHoledMaster : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "creating a network namespace needs root";
    std::string id = std::to_string(getpid());
    ns_ = "ddp_bh_" + id;
    std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", ns_},
        {"ip", "netns", "exec", ns_, "ip", "link", "set", "lo", "up"},
        {"ip", "netns", "exec", ns_, "ip", "link", "add", "bhA", "type", "veth", "peer", "name", "bhB"},
        {"ip", "netns", "exec", ns_, "ip", "addr", "add", "10.213.79.1/24", "dev", "bhA"},
        {"ip", "netns", "exec", ns_, "ip", "link", "set", "bhA", "up"},
        {"ip", "netns", "exec", ns_, "ip", "link", "set", "bhB", "up"},
        {"ip", "netns", "exec", ns_, "ip", "neigh", "add", "10.213.79.2", "lladdr", "02:00:00:00:00:99", "dev",
         "bhA", "nud", "permanent"},
    };
    for (const auto& step : steps) {
      auto r = run_process(step, one_rank({}, std::chrono::seconds(20)));
      if (r.exit_code != 0) {
        std::string why = "cannot build the black-hole network ('ip netns' not permitted here?): " + r.err;
        TearDown();
        GTEST_SKIP() << why;
      }
    }
  }
  void TearDown() override {
    if (!ns_.empty()) run_process({"ip", "netns", "del", ns_}, one_rank({}, std::chrono::seconds(20)));
    ns_.clear();
  }
  std::string ns_;
};

TEST_F(BlackHoledMaster, ARankFailsWithinTheTimeoutNotAfterTheKernelsRetries) {
  auto r = run_process({"ip", "netns", "exec", ns_, bin_path("ddp_worker"), "ready"},
                       one_rank({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.213.79.2"},
                                 {"MASTER_PORT", "29555"}, {"DDP_TIMEOUT_SECONDS", "5"}},
                                std::chrono::seconds(200)));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("cannot reach the master at 10.213.79.2:29555 within 5 s: no answer to the connection "
                       "request"),
            std::string::npos)
      << r.describe();
  EXPECT_LT(r.seconds, 5 + 4.0) << r.describe();  // 1 s margin, plus starting the worker
  std::printf("[ measured ] black-holed master, DDP_TIMEOUT_SECONDS=5: rank 1 failed after %.2f s\n", r.seconds);
}

}  // namespace
