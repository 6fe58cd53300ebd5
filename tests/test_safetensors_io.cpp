// The files of a distributed checkpoint (src/checkpoint/safetensors_io.h): how a flat
// range of a tensor becomes boxes, and what the reader refuses. Hostile
// headers must give a ddp error naming the file, never a crash, an
// overflow or an element left unread (valgrind ran the reader over these and
// more: see the closing note of the stop that added it).
#include "checkpoint/safetensors_io.h"

#include <support/hostile_files.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>

#include <ATen/Functions.h>
#include <ddp/error.h>

#include <gtest/gtest.h>

#include <sys/resource.h>

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

// Issue 34 item 8: the header used to be parsed whole into a JSON tree, with
// no bound on nesting or on a shape's length: about 30 times the file's size
// in memory, and a zero-byte entry with a 52-million-element shape loaded.
// Each header here is 4 to 16 MiB; reading it must cost little more than its
// text, in a child allowed 256 MiB.
TEST(SafetensorsIo, HostileHeadersAreRefusedInBoundedMemory) {
  const std::string root = ddp::testing::make_temp_dir("safetensors_bombs");
  const size_t n = size_t{8} << 20;
  auto list_of = [&](const std::string& item) {
    std::string text = "[";
    text.reserve(n * (item.size() + 1) + 2);
    for (size_t k = 0; k < n; ++k) text += (k ? "," : "") + item;
    return text + "]";
  };
  // Each must cost little more than its text; a long string (the sharding
  // information is one) costs up to five times its length while nlohmann's
  // lexer builds its token.
  struct Case {
    std::string name, header, expected;
    long bound_kib;
  };
  const std::vector<Case> cases = {
      {"deep", "{\"a\": {\"dtype\": \"F32\", \"shape\": " + std::string(n, '[') + std::string(n, ']') +
                   ", \"data_offsets\": [0, 0]}}",
       "'a' nests deeper than a safetensors header does", 24 << 10},
      {"long_shape", "{\"a\": {\"dtype\": \"F32\", \"shape\": " + list_of("1") + ", \"data_offsets\": [0, 4]}}",
       "'a' has a shape of more than 64 numbers", 24 << 10},
      // Zero bytes match a shape with a 0 in it, however long.
      {"zero_bytes", "{\"a\": {\"dtype\": \"F32\", \"shape\": " + list_of("0") + ", \"data_offsets\": [0, 0]}}",
       "'a' has a shape of more than 64 numbers", 24 << 10},
      {"deep_sharding_info", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
                             "\"__metadata__\": {\"DCP_SHARDING_INFO\": \"{\\\"a\\\": {\\\"saved_offsets\\\": " +
                                 std::string(n / 2, '[') + "\"}}",
       "DCP_SHARDING_INFO of", 28 << 10},
  };
  for (const Case& c : cases) {
    fs::create_directories(root + "/" + c.name);
    const std::string path = root + "/" + c.name + "/shard-00001-model-00001-of-00001.safetensors";
    write_file(path, c.header, 4);
    auto load = ddp::testing::load_with_memory_limit([&] { SafetensorsIndex index(root + "/" + c.name); },
                                                     size_t{256} << 20);
    ASSERT_TRUE(load.finished) << c.name;
    EXPECT_NE(load.error.find(c.expected), std::string::npos) << c.name << ": " << load.error;
    EXPECT_NE(load.error.find("'" + path + "'"), std::string::npos) << c.name << ": " << load.error;
    EXPECT_LT(load.peak_growth_kib, c.bound_kib) << c.name;
    RecordProperty("peak_growth_kib_" + c.name, std::to_string(load.peak_growth_kib));
  }
  fs::remove_all(root);
}

// A header that is honest JSON but holds a great many entries (here 200,000
// empty tensors in 8 MiB) costs memory in proportion to its size: what the
// index keeps of each entry, a few times its text.
TEST(SafetensorsIo, AHeaderOfManyEntriesCostsAFewTimesItsSize) {
  const std::string dir = ddp::testing::make_temp_dir("safetensors_entries");
  std::string header = "{";
  for (int k = 0; k < 200000; ++k) {
    header += (k ? ", \"" : "\"") + std::string("layers.") + std::to_string(k) +
              ".bias\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}";
  }
  header += "}";
  write_file(dir + "/shard-00001-model-00001-of-00001.safetensors", header, 0);
  const long header_kib = static_cast<long>(header.size() >> 10);
  header = std::string();
  auto load = ddp::testing::load_with_memory_limit(
      [&] {
        SafetensorsIndex index(dir);
        DDP_CHECK(index.keys_with_prefix("layers.").size() == 200000, "entries lost");
      },
      size_t{1} << 30);
  ASSERT_TRUE(load.finished);
  EXPECT_EQ(load.error, "");
  EXPECT_LT(load.peak_growth_kib, 6 * header_kib);  // 4.5 times here; a JSON tree took 15
  RecordProperty("header_kib", std::to_string(header_kib));
  RecordProperty("peak_growth_kib", std::to_string(load.peak_growth_kib));
  fs::remove_all(dir);
}

