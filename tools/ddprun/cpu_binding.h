// Which CPUs each local rank runs on: ddprun's --cpu-bind cores (equal shares of ddprun's own
// CPUs) and torchrun's --numa-binding (the CPUs near the rank's GPU, as torch/numa/binding.py
// picks them). The choices are pure functions of the topology; only read_* and plan_* look at
// the machine.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace ddprun {

// Logical CPU ids, ascending, without repeats.
using CpuList = std::vector<int>;

// Parses a kernel CPU list ("0-3,8,10-11", as in sysfs and /proc/self/status).
// Throws std::invalid_argument.
CpuList parse_cpu_list(const std::string& text);
// The kernel's compact form of `cpus`: "0-3,8".
std::string format_cpu_list(const CpuList& cpus);

// --cpu-bind cores: `allowed` cut into `nproc` contiguous shares, as equal as possible, the
// first ranks taking one more CPU each when it does not divide. With more ranks than CPUs,
// rank r gets the single CPU allowed[r % allowed.size()].
std::vector<CpuList> core_shares(const CpuList& allowed, int nproc);

// What torch/numa/binding.py reads from sysfs.
struct CpuTopology {
  std::map<int, CpuList> node_cpus;     // NUMA node -> its CPUs, allowed or not
  std::map<int, int> cpu_socket;        // CPU -> physical package
  std::map<int, CpuList> cpu_siblings;  // CPU -> the CPUs of its physical core
  std::map<int, CpuList> cpu_llc_peers;  // CPU -> the CPUs sharing its last-level cache
};

// The CPUs --numa-binding `mode` ("node", "socket", "exclusive" or "core-complex") gives the
// worker of GPU `gpu_index`, where gpu_nodes[i] is GPU i's NUMA node, restricted to `allowed`.
// Throws std::runtime_error when the mode cannot give it any CPU.
CpuList numa_cpus_for_gpu(const std::string& mode, int gpu_index, const std::vector<int>& gpu_nodes,
                          const CpuTopology& topology, const CpuList& allowed);

// ddprun's own CPUs (sched_getaffinity).
CpuList allowed_cpus();
CpuTopology read_cpu_topology();

// Per local rank, the CPUs it is bound to (empty: not bound), and what ddprun says about it.
struct CpuBindingPlan {
  std::vector<CpuList> by_local_rank;
  std::vector<std::string> notes;
};

// Works out --numa-binding / --cpu-bind for `nproc` local ranks on this machine. Throws
// std::runtime_error when the binding asked for cannot be done (say, more ranks than GPUs).
CpuBindingPlan plan_cpu_binding(const std::string& numa_binding, const std::string& cpu_bind, int nproc);

}  // namespace ddprun
