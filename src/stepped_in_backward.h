#pragma once

// Internal: which optimizers a BucketReducer steps inside backward
// (step_in_backward), so that code which must see the gradients before the
// step (GradScaler) can refuse such an optimizer instead of stepping it twice.

namespace torch::optim {
class Optimizer;
}

namespace ddp::detail {

/// Counts `optimizer` as stepped in backward (`stepped`), or one such use less.
void note_stepped_in_backward(const torch::optim::Optimizer* optimizer, bool stepped);
/// Whether some live BucketReducer steps `optimizer` inside backward.
bool is_stepped_in_backward(const torch::optim::Optimizer* optimizer);

}  // namespace ddp::detail
