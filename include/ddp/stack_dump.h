#pragma once

// Stack dumps on demand, for a job that hangs: every thread's native stack
// and the last collectives of each process group, printed to stderr, after
// which the program carries on. init_process_group() installs it for
// SIGUSR1 (`ddprun` forwards SIGUSR1 to every worker; `kill -USR1 PID` works
// too), and a rank whose collective has waited half its timeout dumps once by
// itself. DDP_STACK_DUMP_SIGNAL=off leaves SIGUSR1 alone.

#include <cstdio>
#include <string>

namespace ddp {

class CollectiveTrace;

/// Installs the dump for `signal` (idempotent). Returns false if the
/// environment turned it off.
bool install_stack_dump_handler(int signal);

/// Dumps now, from the calling thread, headed by `reason`.
void dump_stacks(const std::string& reason);

namespace detail {
/// A process group's trace and rank, printed with every dump while it lives.
void register_trace_for_dumps(const void* owner, const CollectiveTrace* trace, int rank);
void unregister_trace_for_dumps(const void* owner);
/// An exception that escapes a backend's thread while a process group lives
/// ends the process with ddp's error line (rank, collectives in flight, the
/// likely cause), recorded for the launcher, and exit status 1, not abort().
void install_transport_failure_handler();
}  // namespace detail

}  // namespace ddp
