#pragma once

// The whole public API of ddp in one include:
//
//   #include <ddp/ddp.h>
//
//   auto group = ddp::init_process_group();          // torchrun, ddprun, srun, mpirun or alone
//   ddp::DistributedDataParallel<Net> model(Net(), group);
//
// Each header below holds one concept and can be included on its own for
// faster builds.

#include <ddp/autocast.h>
#include <ddp/checkpoint.h>
#include <ddp/clip_grad.h>
#include <ddp/collective_trace.h>
#include <ddp/comm_hooks.h>
#include <ddp/device.h>
#include <ddp/device_mesh.h>
#include <ddp/diloco.h>
#include <ddp/distributed_checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include <ddp/env.h>
#include <ddp/error.h>
#include <ddp/error_file.h>
#include <ddp/fault_tolerance.h>
#include <ddp/fault_tolerant_hsdp.h>
#include <ddp/fully_sharded_data_parallel.h>
#include <ddp/grad_scaler.h>
#include <ddp/launch_env.h>
#include <ddp/nonfinite.h>
#include <ddp/process_group.h>
#include <ddp/progress.h>
#include <ddp/sharded_snapshot.h>
#include <ddp/snapshot.h>
#include <ddp/snapshot_saver.h>
#include <ddp/stack_dump.h>
#include <ddp/zero_redundancy_optimizer.h>
