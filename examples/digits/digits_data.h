#pragma once

// The UCI 8x8 handwritten digits for the example: reading the gzip'd CSV, a
// seeded train/test split and pixel scaling. Plain LibTorch, no ddp.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace digits {

constexpr int64_t kImageSide = 8;
constexpr int64_t kNumPixels = kImageSide * kImageSide;
constexpr int64_t kNumClasses = 10;
constexpr double kMaxPixel = 16;  // pixels count "on" bits in 4x4 blocks: 0..16

struct Dataset {
  at::Tensor images;  // [n, 1, 8, 8] float32
  at::Tensor labels;  // [n] int64
  int64_t size() const { return images.size(0); }
};

/// Reads rows of 64 pixel values in [0, 16] then an integer label in [0, 10),
/// no header, through zlib: a gzip'd file, or a plain one as it is. Throws,
/// naming the file and line, on a missing or empty file, corrupt compressed
/// data, a wrong column count, a non-numeric value, a pixel out of range or a
/// label outside [0, 10).
Dataset read_csv_gz(const std::string& path);

/// A seeded split: a permutation from a CPU generator seeded with `seed`; the
/// first ceil(test_fraction * n) samples of it are the test set. The same seed
/// gives the same split on every rank and in every run.
struct Split {
  Dataset train;
  Dataset test;
};
Split train_test_split(const Dataset& data, double test_fraction, uint64_t seed);

/// Pixels from 0..16 to 0..1, in place.
void scale_pixels(Dataset& data);

/// Where the shipped copy of the data lives.
std::string default_data_path();

}  // namespace digits
