// A helper process that SIGKILLs the workers' process groups if the launcher dies without
// cleaning up (SIGKILL, a crash). PR_SET_PDEATHSIG covers only the workers themselves; the
// processes they started would otherwise live on.
#pragma once

#include <sys/types.h>

namespace ddprun {

class Watchdog {
 public:
  // Forks the watchdog. Create it before any worker pipe exists, so it holds none of them.
  // Throws std::runtime_error.
  Watchdog();
  // Without dismiss(), closing our end of the pipe tells the watchdog to kill every group.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Adds a worker's process group to those killed if the launcher dies.
  void watch(pid_t process_group);

  // Removes a group again. Call it before reaping the group's leader: once reaped, the id may
  // be reused by an unrelated process that the watchdog must not kill.
  void forget(pid_t process_group);

  // The launcher has stopped and reaped every worker itself: the watchdog exits without killing
  // anything (the group ids may already belong to other processes). Waits for it to exit.
  void dismiss();

 private:
  int write_fd_ = -1;
  pid_t pid_ = -1;
};

}  // namespace ddprun
