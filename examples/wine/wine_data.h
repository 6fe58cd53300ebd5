#pragma once

// The UCI Wine data for the examples: reading a CSV, a seeded train/test split
// and standardisation fitted on the training split. Plain LibTorch, no ddp.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace wine {

struct Dataset {
  at::Tensor features;  // [n, 13] float32
  at::Tensor labels;    // [n] int64
  int64_t size() const { return features.size(0); }
};

constexpr int64_t kNumFeatures = 13;
constexpr int64_t kNumClasses = 3;

/// Reads rows of 13 numbers then an integer label. A first line that does not
/// parse as numbers is a header and is skipped. Throws, naming the file and
/// line, on a missing or empty file, a wrong column count, a non-numeric value
/// or a label outside [0, 3).
Dataset read_csv(const std::string& path);

/// A seeded 80/20 split: the same seed gives the same split on every rank and
/// in every run.
struct Split {
  Dataset train;
  Dataset test;
};
Split train_test_split(const Dataset& data, double test_fraction, uint64_t seed);

/// Scales each feature to zero mean and unit variance using statistics of
/// `fit_on` only (no test data leaks into training), applied in place to
/// both.
void standardize(Dataset& fit_on, Dataset& also);

/// Where the shipped copy of the data lives.
std::string default_csv_path();

/// The examples' data: the shipped file's seeded 80/20 split, or the given
/// train and test files (both or neither), standardised on the training split.
Split load_split(const std::string& train_csv = "", const std::string& test_csv = "");

}  // namespace wine