// Issue 34 item 10: every file used to stay open from the index's
// construction to its end, so a checkpoint of more files than the limit on
// open files (ulimit -n) could not be read.
TEST(SafetensorsIo, ACheckpointOfMoreFilesThanTheOpenFileLimitLoads) {
  const std::string dir = ddp::testing::make_temp_dir("safetensors_many");
  const int files = 2120;  // the report's checkpoint, under its ulimit -n 1024
  for (int k = 0; k < files; ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "/shard-%05d-model-00001-of-00001.safetensors", k + 1);
    std::ofstream out(dir + name, std::ios::binary);
    const std::string header = f32("a", "[1]", 4, "[" + std::to_string(k) + "]");
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xff));
    const float value = static_cast<float>(k);
    out << header;
    out.write(reinterpret_cast<const char*>(&value), sizeof value);
  }
  auto load = ddp::testing::load_with_memory_limit(
      [&] {
        struct rlimit limit {};
        ::getrlimit(RLIMIT_NOFILE, &limit);
        limit.rlim_cur = 1024;
        ::setrlimit(RLIMIT_NOFILE, &limit);
        SafetensorsIndex index(dir);
        TensorBox box{"a", {0}, at::zeros({files}, at::kFloat)};
        index.read_into(box);
        // Twice: files closed to make room are opened again.
        TensorBox again{"a", {0}, at::zeros({files}, at::kFloat)};
        index.read_into(again);
        DDP_CHECK(at::equal(box.data, at::arange(files, at::kFloat)) && at::equal(again.data, box.data),
                  "wrong values");
      },
      size_t{256} << 20);
  ASSERT_TRUE(load.finished);
  EXPECT_EQ(load.error, "");
  fs::remove_all(dir);
}

// Files are opened again as they are read, so one replaced after the index
// read its header (another job saving into the directory) is named, never
// read at the old header's offsets.
TEST(SafetensorsIo, AFileReplacedAfterItsHeaderWasReadIsNamed) {
  const std::string dir = ddp::testing::make_temp_dir("safetensors_replaced");
  std::vector<std::string> paths;
  for (int k = 0; k < static_cast<int>(SafetensorsIndex::kMaxOpenFiles) + 1; ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "/shard-%05d-model-00001-of-00001.safetensors", k + 1);
    paths.push_back(dir + name);
    write_file(paths.back(), f32("a", "[1]", 4, "[" + std::to_string(k) + "]"), 4);
  }
  SafetensorsIndex index(dir);  // the first file is closed by now, to make room
  write_file(paths[0] + ".new", f32("a", "[1]", 4, "[0]"), 4);
  fs::rename(paths[0] + ".new", paths[0]);
  TensorBox box{"a", {0}, at::zeros({static_cast<int64_t>(paths.size())}, at::kFloat)};
  auto message = ddp::testing::error_of([&] { index.read_into(box); });
  EXPECT_NE(message.find("'" + paths[0] + "' was replaced while the checkpoint in '" + dir + "' was being loaded"),
            std::string::npos)
      << message;
  fs::remove_all(dir);
}

// write_safetensors_file goes through a temporary, as every checkpoint file:
// a link planted at its name is refused and its target left alone.
TEST(SafetensorsIo, APlantedLinkAtAFilesNameIsRefused) {
  const std::string dir = ddp::testing::make_temp_dir("safetensors_link");
  const std::string victim = dir + "/victim.txt", path = dir + "/shard-00001-model-00001-of-00001.safetensors";
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, path);
  auto message = ddp::testing::error_of(
      [&] { ddp::detail::write_safetensors_file(path, {TensorBox{"a", {0}, at::ones({2})}}); });
  EXPECT_NE(message.find("'" + path + "': it is a symbolic link"), std::string::npos) << message;
  std::ifstream in(victim);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "precious");
  fs::remove_all(dir);
}

}  // namespace
