#pragma once

// The ranks of a job laid out as a 1- or 2-dimensional grid with named
// dimensions, each dimension's process group, and where this rank sits: what
// HSDP, tensor parallelism and hierarchical reductions are built on, as
// torch.distributed.device_mesh.DeviceMesh is in Python.
//
//   auto world = ddp::init_process_group();
//   // nodes x local ranks, from the launcher (ddprun, torchrun, srun, mpirun):
//   auto mesh = ddp::DeviceMesh::from_launcher(world);    // {"replicate", "shard"}
//   auto shard = mesh.group("shard");                      // the ranks of this node
//   auto replicate = mesh.group("replicate");              // this local rank on every node
//   // or any shape that multiplies to the world size:
//   ddp::DeviceMesh grid(world, {2, -1}, {"dp", "tp"});
//
// The layout is row-major, as PyTorch's: the rank at coordinates (i, j) of
// a shape (rows, cols) is i * cols + j, so a 2-D mesh's "shard" group of row i
// is ranks i * cols ... i * cols + cols - 1, and its "replicate" group of
// column j is ranks j, cols + j, 2 * cols + j, ...

#include <ddp/export.h>
#include <ddp/process_group.h>

#include <memory>
#include <string>
#include <vector>

namespace ddp {

class DDP_API DeviceMesh {
 public:
  /// Lays `group`'s ranks out as `shape` (one or two sizes; one of them may
  /// be -1, meaning whatever the group's size leaves) with one name per
  /// dimension. Collective over `group` for a 2-D mesh (each dimension's
  /// groups are made with ProcessGroup::split): every rank calls it alike.
  /// A shape that does not multiply to the group's size is refused.
  DeviceMesh(std::shared_ptr<ProcessGroup> group, std::vector<int> shape, std::vector<std::string> dim_names);

  /// Nodes x local ranks, from the launcher's environment as `group`
  /// recorded it (its world()'s local world size): the first dimension
  /// spans nodes, the second the ranks of one node. Needs a job whose nodes
  /// all run the same number of ranks with consecutive global ranks (as
  /// ddprun, torchrun and srun place them); checked on every rank, collectively.
  static DeviceMesh from_launcher(std::shared_ptr<ProcessGroup> group,
                                  std::vector<std::string> dim_names = {"replicate", "shard"});

  /// 1 or 2.
  int ndim() const { return static_cast<int>(shape_.size()); }
  /// The size of each dimension.
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  /// Which dimension `dim_name` is; throws naming the mesh's names if none.
  int dim(const std::string& dim_name) const;
  /// The size of one dimension.
  int size(const std::string& dim_name) const { return shape_[dim(dim_name)]; }
  int size(int dim) const;

  /// The group of the ranks that share this rank's coordinates in every other
  /// dimension: in a 2-D mesh, group("shard") is this rank's row and
  /// group("replicate") its column. Its rank is this rank's coordinate along
  /// `dim_name`. The 1-D mesh's only group is the mesh's own.
  const std::shared_ptr<ProcessGroup>& group(const std::string& dim_name) const { return groups_[dim(dim_name)]; }
  const std::shared_ptr<ProcessGroup>& group(int dim) const;
  /// The group whose ranks the mesh lays out.
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }

  /// This rank's coordinates, one per dimension.
  const std::vector<int>& coordinates() const { return coordinates_; }
  /// This rank's coordinate along one dimension.
  int coordinate(const std::string& dim_name) const { return coordinates_[dim(dim_name)]; }
  /// The rank (in process_group()) at `coordinates`.
  int rank_at(const std::vector<int>& coordinates) const;

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::vector<int> shape_;
  std::vector<std::string> dim_names_;
  std::vector<int> coordinates_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
};

/// The mesh's shape for `world_size` ranks: `shape` with its -1 (if any)
/// replaced by what the other sizes leave. Throws, naming the shape and the
/// world size, when they do not multiply to it. A pure function, for tests.
DDP_API std::vector<int> resolve_mesh_shape(std::vector<int> shape, int world_size);

}  // namespace ddp
