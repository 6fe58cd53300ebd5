#include "digits_data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

namespace digits {
namespace {

// Owns a zlib file handle.
struct GzCloser {
  void operator()(gzFile file) const { gzclose(file); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

// Whether zlib met a read error or corrupt or truncated compressed data.
bool stream_failed(gzFile file) {
  int code = Z_OK;
  gzerror(file, &code);
  return code != Z_OK;
}

// A digits row is 65 small numbers; the bound keeps a wrong file (one
// enormous line, a decompression bomb of zeros) from growing without limit.
constexpr size_t kMaxLineBytes = 16384;

// The next line without its '\n'. False at the end of the data, or on an
// error (the caller asks check_stream), so that the lines before a
// truncation are read and the one it cut is reported, not parsed.
bool next_line(gzFile file, std::string& line, const std::string& path, int64_t line_number) {
  line.clear();
  char chunk[4096];
  while (gzgets(file, chunk, sizeof(chunk)) != nullptr) {
    line += chunk;
    TORCH_CHECK(line.size() <= kMaxLineBytes + 1, path, ":", line_number, ": the line is longer than ",
                kMaxLineBytes, " bytes, but a digits row holds 65 numbers; is '", path,
                "' the gzipped CSV of the digits data?");
    if (!line.empty() && line.back() == '\n') {
      line.pop_back();
      return true;
    }
    // No newline: a line longer than the chunk, or the end of the data.
    if (stream_failed(file)) return false;
  }
  return !stream_failed(file) && !line.empty();  // a last line with no newline
}

// Throws when zlib saw a read error or corrupt data; `line_number` is the
// last line read in full.
void check_stream(gzFile file, const std::string& path, int64_t line_number) {
  int code = Z_OK;
  const char* message = gzerror(file, &code);
  if (code == Z_OK) return;
  std::string why = code == Z_ERRNO ? std::strerror(errno) : message;
  // zlib's message starts with the path; ours already names it.
  if (why.rfind(path + ": ", 0) == 0) why.erase(0, path.size() + 2);
  TORCH_CHECK(false, path, ":", line_number + 1, ": cannot read the data: ", why);
}

std::string trim(const std::string& s) {
  size_t begin = s.find_first_not_of(" \t\r");
  size_t end = s.find_last_not_of(" \t\r");
  return begin == std::string::npos ? "" : s.substr(begin, end - begin + 1);
}

std::vector<std::string> split_fields(const std::string& line) {
  std::vector<std::string> fields;
  size_t start = 0;
  while (true) {
    size_t comma = line.find(',', start);
    fields.push_back(trim(line.substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
    if (comma == std::string::npos) return fields;
    start = comma + 1;
  }
}

bool parse_number(const std::string& text, double& out) {
  // Decimal numbers only: strtod would also take "0x1A", "inf" or "nan".
  if (text.empty() || text.find_first_not_of("0123456789+-.eE") != std::string::npos ||
      text.find_first_of("0123456789") == std::string::npos) {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && errno == 0 && std::isfinite(out);
}

}  // namespace

Dataset read_csv_gz(const std::string& path) {
  // A directory fails only at its first read, with a message about reading.
  std::error_code ignored;
  TORCH_CHECK(!std::filesystem::is_directory(path, ignored), "data file '", path,
              "' is a directory; give the gzipped CSV file's path");
  errno = 0;
  GzHandle file(gzopen(path.c_str(), "rb"));
  TORCH_CHECK(file != nullptr, "cannot open data file '", path, "': ",
              errno != 0 ? std::strerror(errno) : "out of memory");

  std::vector<float> pixels;
  std::vector<int64_t> labels;
  std::string line;
  int64_t line_number = 0;
  while (next_line(file.get(), line, path, line_number + 1)) {
    ++line_number;
    if (trim(line).empty()) continue;
    auto fields = split_fields(trim(line));
    TORCH_CHECK(fields.size() == static_cast<size_t>(kNumPixels + 1), path, ":", line_number, ": expected ",
                kNumPixels + 1, " columns (64 pixels and a label), found ", fields.size());
    double value = 0;
    for (int64_t c = 0; c < kNumPixels; ++c) {
      TORCH_CHECK(parse_number(fields[c], value), path, ":", line_number, ": column ", c + 1,
                  " is not a number: '", fields[c], "'");
      TORCH_CHECK(value >= 0 && value <= kMaxPixel, path, ":", line_number, ": column ", c + 1,
                  ": a pixel must be in [0, 16], found ", fields[c]);
      pixels.push_back(static_cast<float>(value));
    }
    const std::string& label_text = fields.back();
    TORCH_CHECK(parse_number(label_text, value), path, ":", line_number, ": column ", kNumPixels + 1,
                " is not a number: '", label_text, "'");
    TORCH_CHECK(value == std::floor(value) && value >= 0 && value < kNumClasses, path, ":", line_number,
                ": the label must be an integer in [0, ", kNumClasses, "), found '", label_text, "'");
    labels.push_back(static_cast<int64_t>(value));
  }
  check_stream(file.get(), path, line_number);
  TORCH_CHECK(!labels.empty(), "data file '", path, "' holds no data rows");

  auto n = static_cast<int64_t>(labels.size());
  Dataset data;
  data.images = at::tensor(pixels, at::kFloat).reshape({n, 1, kImageSide, kImageSide});
  data.labels = at::tensor(labels, at::kLong);
  return data;
}

Split train_test_split(const Dataset& data, double test_fraction, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor order = at::randperm(data.size(), generator, at::TensorOptions().dtype(at::kLong));
  auto n_test = static_cast<int64_t>(std::ceil(test_fraction * static_cast<double>(data.size())));
  TORCH_CHECK(n_test > 0 && n_test < data.size(), "cannot split ", data.size(),
              " samples into non-empty train and test sets");
  at::Tensor test_idx = order.narrow(0, 0, n_test);
  at::Tensor train_idx = order.narrow(0, n_test, data.size() - n_test);
  Split split;
  split.train = {data.images.index_select(0, train_idx), data.labels.index_select(0, train_idx)};
  split.test = {data.images.index_select(0, test_idx), data.labels.index_select(0, test_idx)};
  return split;
}

void scale_pixels(Dataset& data) { data.images = data.images / kMaxPixel; }

std::string default_data_path() { return DDP_DIGITS_CSV_GZ; }

}  // namespace digits
