#pragma once

// Summaries the C++ benchmarks print, so every one reports alike: one JSON
// line (nlohmann's ordered_json, so the keys keep the order they are set in)
// with numbers at the precision the benchmarks have always reported.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace bench {

/// The median (the mean of the middle two for an even count; 0 when empty).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

/// `value` with `decimals` digits after the point, as printf's "%.Nf" shows it.
inline double rounded(double value, int decimals) {
  char text[512];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return std::strtod(text, nullptr);
}

/// `value` with `digits` significant digits, as printf's "%.Ng" (and an
/// ostream's default of 6) shows it.
inline double significant(double value, int digits = 6) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*g", digits, value);
  return std::strtod(text, nullptr);
}

/// Each of `values` with 6 significant digits: the lists of step times.
inline std::vector<double> significant(const std::vector<double>& values) {
  std::vector<double> shown;
  shown.reserve(values.size());
  for (double value : values) shown.push_back(significant(value));
  return shown;
}

/// Prints `line` on one line of stdout and flushes it: the drivers
/// (bench/run_bench.py, run_memory_bench.py, gpu_check.sh) read one JSON
/// object per line.
inline void print_json_line(const nlohmann::ordered_json& line) {
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

}  // namespace bench
