// DeviceMesh: the shape's checks, the row-major layout and each dimension's
// groups, made by ProcessGroup::split (one split per dimension, the same
// calls in the same order on every rank).

#include <ddp/device_mesh.h>

#include <ddp/error.h>

#include <ATen/Functions.h>

#include <algorithm>
#include <sstream>

namespace ddp {
namespace {

std::string shape_text(const std::vector<int>& shape) {
  std::ostringstream text;
  text << "(";
  for (size_t i = 0; i < shape.size(); ++i) text << (i ? ", " : "") << shape[i];
  text << (shape.size() == 1 ? ",)" : ")");
  return text.str();
}

std::string names_text(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) text += (i ? ", " : "") + ("\"" + names[i] + "\"");
  return text;
}

}  // namespace

std::vector<int> resolve_mesh_shape(std::vector<int> shape, int world_size) {
  DDP_CHECK(shape.size() == 1 || shape.size() == 2, "ddp: a DeviceMesh has 1 or 2 dimensions; got shape ",
            shape_text(shape));
  const auto inferred = std::count(shape.begin(), shape.end(), -1);
  DDP_CHECK(inferred <= 1, "ddp: a DeviceMesh's shape may leave one size to infer (-1), not ", inferred, "; got ",
            shape_text(shape));
  int64_t known = 1;
  for (int size : shape) {
    DDP_CHECK(size == -1 || size >= 1, "ddp: a DeviceMesh's sizes must be 1 or more (or -1 for one to infer); got ",
              shape_text(shape));
    if (size != -1) known *= size;
  }
  if (inferred == 1) {
    DDP_CHECK(world_size % known == 0, "ddp: a DeviceMesh of shape ", shape_text(shape), " does not divide the ",
              world_size, " ranks of its process group: the other sizes multiply to ", known,
              ", which does not divide ", world_size, ". Choose sizes whose product divides the world size.");
    std::replace(shape.begin(), shape.end(), -1, static_cast<int>(world_size / known));
    return shape;
  }
  DDP_CHECK(known == world_size, "ddp: a DeviceMesh of shape ", shape_text(shape), " has ", known,
            " ranks, but its process group has ", world_size,
            ". The sizes must multiply to the world size (or leave one as -1 to infer).");
  return shape;
}

DeviceMesh::DeviceMesh(std::shared_ptr<ProcessGroup> group, std::vector<int> shape,
                       std::vector<std::string> dim_names)
    : group_(std::move(group)), dim_names_(std::move(dim_names)) {
  DDP_CHECK(group_ != nullptr, "ddp: a DeviceMesh needs a process group; got none");
  DDP_CHECK(group_->is_member(), "ddp: a DeviceMesh over process group ", group_->name(), " was made on global rank ",
            group_->global_rank(), ", which is not one of its members; make it on the group's members only");
  shape_ = resolve_mesh_shape(std::move(shape), group_->size());
  DDP_CHECK(dim_names_.size() == shape_.size(), "ddp: a DeviceMesh of shape ", shape_text(shape_), " needs ",
            shape_.size(), " dimension name(s); got ", dim_names_.size(), " (", names_text(dim_names_), ")");
  for (size_t i = 0; i < dim_names_.size(); ++i) {
    DDP_CHECK(!dim_names_[i].empty(), "ddp: a DeviceMesh's dimension names must not be empty");
    DDP_CHECK(std::find(dim_names_.begin(), dim_names_.begin() + i, dim_names_[i]) == dim_names_.begin() + i,
              "ddp: a DeviceMesh's dimension names must differ; \"", dim_names_[i], "\" is given twice");
  }

  const int rank = group_->rank();
  if (ndim() == 1) {
    coordinates_ = {rank};
    groups_ = {group_};
    return;
  }
  const int rows = shape_[0], cols = shape_[1];
  const int row = rank / cols, col = rank % cols;
  coordinates_ = {row, col};
  // Dimension 0 varies the row: the ranks of this column. Dimension 1 varies
  // the column: the ranks of this row. Keys order each group by coordinate.
  // A dimension of the whole group's size needs no new group.
  groups_.resize(2);
  groups_[0] = cols == 1 ? group_ : group_->split(col, row);
  groups_[1] = rows == 1 ? group_ : group_->split(row, col);
}

