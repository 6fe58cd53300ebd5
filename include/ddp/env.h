#pragma once

// Where this process stands in a distributed job, read from the variables that
// launchers set: torchrun and ddprun first, then SLURM's srun, then Open MPI's
// mpirun, then MPICH/PMI. With none of them set, the job is one process.

#include <ddp/export.h>
#include <functional>
#include <optional>
#include <string>

namespace ddp {

/// The place of one process in a job.
///
/// rank = node_rank * local_world_size + local_rank on homogeneous jobs.
struct World {
  int rank = 0;              ///< global rank, 0 .. world_size-1
  int local_rank = 0;        ///< rank within this node, selects the GPU
  int world_size = 1;        ///< processes in the whole job
  int local_world_size = 1;  ///< processes on this node
  int node_rank = 0;         ///< index of this node (torchrun's GROUP_RANK)
  std::string master_addr;   ///< host of rank 0's store; empty for one process
  int master_port = 0;       ///< port of rank 0's store; 0 for one process
  /// Which launcher's variables described the world: "torchrun", "slurm",
  /// "openmpi", "pmi" or "single".
  std::string source = "single";

  bool is_distributed() const { return world_size > 1; }
};

/// Looks up one environment variable; returns nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

/// Reads the world from `lookup`. Throws c10::Error naming the variable and
/// its value when they are malformed or inconsistent.
DDP_API World world_from_env(const EnvLookup& lookup);

/// Reads the world from this process's environment.
DDP_API World world_from_env();

}  // namespace ddp
