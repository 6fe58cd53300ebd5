#include "cpu_binding.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace ddprun {
namespace {

bool is_digits(const std::string& text) {
  return !text.empty() && text.size() <= 9 && text.find_first_not_of("0123456789") == std::string::npos;
}

std::string trimmed(std::string text) {
  const size_t end = text.find_last_not_of(" \t\r\n");
  text.erase(end == std::string::npos ? 0 : end + 1);
  return text.substr(std::min(text.size(), text.find_first_not_of(" \t\r\n")));
}

// The file's first line, trimmed; empty if it cannot be read.
std::string read_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return trimmed(line);
}

std::vector<std::string> directory_entries(const std::string& path) {
  std::vector<std::string> names;
  if (DIR* directory = ::opendir(path.c_str())) {
    while (dirent* entry = ::readdir(directory)) {
      if (entry->d_name[0] != '.') names.emplace_back(entry->d_name);
    }
    ::closedir(directory);
  }
  std::sort(names.begin(), names.end());
  return names;
}

CpuList intersect(const CpuList& a, const CpuList& b) {
  CpuList both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  return both;
}

// CPUs of `cpus` grouped by a representative (the smallest CPU of the group `group_of` names),
// in order of their representatives.
std::map<int, CpuList> group_by(const CpuList& cpus, const std::map<int, CpuList>& group_of) {
  std::map<int, CpuList> groups;
  for (int cpu : cpus) {
    auto found = group_of.find(cpu);
    const int key = found == group_of.end() || found->second.empty() ? cpu : found->second.front();
    groups[key].push_back(cpu);
  }
  return groups;
}

CpuList node_cpus(const CpuTopology& topology, int node, const CpuList& allowed) {
  auto found = topology.node_cpus.find(node);
  return found == topology.node_cpus.end() ? CpuList{} : intersect(found->second, allowed);
}

// The node's GPUs, ascending, and where gpu_index is among them.
size_t position_among_node_gpus(int gpu_index, const std::vector<int>& gpu_nodes, size_t* count) {
  size_t position = 0;
  *count = 0;
  for (int gpu = 0; gpu < static_cast<int>(gpu_nodes.size()); ++gpu) {
    if (gpu_nodes[gpu] != gpu_nodes[gpu_index]) continue;
    if (gpu < gpu_index) ++position;
    ++*count;
  }
  return position;
}

// Per visible GPU, in CUDA's index order, its NUMA node; *why says why there are none.
std::vector<int> visible_gpu_numa_nodes(std::string* why) {
  // The driver names each GPU by its PCI address; CUDA numbers them in PCI order when the GPUs
  // are alike (its default FASTEST_FIRST order), which is torchrun's GPU index too.
  const std::vector<std::string> addresses = directory_entries("/proc/driver/nvidia/gpus");
  if (addresses.empty()) {
    *why = "no NVIDIA GPU is installed";
    return {};
  }
  std::vector<std::string> visible = addresses;
  if (const char* list = std::getenv("CUDA_VISIBLE_DEVICES")) {
    visible.clear();
    std::istringstream entries(list);
    for (std::string entry; std::getline(entries, entry, ',');) {
      entry = trimmed(entry);
      if (entry.empty() || entry[0] == '-') break;  // where CUDA stops too
      if (!is_digits(entry)) {
        *why = "CUDA_VISIBLE_DEVICES names GPUs by UUID, which ddprun cannot map to PCI addresses";
        return {};
      }
      const size_t index = std::stoul(entry);
      if (index < addresses.size()) visible.push_back(addresses[index]);
    }
    if (visible.empty()) {
      *why = "CUDA_VISIBLE_DEVICES hides every GPU";
      return {};
    }
  }
  std::vector<int> nodes;
  for (const std::string& address : visible) {
    std::string text = read_line("/sys/bus/pci/devices/" + address + "/numa_node");
    // -1 (or nothing) on a machine with a single node: node 0, as torch reads it.
    nodes.push_back(is_digits(text) ? std::stoi(text) : 0);
  }
  return nodes;
}

}  // namespace

CpuList parse_cpu_list(const std::string& text) {
  std::set<int> cpus;
  std::istringstream ranges(trimmed(text));
  auto bad = [&] {
    return std::invalid_argument("'" + text + "' is not a CPU list such as 0-3,8");
  };
  for (std::string range; std::getline(ranges, range, ',');) {
    range = trimmed(range);
    if (range.empty()) continue;
    const size_t dash = range.find('-');
    const std::string first = range.substr(0, dash);
    const std::string last = dash == std::string::npos ? first : range.substr(dash + 1);
    if (!is_digits(first) || !is_digits(last) || std::stoi(last) < std::stoi(first)) throw bad();
    for (int cpu = std::stoi(first); cpu <= std::stoi(last); ++cpu) cpus.insert(cpu);
  }
  return CpuList(cpus.begin(), cpus.end());
}

