#pragma once

// Stack dumps on demand, for a job that hangs: every thread's native stack
// and the last collectives of each process group, printed to stderr, after
// which the program carries on. A process group installs it for SIGUSR1 when
// asked to (ProcessGroupOptions::install_stack_dump_handler, or
// DDP_DIAGNOSTIC_HANDLERS=1, which ddprun sets for its workers; ddprun
// forwards SIGUSR1 to every worker, and `kill -USR1 PID` works too); a
// program that asks for neither keeps its SIGUSR1. A rank whose collective
// has waited half its timeout dumps once by itself either way.
// DDP_STACK_DUMP_SIGNAL=off leaves SIGUSR1 alone even when asked.
//
// A dump makes each thread capture its own stack on a real-time signal
// (SIGRTMIN+5), whose handler ddp installs with the first dump or the
// SIGUSR1 handler, whichever comes first.

#include <ddp/export.h>
#include <cstdio>
#include <string>

namespace ddp {

class CollectiveTrace;

/// Installs the dump for `signal` (once per process: a second call, with
/// any signal, changes nothing). Returns false if DDP_STACK_DUMP_SIGNAL=off
/// turned it off.
DDP_API bool install_stack_dump_handler(int signal);

/// Dumps now, from the calling thread, headed by `reason`.
DDP_API void dump_stacks(const std::string& reason);

namespace detail {
/// A process group's trace and rank, printed with every dump while it lives.
void register_trace_for_dumps(const void* owner, const CollectiveTrace* trace, int rank);
void unregister_trace_for_dumps(const void* owner);
/// An exception that escapes a backend's thread while a process group lives
/// ends the process with ddp's error line (rank, collectives in flight, the
/// likely cause), recorded for the launcher, and exit status 1, not abort().
/// Once per process; ProcessGroup::create calls it when
/// ProcessGroupOptions::install_terminate_handler() is true.
void install_transport_failure_handler();
}  // namespace detail

}  // namespace ddp
