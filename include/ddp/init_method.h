#pragma once

// How the ranks of a job find each other: torch.distributed's init_method,
// for ProcessGroupOptions::init_method.
//
//   env://             rank 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT (the default)
//   tcp://HOST:PORT    the same at HOST:PORT; MASTER_ADDR/MASTER_PORT are not needed
//   file:///ABS/PATH   a c10d FileStore in a file every rank can reach (a shared file
//                      system): no address at all; each run needs a file that is not
//                      there yet, or was removed by the last run (see README)
//
// RANK and WORLD_SIZE (or another launcher's variables) still come from the
// environment with every form.

#include <ddp/export.h>
#include <string>

namespace ddp {

/// A parsed init method.
struct InitMethod {
  enum class Kind { kEnv, kTcp, kFile };
  Kind kind = Kind::kEnv;
  std::string text = "env://";  ///< as given
  std::string path;             ///< kFile: the store file's absolute path
  std::string host;             ///< kTcp: the store's host (no brackets for IPv6)
  int port = 0;                 ///< kTcp: the store's port
};

/// Parses "env://", "tcp://HOST:PORT" ("tcp://[::1]:PORT" for IPv6) or
/// "file:///ABS/PATH"; an empty string is "env://". Anything else throws a
/// ddp::Error that names the value and the accepted forms.
DDP_API InitMethod parse_init_method(const std::string& text);

/// DDP_INIT_METHOD from the environment when it is set and not empty, else
/// "env://".
DDP_API std::string default_init_method();

}  // namespace ddp