DeviceMesh DeviceMesh::from_launcher(std::shared_ptr<ProcessGroup> group, std::vector<std::string> dim_names) {
  DDP_CHECK(group != nullptr, "ddp: DeviceMesh::from_launcher needs a process group; got none");
  // Every rank decides from every rank's view, so an uneven job fails on
  // all ranks alike instead of leaving some waiting in the next collective.
  at::Tensor mine = at::tensor({int64_t{group->world().local_rank}, int64_t{group->world().local_world_size}},
                               at::kLong);
  std::vector<at::Tensor> all;
  {
    CollectiveTag tag("DeviceMesh::from_launcher layout check");
    all = group->all_gather(group->to_control(mine));
  }
  const int local_world_size = static_cast<int>(all[0].cpu()[1].item<int64_t>());
  for (int r = 0; r < group->size(); ++r) {
    at::Tensor theirs = all[r].cpu();
    const int64_t local_rank = theirs[0].item<int64_t>(), local_size = theirs[1].item<int64_t>();
    DDP_CHECK(local_size == local_world_size, "ddp: DeviceMesh::from_launcher needs the same number of ranks on ",
              "every node, but global rank ", group->global_rank_of(r), " has ", local_size, " on its node and rank ",
              group->global_rank_of(0), " has ", local_world_size,
              ". Give the mesh an explicit shape: DeviceMesh(group, {rows, cols}, names).");
    DDP_CHECK(local_size >= 1 && local_rank == r % local_world_size,
              "ddp: DeviceMesh::from_launcher needs each node's ranks to be consecutive (rank = node * ",
              "local world size + local rank), but rank ", r, " of process group ", group->name(),
              " has local rank ", local_rank, " of ", local_size,
              ". Give the mesh an explicit shape: DeviceMesh(group, {rows, cols}, names).");
  }
  DDP_CHECK(group->size() % local_world_size == 0, "ddp: DeviceMesh::from_launcher: ", group->size(),
            " ranks are not a whole number of nodes of ", local_world_size, " ranks");
  const int nodes = group->size() / local_world_size;
  return DeviceMesh(std::move(group), {nodes, local_world_size}, std::move(dim_names));
}

int DeviceMesh::dim(const std::string& dim_name) const {
  auto found = std::find(dim_names_.begin(), dim_names_.end(), dim_name);
  DDP_CHECK(found != dim_names_.end(), "ddp: this DeviceMesh has no dimension \"", dim_name, "\"; its dimensions are ",
            names_text(dim_names_));
  return static_cast<int>(found - dim_names_.begin());
}

int DeviceMesh::size(int dim) const {
  DDP_CHECK(dim >= 0 && dim < ndim(), "ddp: this DeviceMesh has dimensions 0 to ", ndim() - 1, "; got ", dim);
  return shape_[dim];
}

const std::shared_ptr<ProcessGroup>& DeviceMesh::group(int dim) const {
  DDP_CHECK(dim >= 0 && dim < ndim(), "ddp: this DeviceMesh has dimensions 0 to ", ndim() - 1, "; got ", dim);
  return groups_[dim];
}

int DeviceMesh::rank_at(const std::vector<int>& coordinates) const {
  DDP_CHECK(static_cast<int>(coordinates.size()) == ndim(), "ddp: this DeviceMesh has ", ndim(),
            " dimension(s); got ", coordinates.size(), " coordinate(s)");
  int rank = 0;
  for (int d = 0; d < ndim(); ++d) {
    DDP_CHECK(coordinates[d] >= 0 && coordinates[d] < shape_[d], "ddp: coordinate ", coordinates[d],
              " is outside dimension \"", dim_names_[d], "\" of size ", shape_[d]);
    rank = rank * shape_[d] + coordinates[d];
  }
  return rank;
}

}  // namespace ddp
