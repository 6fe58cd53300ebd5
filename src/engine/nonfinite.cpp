#include <ddp/nonfinite.h>

#include <ddp/error.h>

#include <ATen/Functions.h>

#include <sstream>

namespace ddp {

NonFinitePolicy parse_nonfinite_policy(const std::string& name) {
  if (name == "skip") return NonFinitePolicy::kSkipStep;
  if (name == "abort") return NonFinitePolicy::kAbort;
  DDP_CHECK(false, "ddp: unknown non-finite policy '", name, "'; use skip or abort");
}

std::vector<int> ranks_with_nonfinite_loss(const at::Tensor& loss, ProcessGroup& group) {
  at::Tensor flags = at::zeros({group.size()}, group.control_options().dtype(at::kInt));
  // The flag is computed where the loss lives and copied into place: for a
  // GPU loss under NCCL nothing here waits for the GPU (the list is read on
  // the host below, once the all-reduce is done).
  flags.select(0, group.rank()).copy_(at::isfinite(loss.detach()).all().logical_not());
  CollectiveTag tag("nonfinite check");
  group.all_reduce(flags, c10d::ReduceOp::MAX);
  flags = flags.cpu();
  std::vector<int> bad;
  const int32_t* data = flags.data_ptr<int32_t>();
  for (int r = 0; r < group.size(); ++r) {
    if (data[r] != 0) bad.push_back(r);
  }
  return bad;
}

namespace {

bool apply_policy(const std::vector<int>& bad, NonFinitePolicy policy, const std::string& where) {
  if (bad.empty()) return true;
  std::ostringstream ranks;
  for (size_t i = 0; i < bad.size(); ++i) ranks << (i ? ", " : "") << bad[i];
  DDP_CHECK(policy != NonFinitePolicy::kAbort, "ddp: the loss is not finite on rank(s) ", ranks.str(),
              " at ", where, "; every rank stops. Lower the learning rate, check the data, or pass a ",
              "skip policy to drop such steps.");
  return false;
}

}  // namespace

bool check_loss_is_finite(const at::Tensor& loss, ProcessGroup& group, NonFinitePolicy policy,
                          const std::string& where) {
  return apply_policy(ranks_with_nonfinite_loss(loss, group), policy, where);
}

bool check_loss_is_finite(const ReducedLoss& loss, NonFinitePolicy policy, const std::string& where) {
  DDP_CHECK(loss.valid, "ddp: no loss rode on the last backward's gradient all-reduce; call model.note_loss(loss) "
            "before loss.backward(), with DDPOptions().carry_loss(true), outside no_sync()");
  return apply_policy(loss.nonfinite_ranks, policy, where);
}

}  // namespace ddp
