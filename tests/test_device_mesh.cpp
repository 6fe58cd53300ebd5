// ddp::DeviceMesh on 4 real ranks over Gloo (support/ranks.h): a 2 x 2 mesh
// gives each dimension the rank sets of PyTorch's row-major layout and
// all-reduces in each dimension give the sums expected; the mesh built from
// the launcher's nodes x local ranks is the same; shapes that do not fit the
// world are refused, naming the shape and the world size.

#include <support/ranks.h>
#include <support/torch_errors.h>

#include <ddp/device_mesh.h>
#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

using namespace ddp::testing;

namespace {

using Group = std::shared_ptr<ddp::ProcessGroup>;

// What a 2 x 2 mesh with dimensions {"replicate", "shard"} must be on global
// rank `me`: mesh[i][j] = 2i + j.
void expect_two_by_two(const ddp::DeviceMesh& mesh, int me) {
  const int row = me / 2, col = me % 2;
  ASSERT_EQ(mesh.ndim(), 2);
  EXPECT_EQ(mesh.shape(), (std::vector<int>{2, 2}));
  EXPECT_EQ(mesh.coordinates(), (std::vector<int>{row, col}));
  EXPECT_EQ(mesh.coordinate("replicate"), row);
  EXPECT_EQ(mesh.coordinate("shard"), col);
  EXPECT_EQ(mesh.size("shard"), 2);
  EXPECT_EQ(mesh.rank_at({1, 0}), 2);
  // "shard" varies the column: this rank's row. "replicate": its column.
  EXPECT_EQ(mesh.group("shard")->global_ranks(), (std::vector<int>{2 * row, 2 * row + 1}));
  EXPECT_EQ(mesh.group("replicate")->global_ranks(), (std::vector<int>{col, 2 + col}));
  EXPECT_EQ(mesh.group("shard")->rank(), col);
  EXPECT_EQ(mesh.group("replicate")->rank(), row);
  EXPECT_EQ(mesh.group(1), mesh.group("shard"));

  // Sums of (global rank + 1): a row i holds 2i+1 and 2i+2, a column j
  // holds j+1 and j+3.
  at::Tensor in_row = at::full({5}, me + 1.0);
  mesh.group("shard")->all_reduce(in_row);
  EXPECT_TRUE(in_row.equal(at::full({5}, 4.0 * row + 3.0))) << in_row;
  at::Tensor in_column = at::full({5}, me + 1.0);
  mesh.group("replicate")->all_reduce(in_column);
  EXPECT_TRUE(in_column.equal(at::full({5}, 2.0 * col + 4.0))) << in_column;
  // Both dimensions in a row, as HSDP reduces: the sum over all four.
  at::Tensor both = at::full({3}, me + 1.0);
  mesh.group("shard")->all_reduce(both);
  mesh.group("replicate")->all_reduce(both);
  EXPECT_TRUE(both.equal(at::full({3}, 10.0))) << both;

  EXPECT_NE(error_of([&] { mesh.group("tp"); }).find("no dimension \"tp\"; its dimensions are \"replicate\", \"shard\""),
            std::string::npos);
}

TEST(DeviceMesh, TwoByTwoGivesRowMajorGroupsAndTheirSums) {
  expect_all_succeeded(run_on_ranks(4, [](const Group& world) {
    const int me = world->rank();
    ddp::DeviceMesh mesh(world, {2, 2}, {"replicate", "shard"});
    expect_two_by_two(mesh, me);
    // -1 infers the size, as the world leaves it.
    ddp::DeviceMesh inferred(world, {-1, 2}, {"replicate", "shard"});
    expect_two_by_two(inferred, me);

    // One dimension: the world itself.
    ddp::DeviceMesh line(world, {4}, {"dp"});
    EXPECT_EQ(line.group("dp"), world);
    EXPECT_EQ(line.coordinates(), (std::vector<int>{me}));

    // A 4 x 1 mesh: each "tp" group is one rank, each "dp" group all four.
    ddp::DeviceMesh column(world, {4, 1}, {"dp", "tp"});
    EXPECT_EQ(column.group("dp"), world);
    EXPECT_EQ(column.group("tp")->global_ranks(), (std::vector<int>{me}));

    // Shapes that do not fit four ranks are refused, on every rank alike,
    // before any collective.
    const std::string three = error_of([&] { ddp::DeviceMesh(world, {3, -1}, {"replicate", "shard"}); });
    EXPECT_NE(three.find("a DeviceMesh of shape (3, -1) does not divide the 4 ranks of its process group"),
              std::string::npos)
        << three;
    const std::string six = error_of([&] { ddp::DeviceMesh(world, {2, 3}, {"replicate", "shard"}); });
    EXPECT_NE(six.find("a DeviceMesh of shape (2, 3) has 6 ranks, but its process group has 4"), std::string::npos)
        << six;
    EXPECT_NE(error_of([&] { ddp::DeviceMesh(world, {2, 2}, {"shard"}); }).find("needs 2 dimension name(s); got 1"),
              std::string::npos);
    EXPECT_NE(error_of([&] { ddp::DeviceMesh(world, {2, 2}, {"x", "x"}); }).find("\"x\" is given twice"),
              std::string::npos);
    EXPECT_NE(error_of([&] { ddp::DeviceMesh(world, {2, 2, 1}, {"a", "b", "c"}); }).find("1 or 2 dimensions"),
              std::string::npos);

    // The world is untouched by the meshes' groups.
    at::Tensor all = at::ones({1});
    world->all_reduce(all);
    EXPECT_EQ(all.item<float>(), 4.0f);
  }));
}

// Two "nodes" of two ranks each, as ddprun --nnodes 2 --nproc-per-node 2
// describes them: the mesh from the launcher is nodes x local ranks.
TEST(DeviceMesh, FromTheLauncherIsNodesByLocalRanks) {
  expect_all_succeeded(run_on_ranks(
      4,
      [](const Group&) {
        const int me = std::atoi(std::getenv("RANK"));
        ::setenv("LOCAL_RANK", std::to_string(me % 2).c_str(), 1);
        ::setenv("LOCAL_WORLD_SIZE", "2", 1);
        ::setenv("GROUP_RANK", std::to_string(me / 2).c_str(), 1);
        Group world = ddp::init_process_group();
        ddp::DeviceMesh mesh = ddp::DeviceMesh::from_launcher(world);
        EXPECT_EQ(mesh.dim_names(), (std::vector<std::string>{"replicate", "shard"}));
        expect_two_by_two(mesh, me);
        world->shutdown();
      },
      RanksOptions().no_group()));
}

// A job whose nodes run different numbers of ranks cannot be laid out as
// nodes x local ranks: every rank says so (none waits in a collective).
TEST(DeviceMesh, FromTheLauncherRefusesUnevenNodes) {
  expect_all_succeeded(run_on_ranks(
      3,
      [](const Group&) {
        const int me = std::atoi(std::getenv("RANK"));
        // Node 0 runs ranks 0 and 1, node 1 runs rank 2 alone.
        ::setenv("LOCAL_RANK", std::to_string(me < 2 ? me : 0).c_str(), 1);
        ::setenv("LOCAL_WORLD_SIZE", me < 2 ? "2" : "1", 1);
        ::setenv("GROUP_RANK", me < 2 ? "0" : "1", 1);
        Group world = ddp::init_process_group();
        const std::string error = error_of([&] { ddp::DeviceMesh::from_launcher(world); });
        EXPECT_NE(error.find("needs the same number of ranks on every node, but global rank 2 has 1 on its node"),
                  std::string::npos)
            << error;
        world->barrier();
        world->shutdown();
      },
      RanksOptions().no_group()));
}

TEST(DeviceMeshShape, InfersOneSizeAndRefusesWhatDoesNotFit) {
  EXPECT_EQ(ddp::resolve_mesh_shape({2, -1}, 8), (std::vector<int>{2, 4}));
  EXPECT_EQ(ddp::resolve_mesh_shape({-1}, 3), (std::vector<int>{3}));
  EXPECT_EQ(ddp::resolve_mesh_shape({2, 4}, 8), (std::vector<int>{2, 4}));
  EXPECT_NE(error_of([] { ddp::resolve_mesh_shape({3, -1}, 8); }).find("does not divide the 8 ranks"),
            std::string::npos);
  EXPECT_NE(error_of([] { ddp::resolve_mesh_shape({-1, -1}, 8); }).find("one size to infer"), std::string::npos);
  EXPECT_NE(error_of([] { ddp::resolve_mesh_shape({0, 8}, 8); }).find("must be 1 or more"), std::string::npos);
}

}  // namespace
