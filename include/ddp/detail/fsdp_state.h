#pragma once

// Internal, not API: FullyShardedDataParallel's engine, which may change in
// any release. Only <ddp/fully_sharded_data_parallel.h> includes this file,
// after declaring FSDPOptions, ShardedMemory and detail::FsdpUnitModule,
// because FullyShardedDataParallel's templates call it inline. Use
// ddp::FullyShardedDataParallel instead.

#include <ddp/checkpoint.h>
#include <ddp/process_group.h>

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ddp::detail {

struct FlatLayout;  // <ddp/detail/optimizer_state.h>

/// The engine of FullyShardedDataParallel, independent of the module type.
class FsdpState {
 public:
  FsdpState(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<ProcessGroup> group, FSDPOptions options);
  ~FsdpState();
  FsdpState(const FsdpState&) = delete;
  FsdpState& operator=(const FsdpState&) = delete;

  void begin_forward();
  void end_forward(const std::vector<at::Tensor>& outputs);
  /// The forward of a Sequential root whose children form units.
  at::Tensor run_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input);
  bool runs_sequential() const { return !sequential_groups_.empty(); }

  void unit_before_forward(size_t unit);
  void unit_after_forward(size_t unit, const std::vector<at::Tensor>& outputs);

  std::vector<at::Tensor> shards() const;
  std::vector<std::string> unit_names() const;
  ShardedMemory memory() const;

  StateDict full_state_dict(bool rank0_only);
  void load_full_state_dict(const StateDict& state);
  c10::IValue full_optim_state_dict(torch::optim::Optimizer& optimizer, bool rank0_only);
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state);
  c10::IValue sharded_state_dict(torch::optim::Optimizer* optimizer);
  void load_sharded_state_dict(const c10::IValue& state, torch::optim::Optimizer* optimizer);

  void gather_all();
  void free_all();
  void set_requires_gradient_sync(bool sync) { require_sync_ = sync; }
  bool requires_gradient_sync() const { return require_sync_; }

 private:
  struct Unit;
  void build_units();
  void add_unit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params);
  void start_gather(Unit& unit);
  void finish_gather(Unit& unit);
  void release(Unit& unit);
  void prefetch_after(size_t unit, bool forward);
  void register_pre_backward(size_t unit, const std::vector<at::Tensor>& outputs);
  void pre_backward(size_t unit);
  void find_unreachable(const std::vector<at::Tensor>& outputs);
  void begin_backward();
  void on_gradient_ready(size_t unit, size_t param);
  void launch_ready_in_order();
  void reduce(Unit& unit);
  void finish_backward();
  void reset_backward_state();
  bool sharded() const;
  /// This rank's part of the unit's flat tensor: [first, first + second).
  std::pair<int64_t, int64_t> shard_range(const Unit& unit) const;
  FlatLayout layout_of(const Unit& unit) const;
  /// Each parameter's index in the root's named_parameters(), by name:
  /// the unwrapped model's optimizer-state keys.
  std::map<std::string, int64_t> parameter_indices() const;
  // Buffers and frozen parameters: whole on every rank.
  std::vector<std::pair<std::string, at::Tensor>> replicated() const;

  std::shared_ptr<torch::nn::Module> root_;
  std::shared_ptr<ProcessGroup> group_;
  FSDPOptions options_;
  std::vector<std::pair<std::string, at::Tensor>> frozen_;  // requires_grad false: not sharded
  std::vector<std::unique_ptr<Unit>> units_;  // the root unit, if any, is last
  std::vector<std::vector<size_t>> sequential_groups_;  // children of a Sequential root, by unit
  std::vector<size_t> sequential_unit_of_group_;
  std::vector<size_t> forward_order_;       // this iteration's non-root units, as they ran
  std::vector<size_t> last_forward_order_;  // the previous iteration's, for prefetching
  // One backward pass. Reduce-scatters are launched in reduce_order_ only
  // (the reverse of forward_order_, then the units that did not run, the
  // root last): the same order on every rank, whenever each rank's
  // gradients arrive. A unit is launched once it and every unit before it
  // in that order have all their gradients.
  std::vector<size_t> reduce_order_;
  size_t next_reduce_ = 0;
  std::vector<std::pair<size_t, size_t>> unreachable_;  // (unit, param) the last forward's graph cannot reach
  bool require_sync_ = true;  // false inside no_sync()
  bool callback_queued_ = false;
  bool in_backward_ = false;  // from the first hook of a backward until finish_backward has completed
};


}  // namespace ddp::detail
