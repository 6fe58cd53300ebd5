// The whole run of ddprun's workers: one Job (job.h) per attempt, restarts after failures,
// and where each attempt's workers sit in the job: given by hand (the static rendezvous,
// --standalone) or agreed with the other nodes' ddprun in the c10d rendezvous store (rdzv.h).
#pragma once

#include "launcher.h"

namespace ddprun {

// Runs every attempt of an already validated job and returns ddprun's exit code, as
// Launcher::run() describes it.
int run_session(const LaunchOptions& options);

}  // namespace ddprun
