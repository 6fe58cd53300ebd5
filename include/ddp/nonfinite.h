#pragma once

// A loss that is NaN or infinite on one rank poisons every rank's averaged
// gradients. Deciding per rank would let ranks fall out of step (one skips a
// backward the others run, and collectives no longer match), so the check is
// collective: every rank learns which ranks saw a non-finite loss and all of
// them act the same way.

#include <ddp/process_group.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace ddp {

/// What to do when any rank's loss is not finite.
enum class NonFinitePolicy {
  kSkipStep,  ///< every rank skips this step's backward and optimizer step
  kAbort,     ///< every rank throws an error naming the ranks
};

/// "skip" or "abort"; throws on anything else.
NonFinitePolicy parse_nonfinite_policy(const std::string& name);

/// The ranks whose `loss` is NaN or infinite, the same list on every rank.
/// Collective: one all-reduce of world_size bytes.
std::vector<int> ranks_with_nonfinite_loss(const at::Tensor& loss, ProcessGroup& group);

/// Applies `policy`: returns true when the step should go ahead, false when
/// every rank must skip it; with kAbort throws (on every rank) an error
/// naming the ranks and `where` (e.g. "epoch 3, step 41").
bool check_loss_is_finite(const at::Tensor& loss, ProcessGroup& group, NonFinitePolicy policy,
                          const std::string& where);

}  // namespace ddp