std::string format_cpu_list(const CpuList& cpus) {
  std::string text;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!text.empty()) text += ',';
    text += std::to_string(cpus[i]);
    if (j > i) text += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return text;
}

std::vector<CpuList> core_shares(const CpuList& allowed, int nproc) {
  std::vector<CpuList> shares(static_cast<size_t>(std::max(nproc, 0)));
  if (allowed.empty() || nproc <= 0) return shares;
  const size_t n = static_cast<size_t>(nproc);
  if (n > allowed.size()) {
    for (size_t rank = 0; rank < n; ++rank) shares[rank] = {allowed[rank % allowed.size()]};
    return shares;
  }
  const size_t base = allowed.size() / n;
  const size_t extra = allowed.size() % n;
  size_t start = 0;
  for (size_t rank = 0; rank < n; ++rank) {
    const size_t size = base + (rank < extra ? 1 : 0);
    shares[rank].assign(allowed.begin() + static_cast<std::ptrdiff_t>(start),
                        allowed.begin() + static_cast<std::ptrdiff_t>(start + size));
    start += size;
  }
  return shares;
}

CpuList numa_cpus_for_gpu(const std::string& mode, int gpu_index, const std::vector<int>& gpu_nodes,
                          const CpuTopology& topology, const CpuList& allowed) {
  if (gpu_index < 0 || gpu_index >= static_cast<int>(gpu_nodes.size())) {
    throw std::runtime_error("--numa-binding binds local rank " + std::to_string(gpu_index) +
                             " near GPU " + std::to_string(gpu_index) + ", but only " +
                             std::to_string(gpu_nodes.size()) +
                             " GPU(s) are visible; use at most that many --nproc-per-node or drop --numa-binding");
  }
  const int node = gpu_nodes[gpu_index];
  const CpuList near = node_cpus(topology, node, allowed);
  if (near.empty()) {
    throw std::runtime_error("--numa-binding " + mode + ": NUMA node " + std::to_string(node) + " of GPU " +
                             std::to_string(gpu_index) + " has no CPU that ddprun may use");
  }
  if (mode == "node") return near;
  if (mode == "socket") {
    // Every node whose CPUs sit in the GPU's socket, judged by the node's first allowed CPU.
    auto socket_of = [&](int cpu) {
      auto found = topology.cpu_socket.find(cpu);
      return found == topology.cpu_socket.end() ? 0 : found->second;
    };
    const int socket = socket_of(near.front());
    std::set<int> cpus;
    for (const auto& [other_node, ignored] : topology.node_cpus) {
      const CpuList other = node_cpus(topology, other_node, allowed);
      if (!other.empty() && socket_of(other.front()) == socket) cpus.insert(other.begin(), other.end());
    }
    return CpuList(cpus.begin(), cpus.end());
  }
  size_t node_gpus = 0;
  const size_t position = position_among_node_gpus(gpu_index, gpu_nodes, &node_gpus);
  if (mode == "exclusive") {
    // The node's physical cores, dealt out to its GPUs in equal contiguous runs.
    const std::map<int, CpuList> cores = group_by(near, topology.cpu_siblings);
    const size_t per_gpu = cores.size() / node_gpus;
    const size_t extra = cores.size() % node_gpus;
    if (per_gpu < 1) {
      throw std::runtime_error("--numa-binding exclusive: NUMA node " + std::to_string(node) + " has " +
                               std::to_string(cores.size()) + " physical core(s) for its " +
                               std::to_string(node_gpus) + " GPUs; use --numa-binding node");
    }
    const size_t start = position * per_gpu + std::min(position, extra);
    const size_t end = start + per_gpu + (position < extra ? 1 : 0);
    CpuList cpus;
    size_t index = 0;
    for (const auto& [ignored, core] : cores) {
      if (index >= start && index < end) cpus.insert(cpus.end(), core.begin(), core.end());
      ++index;
    }
    std::sort(cpus.begin(), cpus.end());
    return cpus;
  }
  if (mode == "core-complex") {
    // One last-level-cache group per GPU, the largest groups first, wrapping around.
    const std::map<int, CpuList> groups = group_by(near, topology.cpu_llc_peers);
    std::vector<std::pair<int, CpuList>> ordered(groups.begin(), groups.end());
    std::stable_sort(ordered.begin(), ordered.end(),
                     [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
    return ordered[position % ordered.size()].second;
  }
  throw std::runtime_error("unknown --numa-binding mode '" + mode +
                           "' (expected node, socket, exclusive or core-complex)");
}

CpuList allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  CpuList cpus;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

CpuTopology read_cpu_topology() {
  CpuTopology topology;
  for (const std::string& entry : directory_entries("/sys/devices/system/node")) {
    if (entry.rfind("node", 0) != 0 || !is_digits(entry.substr(4))) continue;
    try {
      topology.node_cpus[std::stoi(entry.substr(4))] =
          parse_cpu_list(read_line("/sys/devices/system/node/" + entry + "/cpulist"));
    } catch (const std::invalid_argument&) {
    }
  }
  for (const std::string& entry : directory_entries("/sys/devices/system/cpu")) {
    if (entry.rfind("cpu", 0) != 0 || !is_digits(entry.substr(3))) continue;
    const int cpu = std::stoi(entry.substr(3));
    const std::string base = "/sys/devices/system/cpu/" + entry;
    const std::string package = read_line(base + "/topology/physical_package_id");
    if (is_digits(package)) topology.cpu_socket[cpu] = std::stoi(package);
    try {
      topology.cpu_siblings[cpu] = parse_cpu_list(read_line(base + "/topology/thread_siblings_list"));
      // The highest-level data or unified cache, as torch picks it.
      int best_level = -1;
      for (const std::string& cache : directory_entries(base + "/cache")) {
        if (cache.rfind("index", 0) != 0) continue;
        const std::string type = read_line(base + "/cache/" + cache + "/type");
        const std::string level = read_line(base + "/cache/" + cache + "/level");
        if ((type != "Unified" && type != "Data") || !is_digits(level) || std::stoi(level) <= best_level) continue;
        best_level = std::stoi(level);
        topology.cpu_llc_peers[cpu] = parse_cpu_list(read_line(base + "/cache/" + cache + "/shared_cpu_list"));
      }
    } catch (const std::invalid_argument&) {
    }
  }
  return topology;
}

CpuBindingPlan plan_cpu_binding(const std::string& numa_binding, const std::string& cpu_bind, int nproc) {
  CpuBindingPlan plan;
  plan.by_local_rank.resize(static_cast<size_t>(nproc));
  const CpuList allowed = allowed_cpus();
  auto describe = [&](const std::string& what) {
    std::string text = what + ":";
    for (int rank = 0; rank < nproc; ++rank) {
      text += (rank == 0 ? " " : "; ") + std::string("local rank ") + std::to_string(rank) + " on CPUs " +
              format_cpu_list(plan.by_local_rank[static_cast<size_t>(rank)]);
    }
    plan.notes.push_back(text);
  };
  if (cpu_bind == "cores") {
    plan.by_local_rank = core_shares(allowed, nproc);
    if (static_cast<size_t>(nproc) > allowed.size()) {
      plan.notes.push_back("--cpu-bind cores: " + std::to_string(nproc) + " workers share ddprun's " +
                           std::to_string(allowed.size()) + " CPU(s) (" + format_cpu_list(allowed) +
                           "), one CPU each, round-robin");
    }
    describe("--cpu-bind cores");
    return plan;
  }
  if (numa_binding.empty()) return plan;
  std::string why;
  const std::vector<int> gpu_nodes = visible_gpu_numa_nodes(&why);
  if (gpu_nodes.empty()) {
    plan.notes.push_back("--numa-binding " + numa_binding + " does nothing here: " + why +
                         ", and it binds each local rank near the GPU of the same index; workers run unbound");
    return plan;
  }
  const CpuTopology topology = read_cpu_topology();
  if (topology.node_cpus.size() <= 1) {
    plan.notes.push_back("--numa-binding " + numa_binding +
                         " does nothing here: this machine has a single NUMA node, so every CPU is as near "
                         "to the GPUs as any other; workers run unbound");
    return plan;
  }
  for (int rank = 0; rank < nproc; ++rank) {
    plan.by_local_rank[static_cast<size_t>(rank)] = numa_cpus_for_gpu(numa_binding, rank, gpu_nodes, topology, allowed);
  }
  describe("--numa-binding " + numa_binding);
  return plan;
}

}  // namespace ddprun
