#include <ddp/checkpoint.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>
#include <torch/nn/modules/linear.h>

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
  // A directory where the temporary file must go makes the write fail
  // before anything touches the good file.
  fs::create_directory(path + ".tmp." + std::to_string(::getpid()));
  EXPECT_THROW(ddp::save_state_dict({{"x", at::ones({1000})}}, path), c10::Error);
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
