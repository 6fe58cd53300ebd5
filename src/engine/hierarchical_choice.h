#pragma once

// Internal: whether DistributedDataParallel reduces its buckets hierarchically
// (within each host, then between hosts) when the user set no comm hook.
// Every rank votes (its host, its wish from DDPOptions::hierarchical_allreduce
// or DDP_HIERARCHICAL, whether its parameters are on the CPU) and every rank
// decides from all the votes, so all take the same path even where
// DDP_HIERARCHICAL differs between nodes. A pure function, for tests.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

/// What one rank asks for. kInvalid: DDP_HIERARCHICAL held something else
/// than 0, 1 or auto; the job fails on every rank alike.
enum class HierarchicalWish : int64_t { kInvalid = 0, kOffByOption, kOffByEnv, kAuto, kOnByOption };

/// This rank's wish: DDPOptions::hierarchical_allreduce when set (true
/// insists, false refuses), else DDP_HIERARCHICAL (`env`, null when unset):
/// "0" refuses; unset, "", "1" and "auto" leave it to ddp.
HierarchicalWish hierarchical_wish(const std::optional<bool>& option, const char* env);

/// One rank's vote.
struct HierarchicalVote {
  int64_t host = 0;  ///< the rank's host, as a hash of shm_host_identity()
  HierarchicalWish wish = HierarchicalWish::kAuto;
  bool cpu = true;  ///< every parameter on the CPU (the node stage may be shared memory)
};

struct HierarchicalChoice {
  /// Reduce hierarchically.
  bool hierarchical = false;
  /// Each rank's host, numbered in the order the ranks first name them.
  std::vector<int> host_of_rank;
  int hosts = 0;
  /// More than one host, and more than one rank on at least one of them:
  /// the layout in which the hierarchical path sends fewer bytes between
  /// hosts than the flat all-reduce.
  bool layout_fits = false;
  /// When the layout fits but a rank said no: what said it, for the start-up
  /// line ("DDP_HIERARCHICAL=0", "DDP_HIERARCHICAL=0 on rank 2").
  std::string why_flat;
  /// Non-empty: every rank must fail with this message.
  std::string error;
};

/// The choice from every rank's vote, by rank.
HierarchicalChoice choose_hierarchical_allreduce(const std::vector<HierarchicalVote>& votes);

}  // namespace ddp::detail
