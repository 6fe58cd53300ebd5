#include "wine_data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace wine {
namespace {

std::vector<std::string> split_fields(const std::string& line) {
  std::vector<std::string> fields;
  std::string field;
  std::istringstream in(line);
  while (std::getline(in, field, ',')) fields.push_back(field);
  if (!line.empty() && line.back() == ',') fields.emplace_back();
  return fields;
}

std::string trim(const std::string& s) {
  size_t begin = s.find_first_not_of(" \t\r");
  size_t end = s.find_last_not_of(" \t\r");
  return begin == std::string::npos ? "" : s.substr(begin, end - begin + 1);
}

// Decimal numbers only: strtod would also take "0x1A", "inf" or "nan".
bool is_decimal_text(const std::string& t) {
  return !t.empty() && t.find_first_not_of("0123456789+-.eE") == std::string::npos &&
         t.find_first_of("0123456789") != std::string::npos;
}

bool parse_double(const std::string& text, double& out) {
  std::string t = trim(text);
  if (!is_decimal_text(t)) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(t.c_str(), &end);
  return end == t.c_str() + t.size() && errno == 0 && std::isfinite(out);
}

// A column name: starts with a letter, '_' or a quote ("0x1A" is no name).
bool is_name(const std::string& field) {
  std::string t = trim(field);
  if (t.empty()) return false;
  unsigned char first = static_cast<unsigned char>(t[0]);
  return std::isalpha(first) || first == '_' || first == '"' || first == '\'';
}

// Whether the first row is a real header: a name for every one of the 14
// columns, or the shipped Wine file's line "178,13,class_0,class_1,class_2"
// (sample count, feature count, class names). A row of data with one bad
// value is neither, and is reported rather than skipped.
bool is_header(const std::vector<std::string>& fields) {
  if (fields.size() == static_cast<size_t>(kNumFeatures + 1) &&
      std::all_of(fields.begin(), fields.end(), is_name)) {
    return true;
  }
  if (fields.size() < 3 || trim(fields[1]) != std::to_string(kNumFeatures)) return false;
  const std::string count = trim(fields[0]);
  if (count.empty() || count.find_first_not_of("0123456789") != std::string::npos) return false;
  return std::all_of(fields.begin() + 2, fields.end(), is_name);
}

}  // namespace

namespace {

// A Wine row is 14 short numbers; no real row comes near this. The bound
// keeps a wrong file (a binary, /dev/zero, one enormous line) from growing
// the line, and its split fields, without limit.
constexpr size_t kMaxLineBytes = 4096;

// std::getline with that bound: false at the end of the data.
bool next_line(std::istream& in, std::string& line, const std::string& path, int64_t line_number) {
  line.clear();
  char c = 0;
  bool any = false;
  while (in.get(c)) {
    any = true;
    if (c == '\n') return true;
    TORCH_CHECK(line.size() < kMaxLineBytes, path, ":", line_number, ": the line is longer than ", kMaxLineBytes,
                " bytes, but a Wine row holds 14 numbers; is '", path, "' a CSV file of the Wine data?");
    line += c;
  }
  return any;
}

}  // namespace

Dataset read_csv(const std::string& path) {
  // A directory opens and reads as empty, which would say "holds no data rows".
  std::error_code ignored;
  TORCH_CHECK(!std::filesystem::is_directory(path, ignored), "data file '", path,
              "' is a directory; give the CSV file's path");
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot open data file '", path, "': ", std::strerror(errno));
  std::vector<float> features;
  std::vector<int64_t> labels;
  std::string line;
  int64_t line_number = 0;
  bool seen_data = false;
  while (next_line(in, line, path, line_number + 1)) {
    ++line_number;
    if (trim(line).empty()) continue;
    auto fields = split_fields(trim(line));
    std::vector<double> values(fields.size());
    bool numeric = true;
    size_t bad_column = 0;
    for (size_t c = 0; c < fields.size(); ++c) {
      if (!parse_double(fields[c], values[c])) {
        numeric = false;
        bad_column = c;
        break;
      }
    }
    if (!numeric && !seen_data && line_number == 1 && is_header(fields)) continue;
    TORCH_CHECK(fields.size() == static_cast<size_t>(kNumFeatures + 1), path, ":", line_number,
                ": expected ", kNumFeatures + 1, " columns (13 features and a label), found ",
                fields.size());
    TORCH_CHECK(numeric, path, ":", line_number, ": column ", bad_column + 1, " is not a number: '",
                trim(fields[bad_column]), "'",
                line_number == 1 ? " (a first row is skipped as a header only if it names every column, or is "
                                   "the Wine file's '178,13,class_0,...' line)"
                                 : "",
                is_decimal_text(trim(fields[bad_column])) || trim(fields[bad_column]).empty()
                    ? ""
                    : " (only decimal numbers are read)");
    double label = values.back();
    TORCH_CHECK(label == std::floor(label) && label >= 0 && label < kNumClasses, path, ":",
                line_number, ": the label must be an integer in [0, ", kNumClasses, "), found '",
                trim(fields.back()), "'");
    for (int64_t c = 0; c < kNumFeatures; ++c) features.push_back(static_cast<float>(values[c]));
    labels.push_back(static_cast<int64_t>(label));
    seen_data = true;
  }
  TORCH_CHECK(!labels.empty(), "data file '", path, "' holds no data rows");
  int64_t n = static_cast<int64_t>(labels.size());
  Dataset data;
  data.features = at::tensor(features, at::kFloat).reshape({n, kNumFeatures});
  data.labels = at::tensor(labels, at::kLong);
  return data;
}

Split train_test_split(const Dataset& data, double test_fraction, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor order = at::randperm(data.size(), generator, at::TensorOptions().dtype(at::kLong));
  // Round the test share up, as scikit-learn does.
  int64_t n_test = static_cast<int64_t>(std::ceil(test_fraction * static_cast<double>(data.size())));
  TORCH_CHECK(n_test > 0 && n_test < data.size(), "cannot split ", data.size(),
              " samples into non-empty train and test sets");
  at::Tensor test_idx = order.narrow(0, 0, n_test);
  at::Tensor train_idx = order.narrow(0, n_test, data.size() - n_test);
  Split split;
  split.train = {data.features.index_select(0, train_idx), data.labels.index_select(0, train_idx)};
  split.test = {data.features.index_select(0, test_idx), data.labels.index_select(0, test_idx)};
  return split;
}

void standardize(Dataset& fit_on, Dataset& also) {
  at::Tensor mean = fit_on.features.mean(0);
  // Population standard deviation, as scikit-learn's StandardScaler uses.
  at::Tensor std = fit_on.features.std(0, /*unbiased=*/false);
  std = at::where(std > 0, std, at::ones_like(std));
  fit_on.features = (fit_on.features - mean) / std;
  also.features = (also.features - mean) / std;
}

std::string default_csv_path() { return DDP_WINE_CSV; }

Split load_split(const std::string& train_csv, const std::string& test_csv) {
  TORCH_CHECK(train_csv.empty() == test_csv.empty(), "give both a train and a test file, or neither");
  Split data = train_csv.empty() ? train_test_split(read_csv(default_csv_path()), 0.2, 42)
                                 : Split{read_csv(train_csv), read_csv(test_csv)};
  standardize(data.train, data.test);
  return data;
}

}  // namespace wine
