#pragma once

// The environment variables a launcher (ddprun, torchrun) sets for its
// workers and ddp reads, named once for both sides. Torch-free: ddprun
// includes it too.

namespace ddp::launch_env {

// Where a worker stands (torchrun's names; env.h reads them).
constexpr const char* kRank = "RANK";
constexpr const char* kLocalRank = "LOCAL_RANK";
constexpr const char* kWorldSize = "WORLD_SIZE";
constexpr const char* kLocalWorldSize = "LOCAL_WORLD_SIZE";
constexpr const char* kGroupRank = "GROUP_RANK";  ///< the node's rank
constexpr const char* kMasterAddr = "MASTER_ADDR";
constexpr const char* kMasterPort = "MASTER_PORT";

// The job and its attempt.
constexpr const char* kRunId = "TORCHELASTIC_RUN_ID";
constexpr const char* kDdpRunId = "DDP_RUN_ID";  ///< preferred over kRunId by ddp
constexpr const char* kRestartCount = "TORCHELASTIC_RESTART_COUNT";
/// "True" when the launcher's agent hosts the store every rank joins
/// (torchrun); ddprun sets "False": rank 0 hosts it.
constexpr const char* kUseAgentStore = "TORCHELASTIC_USE_AGENT_STORE";

// What a failing worker leaves for its launcher.
/// The JSON file of the worker's first error (error_file.h writes it).
constexpr const char* kErrorFile = "TORCHELASTIC_ERROR_FILE";
/// ddprun's --log-dir for this attempt; ddp writes collective traces there.
constexpr const char* kLogDir = "DDP_LOG_DIR";

// What ddp may do to the worker's process.
/// "1": ProcessGroup::create installs ddp's SIGUSR1 stack dump and
/// std::terminate handler (ProcessGroupOptions); ddprun sets it unless the
/// user did.
constexpr const char* kDiagnosticHandlers = "DDP_DIAGNOSTIC_HANDLERS";

}  // namespace ddp::launch_env
