#pragma once

// A loss that is NaN or infinite on one rank poisons every rank's averaged
// gradients. Deciding per rank would let ranks fall out of step (one skips a
// backward the others run, and collectives no longer match), so the check is
// collective: every rank learns which ranks saw a non-finite loss and all of
// them act the same way.

#include <ddp/export.h>
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
DDP_API NonFinitePolicy parse_nonfinite_policy(const std::string& name);

/// The ranks whose `loss` is NaN or infinite, the same list on every rank.
/// Collective: one all-reduce of world_size bytes.
DDP_API std::vector<int> ranks_with_nonfinite_loss(const at::Tensor& loss, ProcessGroup& group);

/// Applies `policy`: returns true when the step should go ahead, false when
/// every rank must skip it; with kAbort throws (on every rank) an error
/// naming the ranks and `where` (e.g. "epoch 3, step 41").
DDP_API bool check_loss_is_finite(const at::Tensor& loss, ProcessGroup& group, NonFinitePolicy policy,
                                  const std::string& where);

/// A loss that rode on DDP's gradient all-reduce (DDPOptions().carry_loss(true),
/// model.note_loss(loss) before backward): what every rank knows once
/// backward has returned, with no collective of its own.
struct ReducedLoss {
  /// Whether a loss was noted for the last synchronised backward.
  bool valid = false;
  /// The ranks whose loss was NaN or infinite, the same list on every rank.
  std::vector<int> nonfinite_ranks;
  /// The loss averaged over the ranks (those with a finite loss count as
  /// their loss, the others as 0).
  double average = 0.0;
};

/// check_loss_is_finite's decision for a loss that rode on the gradient
/// all-reduce: false (every rank skips the optimizer step; the gradients of
/// that backward hold the non-finite values and must not be used) or, with
/// kAbort, the same error on every rank. Local: no collective.
///
///   ddp_model.note_loss(loss);
///   loss.backward();
///   if (!ddp::check_loss_is_finite(ddp_model.reduced_loss(), policy, where)) continue;
///   optimizer.step();
DDP_API bool check_loss_is_finite(const ReducedLoss& loss, NonFinitePolicy policy, const std::string& where);

}  // namespace ddp
