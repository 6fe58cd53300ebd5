#include <ddp/env.h>

#include "launch/env_impl.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>

namespace {

using Env = std::map<std::string, std::string>;

ddp::World world_of(const Env& env) {
  return ddp::world_from_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const Env& env) {
  try {
    world_of(env);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// What the TCPStore rendezvous says of the world (ProcessGroup::create calls
// require_master for every backend but mpi, which needs no master).
std::string master_error_of(const Env& env) {
  try {
    ddp::require_master(world_of(env));
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Env, NothingSetIsOneProcess) {
  auto w = world_of({});
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.world_size, 1);
  EXPECT_EQ(w.local_world_size, 1);
  EXPECT_EQ(w.source, "single");
  EXPECT_FALSE(w.is_distributed());
}

TEST(Env, TorchrunVariables) {
  auto w = world_of({{"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"},
                     {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.master_addr, "10.1.2.3");
  EXPECT_EQ(w.master_port, 29400);
  EXPECT_EQ(w.source, "torchrun");
}

TEST(Env, NodeRankDefaultsFromGlobalRank) {
  auto w = world_of({{"RANK", "6"}, {"LOCAL_RANK", "2"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"},
                     {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(w.node_rank, 1);  // global rank = node_rank * nproc_per_node + local_rank
}

TEST(Env, RankMustBeBelowWorldSize) {
  auto message = error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(message.find("RANK"), std::string::npos) << message;
  EXPECT_NE(message.find("2"), std::string::npos) << message;
}

TEST(Env, NonNumericValueNamesVariableAndValue) {
  auto message = error_of({{"RANK", "0"}, {"WORLD_SIZE", "two"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(message.find("WORLD_SIZE='two'"), std::string::npos) << message;
  message = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "12x"}});
  EXPECT_NE(message.find("MASTER_PORT='12x'"), std::string::npos) << message;
  message = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", ""}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(message.find("LOCAL_RANK=''"), std::string::npos) << message;
}

TEST(Env, MissingMasterAddrIsAnError) {
  auto message = master_error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}});
  EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
  message = master_error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
  EXPECT_NE(message.find("MASTER_PORT"), std::string::npos) << message;
  // Reading an mpirun world alone needs no master: the mpi backend has none.
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
            "");
}

TEST(Env, RankWithoutWorldSizeIsAnError) {
  auto message = error_of({{"RANK", "0"}});
  EXPECT_NE(message.find("WORLD_SIZE"), std::string::npos) << message;
}

// Issue 12 item 6: LOCAL_WORLD_SIZE defaults to WORLD_SIZE, so a zero
// WORLD_SIZE used to be reported as LOCAL_WORLD_SIZE=0, which nobody set.
TEST(Env, ZeroWorldSizeNamesWorldSizeNotLocalWorldSize) {
  auto message = error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(message.find("WORLD_SIZE=0 must be at least 1"), std::string::npos) << message;
  EXPECT_EQ(message.find("LOCAL_WORLD_SIZE"), std::string::npos) << message;
  message = error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "0"}});
  EXPECT_NE(message.find("OMPI_COMM_WORLD_SIZE=0 must be at least 1"), std::string::npos) << message;
  EXPECT_EQ(message.find("LOCAL_SIZE"), std::string::npos) << message;
}

TEST(Env, LocalRankMustFitLocalWorld) {
  auto message = error_of({{"RANK", "1"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}, {"WORLD_SIZE", "4"},
                           {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(message.find("local rank"), std::string::npos) << message;
}

TEST(Env, PortOutOfRange) {
  auto message = master_error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
  EXPECT_NE(message.find("MASTER_PORT"), std::string::npos) << message;
}

TEST(Env, SlurmStep) {
  auto w = world_of({{"SLURM_PROCID", "3"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "1"}, {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"}});
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.world_size, 4);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.master_addr, "gpu07");
  EXPECT_EQ(w.master_port, 29500);
}

TEST(Env, SlurmStepTasksPerNodeAndExplicitMaster) {
  auto w = world_of({{"SLURM_PROCID", "2"}, {"SLURM_STEP_ID", "1"}, {"SLURM_STEP_NUM_TASKS", "3"},
                     {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"},
                     {"SLURM_STEP_TASKS_PER_NODE", "2,1"}, {"SLURM_JOB_NODELIST", "a,b"},
                     {"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(w.world_size, 3);  // the step's tasks, not the allocation's
  EXPECT_EQ(w.local_world_size, 1);
  EXPECT_EQ(w.master_addr, "10.0.0.9");
  EXPECT_EQ(w.master_port, 4000);
}

TEST(Env, SlurmRepeatedTasksPerNode) {
  auto w = world_of({{"SLURM_PROCID", "5"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x3)"}, {"SLURM_NODELIST", "n1"}});
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.master_addr, "n1");
}

TEST(Env, SlurmBatchScriptWithoutStepIsOneProcess) {
  // The batch shell sees SLURM_PROCID=0 and the job's task count but is
  // one process; treating it as rank 0 of 4 would wait for peers forever.
  auto w = world_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "n[1-2]"}});
  EXPECT_EQ(w.world_size, 1);
  EXPECT_EQ(w.source, "single");
}

TEST(Env, TorchrunWinsOverSlurm) {
  auto w = world_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"},
                     {"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 1);
}

TEST(Env, OpenMpiOnOneHost) {
  auto w = world_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(w.source, "openmpi");
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.world_size, 2);
  EXPECT_EQ(w.master_addr, "127.0.0.1");
  EXPECT_EQ(w.master_port, 29500);
}

TEST(Env, OpenMpiAcrossHostsNeedsMasterAddr) {
  auto message = master_error_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
}

TEST(Env, Pmi) {
  auto w = world_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "3"}, {"MASTER_ADDR", "m"}, {"MASTER_PORT", "7"}});
  EXPECT_EQ(w.source, "pmi");
  EXPECT_EQ(w.world_size, 3);
  EXPECT_EQ(w.master_addr, "m");
}

TEST(Env, SlurmNodelistFirstHost) {
  EXPECT_EQ(ddp::first_host_of_slurm_nodelist("node1"), "node1");
  EXPECT_EQ(ddp::first_host_of_slurm_nodelist("node1,node2"), "node1");
  EXPECT_EQ(ddp::first_host_of_slurm_nodelist("node[03-05,9],gpu1"), "node03");
  EXPECT_EQ(ddp::first_host_of_slurm_nodelist("n[7,9]"), "n7");
  EXPECT_EQ(ddp::first_host_of_slurm_nodelist("rack[2-3]-ib"), "rack2-ib");
}

}  // namespace
