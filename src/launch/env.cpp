#include <ddp/env.h>

#include "launch/env_impl.h"

#include <ddp/error.h>
#include <ddp/launch_env.h>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <vector>

namespace ddp {
namespace {

// The port rank 0 listens on when a launcher that has no notion of one (SLURM,
// MPI) started us and MASTER_PORT is unset. torchrun uses the same default.
constexpr int kDefaultMasterPort = 29500;

std::optional<int> lookup_int(const EnvLookup& lookup, const std::string& name) {
  auto value = lookup(name);
  if (!value) return std::nullopt;
  return parse_int_env(name, *value);
}

int require_int(const EnvLookup& lookup, const std::string& name, const std::string& because) {
  auto value = lookup_int(lookup, name);
  DDP_CHECK(value.has_value(), "ddp: environment variable ", name, " is not set, but ", because,
              " is. Launch with ddprun or torchrun, or set ", name, ".");
  return *value;
}

// SLURM writes tasks per node as "2(x3),1": two tasks on each of three nodes,
// then one. Returns the count for node `node_index`.
std::optional<int> slurm_tasks_on_node(const std::string& name, const std::string& spec,
                                       int node_index) {
  int node = 0;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int repeat = 1;
    size_t paren = item.find("(x");
    std::string count_text = item.substr(0, paren);
    if (paren != std::string::npos) {
      repeat = parse_int_env(name, item.substr(paren + 2, item.size() - paren - 3));
    }
    int count = parse_int_env(name, count_text);
    if (node_index < node + repeat) return count;
    node += repeat;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return std::nullopt;
}

bool is_loopback_only_job(int world_size, int local_world_size) {
  return world_size == local_world_size;
}

void validate(const World& w) {
  DDP_CHECK(w.world_size >= 1, "ddp: the world size (", w.source, ") is ", w.world_size,
              " but must be at least 1");
  DDP_CHECK(w.rank >= 0 && w.rank < w.world_size, "ddp: the rank (", w.source, ") is ", w.rank,
              " but must be in [0, ", w.world_size, "): RANK must be less than WORLD_SIZE");
  DDP_CHECK(w.local_world_size >= 1 && w.local_world_size <= w.world_size,
              "ddp: the local world size (", w.source, ") is ", w.local_world_size,
              " but must be in [1, ", w.world_size, "]");
  DDP_CHECK(w.local_rank >= 0 && w.local_rank < w.local_world_size, "ddp: the local rank (",
              w.source, ") is ", w.local_rank, " but must be in [0, ", w.local_world_size, ")");
  DDP_CHECK(w.node_rank >= 0, "ddp: the node rank (", w.source, ") is ", w.node_rank,
              " but must not be negative");
}

}  // namespace

void require_master(const World& w) {
  if (w.world_size > 1) {
    DDP_CHECK(!w.master_addr.empty(), "ddp: MASTER_ADDR is not set, but the world size is ",
                w.world_size, " (", w.source,
                "). Set MASTER_ADDR (and MASTER_PORT) to rank 0's host, or launch with ddprun; without a ",
                "master address, DDP_INIT_METHOD=file:///shared/path meets through a file instead.");
    DDP_CHECK(w.master_port != 0, "ddp: MASTER_PORT is not set, but the world size is ", w.world_size, " (",
              w.source, "). Set MASTER_PORT to a free port on rank 0's host, or launch with ddprun.");
    DDP_CHECK(w.master_port >= 1 && w.master_port <= 65535, "ddp: MASTER_PORT is ",
                w.master_port, " but must be in [1, 65535]");
  }
}

namespace {

void read_master(const EnvLookup& lookup, World& w, const std::string& fallback_addr) {
  w.master_addr = lookup(launch_env::kMasterAddr).value_or(fallback_addr);
  w.master_port = lookup_int(lookup, launch_env::kMasterPort).value_or(w.world_size > 1 ? kDefaultMasterPort : 0);
}

World from_torchrun(const EnvLookup& lookup) {
  World w;
  w.source = "torchrun";
  w.rank = require_int(lookup, launch_env::kRank, launch_env::kWorldSize);
  w.world_size = require_int(lookup, launch_env::kWorldSize, launch_env::kRank);
  w.local_rank = lookup_int(lookup, launch_env::kLocalRank).value_or(w.rank);
  // WORLD_SIZE first: LOCAL_WORLD_SIZE defaults to it, and a bad value must
  // be reported under the name the user set.
  DDP_CHECK(w.world_size >= 1, "ddp: environment variable WORLD_SIZE=", w.world_size,
            " must be at least 1 (it counts the processes of the whole job)");
  w.local_world_size = lookup_int(lookup, launch_env::kLocalWorldSize).value_or(w.world_size);
  DDP_CHECK(w.local_world_size >= 1, "ddp: environment variable LOCAL_WORLD_SIZE=", w.local_world_size,
              " must be at least 1");
  auto group_rank = lookup_int(lookup, launch_env::kGroupRank);
  w.node_rank = group_rank ? *group_rank : w.rank / w.local_world_size;
  w.master_addr = lookup(launch_env::kMasterAddr).value_or("");
  // Unset stays 0: require_master reports it where the TCP rendezvous needs
  // it; a file:// rendezvous does not.
  auto port = lookup(launch_env::kMasterPort);
  w.master_port = port ? parse_int_env(launch_env::kMasterPort, *port) : 0;
  return w;
}

World from_slurm(const EnvLookup& lookup) {
  World w;
  w.source = "slurm";
  w.rank = require_int(lookup, "SLURM_PROCID", "SLURM_STEP_ID");
  auto step_tasks = lookup_int(lookup, "SLURM_STEP_NUM_TASKS");
  w.world_size = step_tasks ? *step_tasks : require_int(lookup, "SLURM_NTASKS", "SLURM_PROCID");
  w.local_rank = lookup_int(lookup, "SLURM_LOCALID").value_or(0);
  w.node_rank = lookup_int(lookup, "SLURM_NODEID").value_or(0);
  // The step's own layout first; SLURM_NTASKS_PER_NODE (from --ntasks-per-node)
  // is one number for every node.
  std::optional<int> per_node;
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    if (auto spec = lookup(name)) {
      per_node = slurm_tasks_on_node(name, *spec, w.node_rank);
      if (per_node) break;
    }
  }
  if (!per_node) per_node = lookup_int(lookup, "SLURM_NTASKS_PER_NODE");
  w.local_world_size = per_node.value_or(w.world_size);
  std::string first_host;
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (auto list = lookup(name)) {
      first_host = first_host_of_slurm_nodelist(*list);
      break;
    }
  }
  read_master(lookup, w, first_host);
  return w;
}

