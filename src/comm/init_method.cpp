#include <ddp/init_method.h>

#include <ddp/env.h>
#include <ddp/error.h>

#include <cstdlib>

namespace ddp {
namespace {

constexpr const char* kInitMethodVariable = "DDP_INIT_METHOD";

constexpr const char* kAccepted =
    "env:// (rank 0 hosts the store at MASTER_ADDR:MASTER_PORT), tcp://HOST:PORT (the store at HOST:PORT) or "
    "file:///ABSOLUTE/PATH (a store file on a file system every rank shares)";

[[noreturn]] void reject(const std::string& text, const std::string& why) {
  DDP_CHECK(false, "ddp: init_method '", text, "' ", why, ". Use ", kAccepted,
            "; set it with ProcessGroupOptions::init_method or DDP_INIT_METHOD.");
}

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

void reject_query(const std::string& text, const std::string& rest) {
  if (rest.find('?') != std::string::npos) {
    reject(text, "has a query part ('?...'); ddp reads the rank and world size from the environment (RANK, "
                 "WORLD_SIZE or another launcher's variables), never from the init method");
  }
}

InitMethod parse_tcp(const std::string& text, const std::string& rest) {
  reject_query(text, rest);
  InitMethod method;
  method.kind = InitMethod::Kind::kTcp;
  method.text = text;
  std::string port_text;
  if (starts_with(rest, "[")) {
    const size_t close = rest.find(']');
    if (close == std::string::npos || close + 1 >= rest.size() || rest[close + 1] != ':') {
      reject(text, "has no port: write an IPv6 host as tcp://[ADDRESS]:PORT");
    }
    method.host = rest.substr(1, close - 1);
    port_text = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos) reject(text, "has no port: write tcp://HOST:PORT");
    method.host = rest.substr(0, colon);
    port_text = rest.substr(colon + 1);
    if (method.host.find(':') != std::string::npos) {
      reject(text, "has an IPv6 host without brackets: write tcp://[ADDRESS]:PORT");
    }
  }
  if (method.host.empty()) reject(text, "has no host: write tcp://HOST:PORT");
  if (method.host.find('/') != std::string::npos) reject(text, "has a path; write tcp://HOST:PORT and nothing more");
  bool digits = !port_text.empty() && port_text.size() <= 5;
  for (char c : port_text) digits = digits && c >= '0' && c <= '9';
  const int port = digits ? std::atoi(port_text.c_str()) : 0;
  if (port < 1 || port > 65535) reject(text, "has port '" + port_text + "', which is not a port in [1, 65535]");
  method.port = port;
  return method;
}

InitMethod parse_file(const std::string& text, const std::string& rest) {
  reject_query(text, rest);
  if (!starts_with(rest, "/")) {
    reject(text, "does not name an absolute path: a file URL has three slashes before it, as in "
                 "file:///shared/jobs/run1.store");
  }
  if (rest.back() == '/') reject(text, "names a directory; name a file in it, e.g. " + text + "run.store");
  InitMethod method;
  method.kind = InitMethod::Kind::kFile;
  method.text = text;
  method.path = rest;
  return method;
}

}  // namespace

InitMethod parse_init_method(const std::string& text) {
  if (text.empty() || text == "env://") return InitMethod{};
  if (starts_with(text, "env://")) {
    reject(text, "has something after env://; env:// reads MASTER_ADDR and MASTER_PORT from the environment");
  }
  if (starts_with(text, "tcp://")) return parse_tcp(text, text.substr(6));
  if (starts_with(text, "file://")) return parse_file(text, text.substr(7));
  reject(text, "is not one ddp knows");
}

std::string default_init_method() {
  const char* text = std::getenv(kInitMethodVariable);
  return text != nullptr && *text != '\0' ? std::string(text) : std::string("env://");
}

}  // namespace ddp
