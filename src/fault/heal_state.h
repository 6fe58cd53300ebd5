#pragma once

// The state a joiner receives, split so that several live members can each
// send a part of it. Every member that holds the state lists its tensors
// (the module's parameters and buffers, the optimizer's state) under
// canonical names, in one order, so that each computes the same plan of who
// sends what; the rest (step, random generator, sampler, extra state and the
// optimizer's structure) is small and comes from one member.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace ddp::detail {

/// Which of `senders` ships each item of `bytes`: the largest first, each to
/// the sender with the fewest bytes so far (the lowest index on a tie). Pure
/// and deterministic: every member and joiner computes the same plan.
std::vector<int> assign_to_senders(const std::vector<int64_t>& bytes, int senders);

/// A member's tensors in canonical order (sorted by name). Names are
/// "model|<parameter>", "model|<buffer>|buffer" and "optimizer|<path>", the
/// path being the key path in the optimizer's archive with each parameter's
/// address (torch keys the state by it) replaced by "p<group>.<index>", so
/// that the names agree across processes.
struct HealTensors {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;      // contiguous, detached
  std::vector<std::string> raw_paths;   // the optimizer's own key paths ("" for the module's)
  /// Of the names, dtypes and shapes: senders and joiner must agree on it.
  uint64_t fingerprint = 0;
  std::vector<int64_t> bytes() const;
};

/// Lists what `module` and `optimizer` hold (either may be null). With
/// `skeleton`, also writes there the optimizer's archive with every listed
/// tensor replaced by a zero-stride placeholder of its shape and dtype; the
/// optimizer's tensors under 1 KB (step counts, sizes) are not listed and
/// stay in the skeleton whole.
HealTensors list_heal_tensors(torch::nn::Module* module, torch::optim::Optimizer* optimizer,
                              torch::serialize::OutputArchive* skeleton);

/// The module's buffers alone, as the tensors the module holds (packing them
/// reads them, unpacking writes into them): what FaultTolerance makes equal
/// on every member at each step boundary, from rank 0's.
HealTensors module_buffers(torch::nn::Module& module);

/// The joiner's side: its own module's tensors, and the skeleton's
/// placeholders for the optimizer's state given storage of their shape, in
/// place (`names`, `raw_paths`: the sender's canonical names and raw paths
/// of the optimizer's listed tensors). Once the shards are unpacked into
/// them, the optimizer loads the skeleton itself.
HealTensors joiner_heal_tensors(torch::nn::Module* module, torch::serialize::InputArchive* skeleton,
                                const std::vector<std::string>& names, const std::vector<std::string>& raw_paths);

/// Copies the tensors assigned to `sender` into one buffer (an 8-byte
/// fingerprint first), and back out of it; unpacking refuses a buffer of
/// another fingerprint, naming `sender_id`.
at::Tensor pack_shard(const HealTensors& held, const std::vector<int>& plan, int sender);
int64_t shard_bytes(const HealTensors& held, const std::vector<int>& plan, int sender);
void unpack_shard(const at::Tensor& shard, HealTensors& into, const std::vector<int>& plan, int sender,
                  const std::string& sender_id);

}  // namespace ddp::detail
