#pragma once

// Summaries the C++ benchmarks print, so every one reports alike.

#include <algorithm>
#include <sstream>
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

/// `values` as a JSON list.
inline std::string json_list(const std::vector<double>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  out << "]";
  return out.str();
}

}  // namespace bench
