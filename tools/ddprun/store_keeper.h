// Under --fault-tolerance with the static or c10d rendezvous, the workers' fault-tolerance
// store (DDP_FT_STORE=tcp://HOST:PORT) is a c10d TCPStore. ddprun links nothing from torch, so
// a small program of ddp's, ddp_ft_store (tools/ft_store_keeper), serves it: a child of the
// ddprun on the node that hosts it, outside every worker, so that no worker's death takes the
// store with it. It dies with that ddprun; the node hosting it is the job's single point of
// failure, which --rdzv-backend etcd-v2 removes.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

namespace ddprun {

class SignalPipe;

class StoreKeeper {
 public:
  // Starts ddp_ft_store serving on `port` (0: a port it picks) and waits until it serves.
  // The program is $DDP_FT_STORE_KEEPER, else ddp_ft_store next to ddprun's own executable.
  // Throws std::runtime_error naming the program and what went wrong.
  static std::unique_ptr<StoreKeeper> start(int port, const SignalPipe& signals);
  ~StoreKeeper();  // stops it (SIGTERM, then SIGKILL) and reaps it
  StoreKeeper(const StoreKeeper&) = delete;
  StoreKeeper& operator=(const StoreKeeper&) = delete;

  int port() const { return port_; }
  pid_t pid() const { return pid_; }

 private:
  StoreKeeper(pid_t pid, int port) : pid_(pid), port_(port) {}
  pid_t pid_;
  int port_;
};

// Where ddprun looks for ddp_ft_store.
std::string store_keeper_program();

}  // namespace ddprun
