// The files of a distributed checkpoint (src/safetensors_io.h): how a flat
// range of a tensor becomes boxes, and what the reader refuses. Hostile
// headers must give a ddp error naming the file, never a crash, an
// overflow or an element left unread (valgrind ran the reader over these and
// more: see the closing note of the stop that added it).
#include "safetensors_io.h"

#include <support/subprocess.h>
#include <support/torch_errors.h>

#include <ATen/Functions.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;
using ddp::detail::SafetensorsIndex;
using ddp::detail::TensorBox;

// A safetensors file with `header` (JSON text) and `data_bytes` zero bytes.
void write_file(const std::string& path, const std::string& header, size_t data_bytes, uint64_t length = 0) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = length ? length : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << std::string(data_bytes, '\0');
}

std::string f32(const std::string& key, const std::string& shape, int64_t bytes, const std::string& offsets = "") {
  std::string entry = "\"" + key + "\": {\"dtype\": \"F32\", \"shape\": " + shape + ", \"data_offsets\": [0, " +
                      std::to_string(bytes) + "]}";
  if (offsets.empty()) return "{" + entry + "}";
  return "{" + entry + ", \"__metadata__\": {\"DCP_SHARDING_INFO\": \"{\\\"" + key +
         "\\\": {\\\"saved_offsets\\\": " + offsets + "}}\"}}";
}

std::string read_error(const std::string& dir, const std::vector<int64_t>& shape) {
  return ddp::testing::error_of([&] {
    SafetensorsIndex index(dir);
    TensorBox box{"a", std::vector<int64_t>(shape.size(), 0), at::zeros(shape, at::kFloat)};
    index.read_into(box);
  });
}

TEST(SafetensorsIo, AFlatRangeBecomesContiguousBoxesThatCoverItExactly) {
  const std::vector<int64_t> shape = {3, 4, 5};
  for (int64_t begin = 0; begin <= 60; begin += 7) {
    for (int64_t end = begin; end <= 60; end += 11) {
      int64_t total = 0, expected_first = begin;
      for (const auto& [offsets, sizes] : ddp::detail::boxes_of_flat_range(begin, end, shape)) {
        int64_t first = (offsets[0] * 4 + offsets[1]) * 5 + offsets[2];
        EXPECT_EQ(first, expected_first);  // in order, no gap
        int64_t n = sizes[0] * sizes[1] * sizes[2];
        total += n;
        expected_first += n;
      }
      EXPECT_EQ(total, end - begin) << begin << ".." << end;
    }
  }
  // A matrix's range inside rows: a partial row, whole rows, a partial row.
  EXPECT_EQ(ddp::detail::boxes_of_flat_range(3, 17, {4, 5}).size(), 3u);
}

TEST(SafetensorsIo, HostileFilesAreRefusedNamingTheProblem) {
  const std::string root = ddp::testing::make_temp_dir("safetensors_hostile");
  auto dir = [&](const std::string& name) {
    fs::create_directories(root + "/" + name);
    return root + "/" + name;
  };
  write_file(dir("ok") + "/shard-00001-model-00001-of-00001.safetensors", f32("a", "[2, 3]", 24), 24);
  EXPECT_EQ(read_error(root + "/ok", {2, 3}), "");

  write_file(dir("huge") + "/shard-00001-model-00001-of-00001.safetensors", "{}", 0, uint64_t{1} << 63);
  EXPECT_NE(read_error(root + "/huge", {1}).find("-byte header"), std::string::npos);

  // 2^32 x 2^32 elements would wrap a 64-bit product to 0 bytes.
  write_file(dir("overflow") + "/shard-00001-model-00001-of-00001.safetensors", f32("a", "[4294967296, 4294967296]", 0),
             0);
  EXPECT_NE(read_error(root + "/overflow", {1, 1}).find("more than 2^40 elements"), std::string::npos);

  write_file(dir("past_end") + "/shard-00001-model-00001-of-00001.safetensors", f32("a", "[4]", 16), 8);
  EXPECT_NE(read_error(root + "/past_end", {4}).find("truncated"), std::string::npos);

  // Two boxes sharing elements, and two that leave a hole: never garbage.
  write_file(dir("overlap") + "/shard-00001-model-00001-of-00001.safetensors", f32("a", "[4]", 16, "[0]"), 16);
  write_file(root + "/overlap/shard-00002-model-00001-of-00001.safetensors", f32("a", "[4]", 16, "[2]"), 16);
  EXPECT_NE(read_error(root + "/overlap", {6}).find("twice (overlapping boxes)"), std::string::npos);
  write_file(dir("hole") + "/shard-00001-model-00001-of-00001.safetensors", f32("a", "[2]", 8, "[0]"), 8);
  write_file(root + "/hole/shard-00002-model-00001-of-00001.safetensors", f32("a", "[2]", 8, "[4]"), 8);
  EXPECT_NE(read_error(root + "/hole", {6}).find("covers only 4 of the 6 elements"), std::string::npos);

  write_file(dir("nested") + "/shard-00001-model-00001-of-00001.safetensors", std::string(100000, '[') +
             std::string(100000, ']'), 0);
  EXPECT_NE(read_error(root + "/nested", {1}).find("is not a JSON object"), std::string::npos);
  fs::remove_all(root);
}

}  // namespace
