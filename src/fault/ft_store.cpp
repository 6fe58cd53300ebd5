#include "fault/ft_store.h"

#include "comm/etcd_store.h"
#include "common/etcd_v2_client.h"

#include <ddp/error.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

namespace ddp::detail {

c10::intrusive_ptr<c10d::Store> open_ft_store(const std::string& spec, std::chrono::milliseconds timeout) {
  const std::string tcp = "tcp://";
  const std::string etcd = "etcd://";
  if (spec.rfind(etcd, 0) == 0) {
    // etcd://HOST:PORT[,HOST:PORT...][/PREFIX]
    const std::string rest = spec.substr(etcd.size());
    const size_t slash = rest.find('/');
    const std::string members = rest.substr(0, slash);
    const std::string prefix = slash == std::string::npos ? "/ddp-ft" : rest.substr(slash);
    std::vector<std::string> endpoints;
    try {
      endpoints = EtcdV2Client::parse_endpoints(members);
    } catch (const std::invalid_argument& error) {
      DDP_CHECK(false, "ddp: fault-tolerance store '", spec, "': ", error.what());
    }
    return make_etcd_store(endpoints, prefix, timeout);
  }
  DDP_CHECK(spec.rfind(tcp, 0) == 0, "ddp: fault-tolerance store '", spec,
            "' is not tcp://HOST:PORT or etcd://HOST:PORT[,HOST:PORT...][/PREFIX]");
  const std::string address = spec.substr(tcp.size());
  const auto colon = address.rfind(':');
  DDP_CHECK(colon != std::string::npos && colon + 1 < address.size(), "ddp: fault-tolerance store '", spec,
            "' has no port; write tcp://HOST:PORT");
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1)));
  options.isServer = false;
  options.waitWorkers = false;
  // Connecting is part of starting, which a loaded machine slows down (many
  // workers loading libtorch at once): it gets at least 30 s. The operations
  // that follow run under `timeout`, the step's deadline.
  options.timeout = std::max(timeout, std::chrono::milliseconds(30000));
  auto store = c10::make_intrusive<c10d::TCPStore>(address.substr(0, colon), options);
  store->setTimeout(timeout);
  return store;
}

std::set<std::string> ft_store_addresses(const std::string& spec) {
  std::vector<std::string> host_ports;
  const std::string etcd = "etcd://";
  const size_t scheme = spec.find("://");
  if (scheme == std::string::npos) return {};
  std::string rest = spec.substr(scheme + 3);
  if (spec.rfind(etcd, 0) == 0) {
    try {
      host_ports = EtcdV2Client::parse_endpoints(rest.substr(0, rest.find('/')));
    } catch (const std::invalid_argument&) {
      return {};  // open_ft_store names the error
    }
  } else {
    host_ports.push_back(rest);
  }
  std::set<std::string> addresses;
  for (std::string entry : host_ports) {
    if (const size_t s = entry.find("://"); s != std::string::npos) entry = entry.substr(s + 3);
    const size_t colon = entry.rfind(':');
    if (colon == std::string::npos) continue;
    std::string host = entry.substr(0, colon);
    const std::string port = entry.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* result = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &result) != 0) continue;
    for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {0};
      if (a->ai_family == AF_INET) {
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof(text));
      } else if (a->ai_family == AF_INET6) {
        inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text, sizeof(text));
      } else {
        continue;
      }
      addresses.insert(std::string(text) + ":" + port);
      if (a->ai_family == AF_INET) addresses.insert("::ffff:" + std::string(text) + ":" + port);  // a dual-stack socket's view
    }
    freeaddrinfo(result);
  }
  return addresses;
}

}  // namespace ddp::detail
