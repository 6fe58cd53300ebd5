#include "fault/ft_store.h"

#include <ddp/error.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace ddp::detail {

c10::intrusive_ptr<c10d::Store> open_ft_store(const std::string& spec, std::chrono::milliseconds timeout) {
  const std::string tcp = "tcp://";
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
