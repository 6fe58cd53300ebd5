// The Wine example started by the launchers of real clusters: Open MPI's
// mpirun and a single-host Slurm (slurmctld and slurmd configured and
// started here). The two-"node" tests over network namespaces are in
// test_cluster_two_nodes.cpp. Each test skips, saying why, when its tools or
// privileges are missing.

#include <ddp/process_group.h>

#include <gtest/gtest.h>
#include <support/cluster_jobs.h>
#include <support/launch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

TEST(Cluster, MpirunStartsRanksThatFindEachOther) {
  if (!have("mpirun")) GTEST_SKIP() << "mpirun (Debian's openmpi-bin) is not installed";
  auto dir = make_temp_dir("mpi");
  auto r = run_process({"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x",
                        "OMP_NUM_THREADS", bin_path("wine_ddp"), "30", "10", "--checkpoint-dir", dir},
                       one_rank({{"MASTER_PORT", std::to_string(free_port())}, {"OMP_NUM_THREADS", "1"}},
                                std::chrono::seconds(120)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  expect_matches_one_host(2, {"30", "10"}, r.out, dir);
  fs::remove_all(dir);
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
  expect_matches_one_host(2, {"30", "10"}, r.out, out_dir);
  fs::remove_all(out_dir);
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

// srun's PMIx plugin starts the ranks and wires MPI together: no mpirun.
// MPI's rank, size and local rank must agree with what world_from_env reads
// from Slurm's variables, or the backend refuses to start.
TEST_F(SlurmCluster, SrunWithPmixStartsMpiRanks) {
  if (!ddp::mpi_available()) GTEST_SKIP() << "this build of ddp has no MPI (libopenmpi-dev)";
  auto plugins = run_process({"srun", "--mpi=list"}, one_rank({{"SLURM_CONF", conf_}}, std::chrono::seconds(30)));
  if ((plugins.out + plugins.err).find("pmix") == std::string::npos) {
    GTEST_SKIP() << "this Slurm has no PMIx plugin: " << plugins.out << plugins.err;
  }
  auto out_dir = make_temp_dir("slurm_pmix_wine");
  auto r = run_process({"srun", "--mpi=pmix", "-n", "2", "--export=ALL", bin_path("wine_ddp"), "20", "10", "--backend",
                        "mpi", "--checkpoint-dir", out_dir},
                       one_rank({{"SLURM_CONF", conf_}, {"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(120)));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  expect_matches_one_host(2, {"20", "10"}, r.out, out_dir);
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
  expect_matches_one_host(2, {"20", "10"}, job_out, out_dir);
  fs::remove_all(out_dir);
}

}  // namespace
