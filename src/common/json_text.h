#pragma once

// Internal, not API: JSON laid out as Python's json.dumps lays it out by
// default ({"key": value, "other": [1, 2]}), the layout of torchrun's error
// files and of the metrics files that tests and tools/plot read. nlohmann's
// dump() has no such separators, so the layout is written here and every key
// and scalar is escaped by nlohmann.

#include "common/fmt_header_only.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <string>

namespace ddp::detail {

// Insertion-ordered, as the files have always listed their keys.
using OrderedJson = nlohmann::ordered_json;

// Text that is not valid UTF-8 (a C++ exception's bytes) is written with
// U+FFFD in place of the bad bytes: a JSON reader would refuse it whole.
inline std::string compact_json(const OrderedJson& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

// A double as "%.10g" writes it ("100", "0.96875"), as the metrics files
// always have; NaN and the infinities, which JSON cannot spell, as null.
inline void append_python_style(std::string& out, const OrderedJson& value) {
  if (value.is_object()) {
    out += '{';
    const char* separator = "";
    for (const auto& [key, item] : value.items()) {
      out += separator;
      out += compact_json(key);
      out += ": ";
      append_python_style(out, item);
      separator = ", ";
    }
    out += '}';
  } else if (value.is_array()) {
    out += '[';
    const char* separator = "";
    for (const auto& item : value) {
      out += separator;
      append_python_style(out, item);
      separator = ", ";
    }
    out += ']';
  } else if (value.is_number_float()) {
    const double number = value.get<double>();
    out += std::isfinite(number) ? fmt::format("{:.10g}", number) : "null";
  } else {
    out += compact_json(value);
  }
}

inline std::string python_style_json(const OrderedJson& value) {
  std::string out;
  append_python_style(out, value);
  return out;
}

}  // namespace ddp::detail
