#include "error_record.h"

#include <ddp/launch_errors.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ddprun {
namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

using Json = nlohmann::json;

// A number given as a JSON number or a string of digits ("1700000000"), as
// Python workers and ddp programs write their timestamps.
bool integer_of(const Json& object, const char* key, long long& out) {
  auto it = object.find(key);
  if (it == object.end()) return false;
  if (it->is_number_integer()) {
    out = it->get<long long>();
    return true;
  }
  if (it->is_number_float()) {
    const double seconds_or_ns = it->get<double>();
    if (!(std::fabs(seconds_or_ns) < 9e18)) return false;  // would not fit
    out = static_cast<long long>(seconds_or_ns);
    return true;
  }
  if (!it->is_string()) return false;
  const std::string& digits = it->get_ref<const std::string&>();
  char* end = nullptr;
  long long value = std::strtoll(digits.c_str(), &end, 10);
  if (end == digits.c_str()) return false;
  out = value;
  return true;
}

// The file's JSON, or a discarded value. Text that is not UTF-8 (a program
// that wrote an exception's raw bytes) is read with its high bytes as '?',
// rather than losing the whole message.
Json parse_error_file(std::string text) {
  Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!root.is_discarded()) return root;
  for (char& c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) c = '?';
  }
  return Json::parse(text, nullptr, /*allow_exceptions=*/false);
}

}  // namespace

ErrorRecord read_error_record(const std::string& path) {
  ErrorRecord record;
  try {
    std::ifstream in(path);
    if (!in.good()) return record;
    std::stringstream buffer;
    buffer << in.rdbuf();
    const Json root = parse_error_file(buffer.str());
    if (!root.is_object()) return record;
    auto message = root.find("message");
    if (message == root.end()) return record;
    long long seconds = 0;
    if (message->is_string()) {
      record.message = message->get<std::string>();
      integer_of(root, "timestamp", seconds);
    } else if (message->is_object()) {
      auto text = message->find("message");
      if (text == message->end() || !text->is_string()) return record;
      record.message = text->get<std::string>();
      if (auto extra = message->find("extraInfo"); extra != message->end() && extra->is_object()) {
        integer_of(*extra, "timestamp", seconds);
      }
    } else {
      return record;
    }
    record.timestamp_ns = seconds * 1000000000LL;
    // A ddp program says which errors are consequences (by their type, in
    // the "ddp" object); only other programs' messages are judged by text.
    bool judged = false;
    if (auto ddp = root.find("ddp"); ddp != root.end() && ddp->is_object()) {
      long long ns = 0;
      if (integer_of(*ddp, "timestamp_ns", ns)) record.timestamp_ns = ns;
      if (auto flag = ddp->find("consequence"); flag != ddp->end() && flag->is_boolean()) {
        record.consequence = flag->get<bool>();
        judged = true;
      }
    }
    if (!judged) record.consequence = ddp::launch_errors::reads_like_consequence(record.message);
    // A multi-line message (a Python traceback) is reported by its first line.
    size_t newline = record.message.find('\n');
    if (newline != std::string::npos) record.message = record.message.substr(0, newline) + " [...]";
    if (record.message.size() > 2000) record.message = record.message.substr(0, 2000) + " [...]";
    record.present = !record.message.empty();
  } catch (...) {
    record = ErrorRecord();
  }
  return record;
}

bool is_stack_frame_line(const std::string& line) {
  size_t start = line.find_first_not_of(" \t");
  if (start == std::string::npos) return false;
  std::string rest = line.substr(start);
  if (rest.rfind("frame #", 0) == 0) return true;
  if (rest.rfind("Exception raised from ", 0) == 0) return true;
  if (rest.rfind("File \"", 0) == 0) return true;  // a Python traceback's frame
  return false;
}

bool is_error_line(const std::string& line) {
  if (is_stack_frame_line(line)) return false;
  const std::string text = lower(line);
  return text.find("error") != std::string::npos || text.find("terminate called") != std::string::npos ||
         text.find("exception") != std::string::npos || text.find("what():") != std::string::npos;
}

}  // namespace ddprun