World from_mpi(const EnvLookup& lookup, const std::string& source, const char* rank_var,
               const char* size_var, const char* local_rank_var, const char* local_size_var) {
  World w;
  w.source = source;
  w.rank = require_int(lookup, rank_var, size_var);
  w.world_size = require_int(lookup, size_var, rank_var);
  w.local_rank = lookup_int(lookup, local_rank_var).value_or(w.rank);
  DDP_CHECK(w.world_size >= 1, "ddp: environment variable ", size_var, "=", w.world_size,
            " must be at least 1 (it counts the processes of the whole job)");
  w.local_world_size = lookup_int(lookup, local_size_var).value_or(w.world_size);
  DDP_CHECK(w.local_world_size >= 1, "ddp: environment variable ", local_size_var, "=", w.local_world_size,
              " must be at least 1");
  w.node_rank = w.rank / w.local_world_size;
  // All ranks on one host: rank 0 is on this host too.
  read_master(lookup, w, is_loopback_only_job(w.world_size, w.local_world_size) ? "127.0.0.1" : "");
  return w;
}

}  // namespace

int parse_int_env(const std::string& name, const std::string& value) {
  size_t used = 0;
  long parsed = 0;
  bool ok = !value.empty();
  if (ok) {
    try {
      parsed = std::stol(value, &used, 10);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  DDP_CHECK(ok && used == value.size() && parsed >= INT32_MIN && parsed <= INT32_MAX,
              "ddp: environment variable ", name, "='", value, "' is not an integer");
  return static_cast<int>(parsed);
}

std::string first_host_of_slurm_nodelist(const std::string& nodelist) {
  // Cut at the first comma outside brackets.
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    if (nodelist[i] == ']') --depth;
    if (nodelist[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  std::string host = nodelist.substr(0, end);
  size_t open = host.find('[');
  if (open == std::string::npos) return host;
  size_t close = host.find(']', open);
  DDP_CHECK(close != std::string::npos, "ddp: cannot parse SLURM node list '", nodelist, "'");
  std::string ranges = host.substr(open + 1, close - open - 1);
  size_t stop = ranges.find_first_of(",-");
  return host.substr(0, open) + ranges.substr(0, stop) + host.substr(close + 1);
}

World world_from_env(const EnvLookup& lookup) {
  World w;
  if (lookup(launch_env::kRank) || lookup(launch_env::kWorldSize)) {
    w = from_torchrun(lookup);
  } else if (lookup("SLURM_PROCID") && (lookup("SLURM_STEP_ID") || lookup("SLURM_STEPID"))) {
    // Only inside an srun step: a batch script also sees SLURM_PROCID=0 and
    // the job's task count, but it is one process, not the job.
    w = from_slurm(lookup);
  } else if (lookup("OMPI_COMM_WORLD_RANK")) {
    w = from_mpi(lookup, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  } else if (lookup("PMI_RANK")) {
    w = from_mpi(lookup, "pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  }
  validate(w);
  return w;
}

World world_from_env() {
  return world_from_env([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

}  // namespace ddp
