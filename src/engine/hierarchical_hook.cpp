// Hierarchical all-reduce as a DDP communication hook: reduce each bucket to
// the node's first rank, all-reduce between those leaders, broadcast back in
// the node. Only the leaders' all-reduce crosses between nodes, and it moves
// one bucket per node instead of one per rank.
//
// The three steps depend on each other, so they run one after the other on
// a thread of the hook's own (hook_thread.h), on the mesh's groups, which
// DDP does not use, while the autograd thread goes on with the rest of
// backward (overlap is kept).

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/error.h>

#include "engine/hierarchical_hook.h"
#include "engine/hook_thread.h"

#include <string>
#include <utility>

namespace ddp {
namespace {

class HierarchicalAllreduceHook : public CommHook {
 public:
  HierarchicalAllreduceHook(std::shared_ptr<ProcessGroup> node, std::shared_ptr<ProcessGroup> leaders, int world_size)
      : node_(std::move(node)), leaders_(std::move(leaders)), mesh_size_(world_size) {}

  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
    DDP_CHECK(!bucket.scatters(), "ddp: hierarchical_allreduce_hook all-reduces DDP's buckets; FSDP reduce-scatters "
              "into shards, so give FSDP a 2-D DeviceMesh (HSDP) instead");
    DDP_CHECK(group.size() == mesh_size_, "ddp: hierarchical_allreduce_hook was built over a mesh of ", mesh_size_,
              " ranks but DDP's group has ", group.size(), "; build the mesh over DDP's own group");
    return thread_.submit(bucket.buffer(), [this, buffer = bucket.buffer(), index = bucket.index()]() mutable {
      CollectiveTag tag("ddp bucket " + std::to_string(index) + " hierarchical all-reduce");
      if (node_->size() > 1) node_->reduce(buffer, /*root=*/0);
      if (leaders_ && leaders_->size() > 1) leaders_->all_reduce(buffer);
      if (node_->size() > 1) node_->broadcast(buffer, /*root=*/0);
      return buffer;
    });
  }

 private:
  std::shared_ptr<ProcessGroup> node_;     // this rank's node: the mesh's last dimension
  std::shared_ptr<ProcessGroup> leaders_;  // the nodes' first ranks; null on the other ranks
  int mesh_size_;
  detail::HookThread thread_;  // last: its jobs use the members above
};

}  // namespace

std::shared_ptr<CommHook> hierarchical_allreduce_hook(const DeviceMesh& mesh) {
  // The mesh's last dimension is this rank's node; the leaders are the
  // nodes' first ranks, i.e. column 0's group of the first dimension.
  const bool leader = mesh.ndim() == 2 && mesh.coordinate(mesh.dim_names()[1]) == 0;
  return detail::hierarchical_allreduce_hook(mesh.group(mesh.ndim() - 1), leader ? mesh.group(0) : nullptr,
                                             mesh.process_group()->size());
}

namespace detail {

std::shared_ptr<CommHook> hierarchical_allreduce_hook(std::shared_ptr<ProcessGroup> node,
                                                      std::shared_ptr<ProcessGroup> leaders, int world_size) {
  DDP_CHECK(node && node->is_member(), "ddp: the hierarchical all-reduce needs this rank's node group");
  return std::make_shared<HierarchicalAllreduceHook>(std::move(node), std::move(leaders), world_size);
}

}  // namespace detail

}  // namespace ddp
