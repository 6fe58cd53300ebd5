// What the fault-tolerant replicas in tests/workers share (ft_worker, ft_heal_worker,
// ft_diloco_worker): their settings from the environment, the hash by which the tests compare
// replicas' weights bit for bit, the step line the tests parse (ft_replica_job.h's
// step_lines), and the exit codes the tests read. Only ddp's public API: ft_heal_worker links
// ddp::ddp alone.
#pragma once

#include <ddp/fault_tolerance.h>

#include <torch/nn/module.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace ddp::testing {

// The integer in environment variable `name`, or `fallback` where it is unset or empty.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

// FNV-1a over the tensors' bytes: equal exactly when the weights are equal bit for bit.
inline uint64_t hash_of(const std::vector<at::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ULL;
  for (const auto& p : tensors) {
    at::Tensor t = p.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (size_t i = 0; i < static_cast<size_t>(t.nbytes()); ++i) h = (h ^ bytes[i]) * 1099511628211ULL;
  }
  return h;
}

inline uint64_t hash_of(const torch::nn::Module& module) { return hash_of(module.parameters()); }

// {3, 1, 4} -> "3,1,4".
inline std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// The line a replica prints for committed step `step` (not flushed), stamped before the hash:
//   step <s> gen <g> rank <r>/<n> hash <weights' hash> t <wall clock, us> window <i,...> mine <i,...>
// `weights` null: not hashed at this step, the hash printed as zeros.
inline void print_step_line(int64_t step, int64_t gen, int rank, int size, const torch::nn::Module* weights,
                            const std::vector<int64_t>& window, const std::vector<int64_t>& mine) {
  const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  std::printf("step %lld gen %lld rank %d/%d hash %016llx t %lld window %s mine %s\n", static_cast<long long>(step),
              static_cast<long long>(gen), rank, size,
              weights ? static_cast<unsigned long long>(hash_of(*weights)) : 0ULL, static_cast<long long>(now_us),
              join(window).c_str(), join(mine).c_str());
}

// A replica's main: `body`'s exit code; 3 when the replica was fenced out of the job, 1 on any
// other error, each said on stderr.
template <typename Body>
int run_replica(Body body) {
  try {
    return body();
  } catch (const ddp::FencedOut& e) {
    std::fprintf(stderr, "fenced: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace ddp::testing
