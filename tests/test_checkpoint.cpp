#include <ddp/checkpoint.h>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <support/hostile_files.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>
#include <torch/nn/modules/linear.h>

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;

namespace {

using ddp::testing::error_of;

ddp::StateDict sample_state() {
  return {{"fc1.weight", at::arange(6, at::kFloat).reshape({2, 3})},
          {"fc1.bias", at::tensor({0.5, -0.25}, at::kDouble)},
          {"steps", at::tensor({7, 9}, at::kLong)},
          // A non-contiguous view: only its own elements may be saved.
          {"column", at::arange(12, at::kFloat).reshape({3, 4}).select(1, 1)}};
}

TEST(Checkpoint, RoundTripInCpp) {
  auto dir = ddp::testing::make_temp_dir();
  auto path = dir + "/state.pt";
  ddp::save_state_dict(sample_state(), path);
  auto loaded = ddp::load_state_dict(path);
  auto expected = sample_state();
  ASSERT_EQ(loaded.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(loaded[i].first, expected[i].first);
    EXPECT_EQ(loaded[i].second.scalar_type(), expected[i].second.scalar_type());
    EXPECT_TRUE(at::equal(loaded[i].second, expected[i].second)) << expected[i].first;
  }
  // Nothing but the file itself is left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  fs::remove_all(dir);
}

TEST(Checkpoint, PythonReadsOursAndWeReadPythons) {
  auto dir = ddp::testing::make_temp_dir();
  auto path = dir + "/from_cpp.pt";
  ddp::save_state_dict(sample_state(), path);
  auto result = ddp::testing::run_process(
      {DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tests/python/checkpoint_roundtrip.py", path, dir});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  // Python saw our keys, dtypes, shapes and values (weights_only=True).
  EXPECT_NE(result.out.find("fc1.weight float32 [2, 3] 15.000000"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("fc1.bias float64 [2] 0.250000"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("steps int64 [2] 16.000000"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("column float32 [3] 15.000000"), std::string::npos) << result.out;

  // Python's transformed copy comes back exactly.
  auto doubled = ddp::load_state_dict(dir + "/doubled.pt");
  auto expected = sample_state();
  ASSERT_EQ(doubled.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(doubled[i].first, expected[i].first);
    EXPECT_TRUE(at::equal(doubled[i].second, expected[i].second * 2 + 1)) << expected[i].first;
  }

  // A Python module's state_dict (OrderedDict with _metadata, BatchNorm
  // buffers including an int64 counter) loads with the right values.
  auto module_state = ddp::load_state_dict(dir + "/module.pt");
  std::map<std::string, double> sums;
  std::ifstream in(dir + "/module.txt");
  for (std::string key; in >> key;) in >> sums[key];
  ASSERT_EQ(module_state.size(), sums.size());
  for (auto& [key, tensor] : module_state) {
    ASSERT_TRUE(sums.count(key)) << key;
    EXPECT_NEAR(tensor.to(at::kDouble).sum().item<double>(), sums[key], 1e-6) << key;
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, RefusesPicklesThatNameCode) {
  auto dir = ddp::testing::make_temp_dir();
  ddp::save_state_dict(sample_state(), dir + "/from_cpp.pt");
  auto result = ddp::testing::run_process(
      {DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tests/python/checkpoint_roundtrip.py", dir + "/from_cpp.pt", dir});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  auto message = error_of([&] { ddp::load_value(dir + "/evil.pt"); });
  EXPECT_NE(message.find("posixpath.join"), std::string::npos) << message;
  EXPECT_NE(message.find("evil.pt"), std::string::npos) << message;
  fs::remove_all(dir);
}

TEST(Checkpoint, TruncatedOrMissingFilesGiveClearErrors) {
  auto dir = ddp::testing::make_temp_dir();
  auto path = dir + "/state.pt";
  ddp::save_state_dict(sample_state(), path);
  auto size = fs::file_size(path);
  fs::resize_file(path, size / 2);
  auto message = error_of([&] { ddp::load_state_dict(path); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("not a complete torch.save file"), std::string::npos) << message;

  message = error_of([&] { ddp::load_state_dict(dir + "/absent.pt"); });
  EXPECT_NE(message.find("absent.pt"), std::string::npos) << message;

  std::ofstream(dir + "/text.pt") << "not a checkpoint";
  message = error_of([&] { ddp::load_state_dict(dir + "/text.pt"); });
  EXPECT_NE(message.find("text.pt"), std::string::npos) << message;
  fs::remove_all(dir);
}

TEST(Checkpoint, FailedSaveKeepsThePreviousFile) {
  auto dir = ddp::testing::make_temp_dir();
  auto path = dir + "/state.pt";
  ddp::save_state_dict(sample_state(), path);
  auto before = fs::file_size(path);
  // A write that fails (here at a limit on file sizes, in a child) leaves
  // the good file as it was.
  ddp::StateDict bigger = {{"x", at::ones({1000})}};
  auto failed = ddp::testing::load_with_memory_limit(
      [&] {
        ::signal(SIGXFSZ, SIG_IGN);
        struct rlimit limit {1024, 1024};
        ::setrlimit(RLIMIT_FSIZE, &limit);
        ddp::save_state_dict(bigger, path);
      },
      size_t{256} << 20);
  ASSERT_TRUE(failed.finished);
  EXPECT_NE(failed.error.find("File too large"), std::string::npos) << failed.error;
  EXPECT_EQ(fs::file_size(path), before);
  EXPECT_EQ(ddp::load_state_dict(path).size(), sample_state().size());
  fs::remove_all(dir);
}

TEST(Checkpoint, LoadIntoModuleChecksNamesAndShapes) {
  torch::nn::Linear linear(3, 2);
  ddp::StateDict good = {{"weight", at::ones({2, 3})}, {"bias", at::zeros({2})}};
  ddp::load_state_dict(*linear, good);
  EXPECT_TRUE(at::equal(linear->weight, at::ones({2, 3})));

  auto message = error_of([&] { ddp::load_state_dict(*linear, {{"weight", at::ones({2, 3})}}); });
  EXPECT_NE(message.find("'bias'"), std::string::npos) << message;
  message = error_of([&] {
    ddp::load_state_dict(*linear, {{"weight", at::ones({3, 3})}, {"bias", at::zeros({2})}});
  });
  EXPECT_NE(message.find("'weight'"), std::string::npos) << message;
  message = error_of([&] {
    ddp::load_state_dict(*linear, {{"weight", at::ones({2, 3})}, {"bias", at::zeros({2})}, {"extra", at::ones({1})}});
  });
  EXPECT_NE(message.find("'extra'"), std::string::npos) << message;
}

TEST(Checkpoint, NestedValuesRoundTrip) {
  auto dir = ddp::testing::make_temp_dir();
  c10::impl::GenericDict inner(c10::StringType::get(), c10::AnyType::get());
  inner.insert("step", int64_t{3});
  inner.insert("lr", 0.5);
  inner.insert("name", std::string("adam"));
  inner.insert("moment", at::ones({2}));
  c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
  outer.insert("optimizer", inner);
  outer.insert("done", true);
  ddp::save_value(outer, dir + "/nested.pt");
  auto loaded = ddp::load_value(dir + "/nested.pt").toGenericDict();
  auto back = loaded.at("optimizer").toGenericDict();
  EXPECT_EQ(back.at("step").toInt(), 3);
  EXPECT_DOUBLE_EQ(back.at("lr").toDouble(), 0.5);
  EXPECT_EQ(back.at("name").toStringRef(), "adam");
  EXPECT_TRUE(at::equal(back.at("moment").toTensor(), at::ones({2})));
  EXPECT_TRUE(loaded.at("done").toBool());
  fs::remove_all(dir);
}

}  // namespace

namespace {

TEST(Checkpoint, HostilePicklesFailCleanly) {
  auto dir = ddp::testing::make_temp_dir();
  auto made = ddp::testing::run_process(
      {DDP_PYTHON, std::string(DDP_SOURCE_DIR) + "/tests/python/hostile_pickles.py", dir});
  ASSERT_EQ(made.exit_code, 0) << made.describe();
  struct Case {
    const char* file;
    const char* expected;
  };
  for (const Case& c : {Case{"cycle.pt", "refer to themselves"}, Case{"deep.pt", "nested more than"},
                        Case{"strides.pt", "malformed _rebuild_tensor_v2"},
                        Case{"overflow.pt", "past the end of its storage"}}) {
    auto message = error_of([&] { ddp::load_value(dir + "/" + c.file); });
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.file << ": " << message;
    EXPECT_NE(message.find(c.file), std::string::npos) << message;
  }
  fs::remove_all(dir);
}

}  // namespace

namespace {

using ddp::testing::load_with_memory_limit;
using ddp::testing::write_zip;
using ddp::testing::ZipRecord;

// Issue 21 item 5: a hostile file is refused before it takes memory. Each
// load runs in a child allowed 384 MiB more address space than it started
// with: a load that is not bounded runs out there and fails with another
// message, instead of taking the machine's memory.
constexpr size_t kHeadroom = size_t{384} << 20;
constexpr long kBoundedKiB = 160 << 10;

std::string pickle_of(const std::string& body) { return std::string("\x80\x02", 2) + body + "."; }

// A literal's bytes, NULs included.
template <size_t N>
std::string bytes(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

// A one-element float tensor: its storage is the archive's record data/0.
std::string tensor_call() {
  return bytes("ctorch._utils\n_rebuild_tensor_v2\n(") +
         bytes("(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x01tQ") +
         bytes("K\x00K\x01\x85K\x01\x85\x89NtR");
}

TEST(CheckpointBombs, ATowerOfSharedReferencesIsRefusedInBoundedMemory) {
  auto dir = ddp::testing::make_temp_dir();
  // None, then 60 times: a pair of the previous value, memoized. It is 300
  // bytes that would expand to 2^60 values.
  std::string body = bytes("Nq\x00");
  for (int k = 0; k < 60; ++k) {
    body += "h" + std::string(1, static_cast<char>(k)) + "\x86" + "q" + std::string(1, static_cast<char>(k + 1));
  }
  const std::string path = dir + "/tower.pt";
  write_zip(path, {{"data.pkl", pickle_of(body)}, {"version", "3\n"}});
  auto load = load_with_memory_limit([&] { ddp::load_value(path); }, kHeadroom);
  ASSERT_TRUE(load.finished);
  EXPECT_NE(load.error.find("'" + path + "'"), std::string::npos) << load.error;
  EXPECT_NE(load.error.find("repeating shared references (a pickle bomb)"), std::string::npos) << load.error;
  EXPECT_LT(load.peak_growth_kib, kBoundedKiB);
  RecordProperty("peak_growth_kib", std::to_string(load.peak_growth_kib));
  fs::remove_all(dir);
}

TEST(CheckpointBombs, OneLongStringReferencedManyTimesIsRefusedInBoundedMemory) {
  auto dir = ddp::testing::make_temp_dir();
  // A list that holds one 1 MiB string 2000 times over: 2 GB from 1 MiB.
  const uint32_t length = 1 << 20;
  std::string body = "]X";
  for (int k = 0; k < 4; ++k) body += static_cast<char>((length >> (8 * k)) & 0xFF);
  body += std::string(length, 'a') + bytes("q\x00" "a");
  for (int k = 0; k < 2000; ++k) body += bytes("h\x00" "a");
  const std::string path = dir + "/strings.pt";
  write_zip(path, {{"data.pkl", pickle_of(body)}, {"version", "3\n"}});
  auto load = load_with_memory_limit([&] { ddp::load_value(path); }, kHeadroom);
  ASSERT_TRUE(load.finished);
  EXPECT_NE(load.error.find("'" + path + "'"), std::string::npos) << load.error;
  EXPECT_NE(load.error.find("pickle bomb"), std::string::npos) << load.error;
  EXPECT_LT(load.peak_growth_kib, kBoundedKiB);
  RecordProperty("peak_growth_kib", std::to_string(load.peak_growth_kib));
  fs::remove_all(dir);
}

TEST(CheckpointBombs, ADeflatedRecordThatInflatesHugelyIsRefusedBeforeItIsRead) {
  auto dir = ddp::testing::make_temp_dir();
  // 512 MiB of zeros deflate to half a megabyte: once as a tensor's storage,
  // once as the version record that the zip reader itself reads first.
  const uint64_t huge = uint64_t{512} << 20;
  const std::string storage = dir + "/storage_bomb.pt", version = dir + "/version_bomb.pt";
  write_zip(storage, {{"data.pkl", pickle_of(bytes("}X\x01\x00\x00\x00w") + tensor_call() + "s")},
                      {"version", "3\n"},
                      {"data/0", "", huge, true}});
  write_zip(version, {{"data.pkl", pickle_of("}")}, {"version", "", huge, true}});
  ASSERT_LT(fs::file_size(storage), 1u << 20);
  for (const auto& path : {storage, version}) {
    auto load = load_with_memory_limit([&] { ddp::load_value(path); }, kHeadroom);
    ASSERT_TRUE(load.finished);
    EXPECT_NE(load.error.find("'" + path + "'"), std::string::npos) << load.error;
    EXPECT_NE(load.error.find("(a compressed zip, perhaps a zip bomb)"), std::string::npos) << load.error;
    EXPECT_LT(load.peak_growth_kib, kBoundedKiB);
    RecordProperty("peak_growth_kib_" + fs::path(path).stem().string(), std::to_string(load.peak_growth_kib));
  }
  // The same bytes from memory (what ranks receive of a snapshot) are refused alike.
  std::ifstream in(storage, std::ios::binary);
  std::vector<char> contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto message = error_of([&] { ddp::deserialize_value(contents, "snapshot from rank 0"); });
  EXPECT_NE(message.find("'snapshot from rank 0': its record 'archive/data/0'"), std::string::npos) << message;
  fs::remove_all(dir);
}

TEST(CheckpointBombs, AVersionRecordThatOverflowsNamesTheFile) {
  auto dir = ddp::testing::make_temp_dir();
  const std::string path = dir + "/version.pt";
  write_zip(path, {{"data.pkl", pickle_of("}")}, {"version", "99999999999999999999999\n"}});
  auto message = error_of([&] { ddp::load_value(path); });
  EXPECT_NE(message.find("ddp: cannot load '" + path + "': its version record is not a number in range"),
            std::string::npos)
      << message;
  // Through load_state_dict and ddp::load (what --init uses) alike.
  torch::nn::Linear linear(3, 2);
  message = error_of([&] { ddp::load(linear, path); });
  EXPECT_NE(message.find("'" + path + "': its version record"), std::string::npos) << message;
  fs::remove_all(dir);
}

// The bounds leave honest files alone: a tensor record that makes up nearly
// all of the file, next to thousands of small entries.
TEST(CheckpointBombs, LargeHonestCheckpointsStillLoad) {
  auto dir = ddp::testing::make_temp_dir();
  ddp::StateDict big = {{"weight", at::rand({1 << 20})}};
  for (int k = 0; k < 2000; ++k) big.emplace_back("layers." + std::to_string(k) + ".bias", at::rand({3}));
  ddp::save_state_dict(big, dir + "/big.pt");
  auto loaded = ddp::load_state_dict(dir + "/big.pt");
  ASSERT_EQ(loaded.size(), big.size());
  EXPECT_TRUE(at::equal(loaded[0].second, big[0].second));
  fs::remove_all(dir);
}

}  // namespace

namespace {

std::string contents_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Issue 34 item 5: someone who can write into a checkpoint directory plants
// links named like the files a job writes. The temporary used to be
// "<path>.tmp.<pid>", opened with O_TRUNC through such a link (the victim
// was overwritten) and then renamed into place.
TEST(CheckpointSymlinks, PlantedLinksAreNeverFollowed) {
  auto dir = ddp::testing::make_temp_dir();
  const std::string victim = dir + "/victim.txt";
  std::ofstream(victim) << "precious";

  const std::string path = dir + "/state.pt";
  fs::create_symlink(victim, path + ".tmp." + std::to_string(::getpid()));
  ddp::save_state_dict(sample_state(), path);
  EXPECT_EQ(contents_of(victim), "precious");
  EXPECT_FALSE(fs::is_symlink(path));
  EXPECT_EQ(ddp::load_state_dict(path).size(), sample_state().size());

  // A link at the final name is refused, naming it; its target stays as it was.
  const std::string linked = dir + "/snapshot.pt";
  fs::create_symlink(victim, linked);
  auto message = error_of([&] { ddp::save_value(c10::IValue(int64_t{1}), linked); });
  EXPECT_NE(message.find("'" + linked + "': it is a symbolic link (to '" + victim + "')"), std::string::npos)
      << message;
  EXPECT_EQ(contents_of(victim), "precious");
  EXPECT_TRUE(fs::is_symlink(linked));
  // No temporary is left behind.
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp." + std::to_string(::getpid()) + "."), std::string::npos)
        << entry.path();
  }
  fs::remove_all(dir);
}

// Issue 34 item 11: the whole file used to be built in memory (a vector that
// doubles as it grows) after a compact copy of every tensor, so a save
// needed about four times the model. Streamed, a save of 128 MiB fits in
// 96 MiB more address space than the model's.
TEST(CheckpointMemory, ASaveIsStreamedToTheFile) {
  auto dir = ddp::testing::make_temp_dir();
  const std::string path = dir + "/big.pt";
  ddp::StateDict state = {{"weight", at::ones({32 << 20}, at::kFloat)}, {"bias", at::ones({16})}};
  auto save = ddp::testing::load_with_memory_limit([&] { ddp::save_state_dict(state, path); }, size_t{96} << 20);
  ASSERT_TRUE(save.finished) << "the save died (std::terminate?)";
  EXPECT_EQ(save.error, "");
  EXPECT_LT(save.peak_growth_kib, 32 << 10);
  RecordProperty("peak_growth_kib", std::to_string(save.peak_growth_kib));
  auto loaded = ddp::load_state_dict(path);
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_TRUE(at::equal(loaded[0].second, state[0].second));

  // With room for the copy but not for the doubling buffer, the old writer's
  // allocation failure met its destructor's second write and ended the
  // process in std::terminate (the report's "transport failed" misdiagnosis).
  // One intra-op thread: OpenMP's pool does not survive fork, and a parallel
  // copy in the child would hang.
  auto roomier = ddp::testing::load_with_memory_limit(
      [&] {
        at::set_num_threads(1);
        ddp::save_state_dict(state, path);
      },
      size_t{320} << 20);
  ASSERT_TRUE(roomier.finished) << "the save died (std::terminate?)";
  EXPECT_EQ(roomier.error, "");
  fs::remove_all(dir);
}

// Running out of memory is an error that names the file and the size, and
// leaves the previous file: a view is saved as a compact copy, which does
// not fit here.
TEST(CheckpointMemory, RunningOutOfMemoryNamesTheFileAndTheSize) {
  auto dir = ddp::testing::make_temp_dir();
  const std::string path = dir + "/big.pt";
  ddp::save_state_dict(sample_state(), path);
  const auto before = fs::file_size(path);
  ddp::StateDict state = {{"weight", at::ones({4096, 8192}, at::kFloat).t()}};
  auto save = ddp::testing::load_with_memory_limit([&] { ddp::save_state_dict(state, path); }, size_t{64} << 20);
  ASSERT_TRUE(save.finished) << "the save died (std::terminate?)";
  EXPECT_NE(save.error.find("ddp: ran out of memory while saving '" + path + "' (134217728 bytes of tensors)"),
            std::string::npos)
      << "error: " << save.error;
  EXPECT_EQ(fs::file_size(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);

  // A write that fails midway (here a file-size limit) is an error naming
  // the file, and the zip writer, left unfinished, does not end the process.
  ddp::StateDict large = {{"weight", at::ones({4 << 20})}};
  auto full = ddp::testing::load_with_memory_limit(
      [&] {
        ::signal(SIGXFSZ, SIG_IGN);
        struct rlimit limit {1 << 20, 1 << 20};
        ::setrlimit(RLIMIT_FSIZE, &limit);
        ddp::save_state_dict(large, path);
      },
      size_t{256} << 20);
  ASSERT_TRUE(full.finished) << "the save died (std::terminate?)";
  EXPECT_NE(full.error.find("ddp: writing '" + path + ".tmp."), std::string::npos) << full.error;
  EXPECT_NE(full.error.find("File too large"), std::string::npos) << full.error;
  EXPECT_EQ(fs::file_size(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  fs::remove_all(dir);
}

// Issue 34 item 17: typed lists used to be written as calls of
// torch.jit._pickle.build_tensorlist (and build_intlist, ...), which
// Python's weights-only torch.load refuses.
TEST(Checkpoint, TypedListsAreWrittenAsPlainListsThatPythonReads) {
  auto dir = ddp::testing::make_temp_dir();
  const std::string path = dir + "/lists.pt";
  c10::List<at::Tensor> tensors;
  tensors.push_back(at::ones({2}));
  tensors.push_back(at::arange(3, at::kLong));
  c10::impl::GenericDict inner(c10::StringType::get(), c10::AnyType::get());
  inner.insert("tensors", tensors);
  inner.insert("doubles", c10::List<double>({0.5, 1.5}));
  c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
  outer.insert("ints", c10::List<int64_t>({1, 2, 3}));
  outer.insert("bools", c10::List<bool>({true, false}));
  outer.insert("inner", inner);
  ddp::save_value(outer, path);
  auto python = ddp::testing::run_process(
      {DDP_PYTHON, "-c",
       "import sys, torch\n"
       "v = torch.load(sys.argv[1], weights_only=True)\n"
       "i = v['inner']\n"
       "print(v['ints'], v['bools'], i['doubles'], [t.tolist() for t in i['tensors']])\n",
       path});
  ASSERT_EQ(python.exit_code, 0) << python.describe();
  EXPECT_NE(python.out.find("[1, 2, 3] [True, False] [0.5, 1.5] [[1.0, 1.0], [0, 1, 2]]"), std::string::npos)
      << python.out;
  auto back = ddp::load_value(path).toGenericDict();
  EXPECT_EQ(back.at("ints").toListRef().size(), 3u);
  const auto& tensors_back = back.at("inner").toGenericDict().at("tensors").toListRef();
  EXPECT_TRUE(at::equal(tensors_back[1].toTensor(), at::arange(3, at::kLong)));
  fs::remove_all(dir);
}

}  // namespace
