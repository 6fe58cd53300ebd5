#include "fault/ft_store.h"

#include "comm/etcd_store.h"
#include "common/etcd_v2_client.h"

#include <ddp/error.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

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
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(address.substr(0, colon), options);
}

}  // namespace ddp::detail
