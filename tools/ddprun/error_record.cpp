#include "error_record.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

namespace ddprun {
namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

// Just enough JSON for error files: objects, arrays, strings, numbers, literals.
struct Json {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  std::string text;  // kString; kNumber keeps its digits here too
  std::vector<Json> items;
  std::map<std::string, Json> members;

  const Json* member(const std::string& name) const {
    auto it = members.find(name);
    return kind == Kind::kObject && it != members.end() ? &it->second : nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : text_(text) {}

  bool parse(Json& out) {
    if (!value(out, 0)) return false;
    skip_space();
    return pos_ == text_.size();
  }

 private:
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool literal(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (text_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }
  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }
  bool string(std::string& out) {
    if (pos_ >= text_.size() || text_[pos_] != '"') return false;
    ++pos_;
    while (pos_ < text_.size()) {
      char c = text_[pos_++];
      if (c == '"') return true;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) return false;
      char e = text_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (pos_ + 4 > text_.size()) return false;
          unsigned code = static_cast<unsigned>(std::strtoul(text_.substr(pos_, 4).c_str(), nullptr, 16));
          pos_ += 4;
          append_utf8(out, code);
          break;
        }
        default: out += e;  // \" \\ \/
      }
    }
    return false;
  }
  bool value(Json& out, int depth) {
    if (depth > 64) return false;
    skip_space();
    if (pos_ >= text_.size()) return false;
    char c = text_[pos_];
    if (c == '{') {
      out.kind = Json::Kind::kObject;
      ++pos_;
      skip_space();
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return true;
      }
      while (true) {
        skip_space();
        std::string name;
        if (!string(name)) return false;
        skip_space();
        if (pos_ >= text_.size() || text_[pos_++] != ':') return false;
        Json member;
        if (!value(member, depth + 1)) return false;
        out.members[name] = std::move(member);
        skip_space();
        if (pos_ >= text_.size()) return false;
        if (text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (text_[pos_++] == '}') return true;
        return false;
      }
    }
    if (c == '[') {
      out.kind = Json::Kind::kArray;
      ++pos_;
      skip_space();
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
        return true;
      }
      while (true) {
        Json item;
        if (!value(item, depth + 1)) return false;
        out.items.push_back(std::move(item));
        skip_space();
        if (pos_ >= text_.size()) return false;
        if (text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (text_[pos_++] == ']') return true;
        return false;
      }
    }
    if (c == '"') {
      out.kind = Json::Kind::kString;
      return string(out.text);
    }
    if (literal("true")) {
      out.kind = Json::Kind::kBool;
      out.boolean = true;
      return true;
    }
    if (literal("false")) {
      out.kind = Json::Kind::kBool;
      return true;
    }
    if (literal("null")) return true;
    size_t start = pos_;
    while (pos_ < text_.size() && (std::isdigit(static_cast<unsigned char>(text_[pos_])) ||
                                   std::string("+-.eE").find(text_[pos_]) != std::string::npos)) {
      ++pos_;
    }
    if (pos_ == start) return false;
    out.kind = Json::Kind::kNumber;
    out.text = text_.substr(start, pos_ - start);
    out.number = std::strtod(out.text.c_str(), nullptr);
    return true;
  }

  const std::string& text_;
  size_t pos_ = 0;
};

// A number given as a JSON number or a string of digits ("1700000000").
bool integer_of(const Json* json, long long& out) {
  if (json == nullptr) return false;
  if (json->kind != Json::Kind::kNumber && json->kind != Json::Kind::kString) return false;
  const std::string& digits = json->text;
  if (digits.empty()) return false;
  char* end = nullptr;
  long long value = std::strtoll(digits.c_str(), &end, 10);
  if (end == digits.c_str()) return false;
  out = value;
  return true;
}

}  // namespace

ErrorRecord read_error_record(const std::string& path) {
  ErrorRecord record;
  try {
    std::ifstream in(path);
    if (!in.good()) return record;
    std::stringstream buffer;
    buffer << in.rdbuf();
    Json root;
    if (!JsonParser(buffer.str()).parse(root) || root.kind != Json::Kind::kObject) return record;
    const Json* message = root.member("message");
    if (message == nullptr) return record;
    long long seconds = 0;
    if (message->kind == Json::Kind::kString) {
      record.message = message->text;
      integer_of(root.member("timestamp"), seconds);
    } else if (message->kind == Json::Kind::kObject) {
      const Json* text = message->member("message");
      if (text == nullptr || text->kind != Json::Kind::kString) return record;
      record.message = text->text;
      if (const Json* extra = message->member("extraInfo")) integer_of(extra->member("timestamp"), seconds);
    } else {
      return record;
    }
    record.timestamp_ns = seconds * 1000000000LL;
    // A ddp program says which errors are consequences (by their type, in
    // the "ddp" object); only other programs' messages are judged by text.
    bool judged = false;
    if (const Json* ddp = root.member("ddp")) {
      long long ns = 0;
      if (integer_of(ddp->member("timestamp_ns"), ns)) record.timestamp_ns = ns;
      if (const Json* flag = ddp->member("consequence"); flag != nullptr && flag->kind == Json::Kind::kBool) {
        record.consequence = flag->boolean;
        judged = true;
      }
    }
    if (!judged) record.consequence = looks_like_consequence(record.message);
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

bool looks_like_consequence(const std::string& message) {
  const std::string text = lower(message);
  static const char* const kPatterns[] = {
      "connection closed by peer", "connection reset by peer", "broken pipe", "a peer may have died",
      "timed out", "socket timeout", "wait timeout", "not all of them joined", "stops too",
      "cannot reach the master", "did not publish its run id", "for rank 0 to join",
  };
  for (const char* pattern : kPatterns) {
    if (text.find(pattern) != std::string::npos) return true;
  }
  return false;
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
