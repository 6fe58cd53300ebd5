#include "std_spec.h"

#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace ddprun {
namespace {

bool is_number(const std::string& text) {
  return !text.empty() && text.size() <= 9 && text.find_first_not_of("0123456789") == std::string::npos;
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream stream(text);
  while (std::getline(stream, part, separator)) parts.push_back(part);
  // getline drops a trailing empty part; it matters for "0:1,".
  if (!text.empty() && text.back() == separator) parts.emplace_back();
  return parts;
}

[[noreturn]] void malformed() {
  throw std::invalid_argument(
      "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for every local rank, or LOCAL_RANK:VALUE "
      "pairs such as 0:3,1:1");
}

int stream_value(const std::string& text) {
  if (text.size() != 1 || text[0] < '0' || text[0] > '3') malformed();
  return text[0] - '0';
}

}  // namespace

int std_streams_for(const std::string& spec, int local_rank) {
  if (spec.find(':') == std::string::npos) return stream_value(spec);
  int streams = 0;
  for (const std::string& pair : split(spec, ',')) {
    const size_t colon = pair.find(':');
    if (colon == std::string::npos || !is_number(pair.substr(0, colon))) malformed();
    const int value = stream_value(pair.substr(colon + 1));
    if (std::stoi(pair.substr(0, colon)) == local_rank) streams = value;
  }
  return streams;
}

void check_std_spec(const std::string& spec) { std_streams_for(spec, 0); }

std::set<int> parse_local_ranks(const std::string& list) {
  std::set<int> ranks;
  if (list.empty()) return ranks;
  for (const std::string& entry : split(list, ',')) {
    if (!is_number(entry)) {
      throw std::invalid_argument("expected local ranks (integers >= 0) separated by commas, such as 0,2");
    }
    ranks.insert(std::stoi(entry));
  }
  return ranks;
}

}  // namespace ddprun
