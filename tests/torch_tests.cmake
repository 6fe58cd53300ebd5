# Tests that need torch. Included from tests/CMakeLists.txt.

# The workers' command lines (Debian's libcli11-dev, header-only).
find_package(CLI11 2.1 CONFIG REQUIRED)

# The tiny ddp job for tests in which a launcher must exec a program.
add_executable(ddp_worker workers/ddp_worker.cpp)
target_link_libraries(ddp_worker PRIVATE ddp::ddp CLI11::CLI11)
ddp_reuse_precompiled_header(ddp_worker)

# Pure functions and single-process behaviour.
add_executable(ddp_unit_tests
  test_env.cpp
  test_sampler.cpp
  test_bucket_assignment.cpp
  test_shard_range.cpp
  test_fsdp_units.cpp
  test_optimizer_state.cpp
  test_checkpoint.cpp
  test_snapshot.cpp
  test_snapshot_saver.cpp
  test_safetensors_io.cpp
  test_terminate_handler.cpp
  test_error_file.cpp
  test_progress.cpp
  test_gloo_headers.cpp
  test_exports.cpp
  test_libtorch_integration.cpp)
# Tests link ddp_internal, never the installed libddp: it has every symbol
# and carries src/'s internal headers (the pure rules: bucket assignment,
# FSDP's unit grouping, optimizer-state re-layouts; the test seams).
target_link_libraries(ddp_unit_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
# The symbol checks (test_gloo_headers.cpp, test_exports.cpp) read the
# installed library's file.
add_dependencies(ddp_unit_tests ddp)
ddp_reuse_precompiled_header(ddp_unit_tests)
target_compile_definitions(ddp_unit_tests PRIVATE
  DDP_LIBRARY_PATH="$<TARGET_FILE:ddp>"
  DDP_TORCH_LIB_DIR="${DDP_TORCH_ROOT}/lib")
gtest_discover_tests(ddp_unit_tests PROPERTIES LABELS "unit" TIMEOUT 120
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Real processes talking over real sockets, each run under a timeout.
add_executable(ddp_process_tests
  test_wine.cpp
  test_digits.cpp
  test_torchscript.cpp)
target_link_libraries(ddp_process_tests PRIVATE ddp_test_support GTest::gtest_main)
add_dependencies(ddp_process_tests ddp_worker ddprun wine_ddp wine_single wine_sharded digits_ddp train_scripted)
gtest_discover_tests(ddp_process_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Real cluster launchers: mpirun, a single-host Slurm, two network-namespace
# nodes. Each test skips with its reason where its tools are missing.
add_executable(ddp_cluster_tests test_cluster.cpp test_cluster_two_nodes.cpp)
target_link_libraries(ddp_cluster_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_cluster_tests)
add_dependencies(ddp_cluster_tests ddprun wine_ddp ddp_worker)
gtest_discover_tests(ddp_cluster_tests PROPERTIES LABELS "cluster" TIMEOUT 300
                     RUN_SERIAL TRUE DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# One strategy's training for the launcher tests (mpirun, ddprun on the GPU).

# ---------------------------------------------------------------------------
# The GPU path: device selection, GradScaler and autocast (unit tests on the
# CPU), their multi-process scenarios over gloo, the GPT benchmarks at a tiny
# size, and the tests that need CUDA (label "gpu"; each skips without it).
add_executable(gpu_worker workers/gpu_worker.cpp)
target_link_libraries(gpu_worker PRIVATE ddp::ddp CLI11::CLI11)
ddp_reuse_precompiled_header(gpu_worker)

target_sources(ddp_unit_tests PRIVATE test_device.cpp test_grad_scaler.cpp)

add_executable(ddp_gpu_path_process_tests test_gpu_path_processes.cpp)
target_link_libraries(ddp_gpu_path_process_tests PRIVATE ddp_test_support GTest::gtest_main)
add_dependencies(ddp_gpu_path_process_tests gpu_worker ddprun)
if(TARGET gpt_bench)
  add_dependencies(ddp_gpu_path_process_tests gpt_bench)
endif()
gtest_discover_tests(ddp_gpu_path_process_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

add_executable(ddp_gpu_tests test_gpu.cpp)
target_link_libraries(ddp_gpu_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_gpu_tests)
add_dependencies(ddp_gpu_tests gpu_worker ddp_worker ddprun)
gtest_discover_tests(ddp_gpu_tests PROPERTIES LABELS "gpu" TIMEOUT 300 DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)
# FSDP and ZeRO on real ranks, each rank's code in the test file
# (support/ranks.h re-executes the test binary once per rank): strategies
# against DDP, checkpoints, gradients, reduction and mixed precision.
add_executable(ddp_fsdp_rank_tests test_fsdp_strategies.cpp test_fsdp_state_dict.cpp test_fsdp_ranks.cpp
  test_fsdp_reduction.cpp test_fsdp_mixed_precision.cpp test_clip_grad.cpp)
target_sources(ddp_fsdp_rank_tests PRIVATE test_hsdp.cpp)
target_link_libraries(ddp_fsdp_rank_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_fsdp_rank_tests)
gtest_discover_tests(ddp_fsdp_rank_tests PROPERTIES LABELS "multiprocess" TIMEOUT 240
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# ddp inside LibTorch programs, on several ranks (support/ranks.h): the
# process group's rendezvous and its faults, DDP against one process, Join,
# ZeRO-1, buffer-sync warning, sparse gradients, checkpoints from rank 0,
# TorchScript modules.
add_executable(ddp_integration_rank_tests test_integration_ranks.cpp test_gradient_sync.cpp
  test_process_group.cpp test_rendezvous_faults.cpp test_distributed_data_parallel.cpp test_no_hangs.cpp
  test_zero_redundancy_optimizer.cpp)
target_link_libraries(ddp_integration_rank_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_integration_rank_tests)
# ddprun's own tests here launch the tiny worker.
add_dependencies(ddp_integration_rank_tests ddp_worker ddprun)
gtest_discover_tests(ddp_integration_rank_tests PROPERTIES LABELS "multiprocess" TIMEOUT 240
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# torchrun (python -m torch.distributed.run) launching ddp programs: its own
# store on MASTER_PORT, standalone and static rendezvous, restarts.
add_executable(ddp_torchrun_tests test_torchrun.cpp)
target_link_libraries(ddp_torchrun_tests PRIVATE ddp_test_support GTest::gtest_main)
add_dependencies(ddp_torchrun_tests ddp_worker ddprun wine_ddp)
gtest_discover_tests(ddp_torchrun_tests PROPERTIES LABELS "multiprocess" TIMEOUT 300
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# The mpi backend under a real mpirun (each test skips without MPI).
add_executable(ddp_mpi_tests test_mpi.cpp)
target_link_libraries(ddp_mpi_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_mpi_tests)
add_dependencies(ddp_mpi_tests ddp_worker wine_ddp ddprun)
gtest_discover_tests(ddp_mpi_tests PROPERTIES LABELS "multiprocess;mpi" TIMEOUT 300 RUN_SERIAL TRUE
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# When a job hangs or ranks disagree: the collective trace, stall reports,
# the desync check, the trace analyser and stack dumps.
add_executable(ddp_trace_tests test_collective_trace.cpp)
target_link_libraries(ddp_trace_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_trace_tests)
add_dependencies(ddp_trace_tests ddprun ddp_worker)
gtest_discover_tests(ddp_trace_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)
target_sources(ddp_fsdp_rank_tests PRIVATE test_fsdp_deferred.cpp)
target_sources(ddp_fsdp_rank_tests PRIVATE test_distributed_checkpoint.cpp)
target_sources(ddp_integration_rank_tests PRIVATE test_subgroups.cpp)
target_sources(ddp_integration_rank_tests PRIVATE test_powersgd.cpp)
add_dependencies(ddp_integration_rank_tests digits_ddp)
target_sources(ddp_integration_rank_tests PRIVATE test_device_mesh.cpp)
target_sources(ddp_integration_rank_tests PRIVATE test_file_store.cpp)
target_sources(ddp_mpi_tests PRIVATE test_subgroups_mpi.cpp)
# ProcessGroup's collectives against torch.distributed (tests/python/collectives_reference.py).
target_sources(ddp_integration_rank_tests PRIVATE test_collectives.cpp)
target_sources(ddp_mpi_tests PRIVATE test_collectives_mpi.cpp)
# What checkpoints and sharded snapshots may never do: delete what is not theirs, lose the last one, prune the good.
target_sources(ddp_fsdp_rank_tests PRIVATE test_checkpoint_safety.cpp)
# ddp's SIGUSR1 and terminate handlers only when asked for (ProcessGroupOptions, DDP_DIAGNOSTIC_HANDLERS),
# as ddprun asks for its workers.
target_sources(ddp_trace_tests PRIVATE test_diagnostic_handlers.cpp)
# DiLoCo, Streaming DiLoCo and post-local SGD (include/ddp/diloco.h) on 1 to 4 real ranks.
# examples/lm under ddprun: DDP and Streaming DiLoCo train and log a falling held-out loss.
add_executable(ddp_diloco_tests test_diloco.cpp test_lm_example.cpp)
target_link_libraries(ddp_diloco_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_diloco_tests)
add_dependencies(ddp_diloco_tests lm_train ddprun)
gtest_discover_tests(ddp_diloco_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# DDP's bucket sizes (issue 37 item 3): the caps' rules as pure functions, and
# on 2 real ranks the buckets fitted to the link after the first iteration.
add_executable(ddp_bucket_sizing_tests test_bucket_sizing.cpp)
target_link_libraries(ddp_bucket_sizing_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_bucket_sizing_tests)
gtest_discover_tests(ddp_bucket_sizing_tests PROPERTIES LABELS "unit;multiprocess" TIMEOUT 180
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Per-step fault tolerance (include/ddp/fault_tolerance.h): three ft_worker
# replicas over a TCPStore served by the test, killed, stopped and restarted.
add_executable(ft_worker workers/ft_worker.cpp workers/ft_vote_seams.cpp)
target_link_libraries(ft_worker PRIVATE ddp_internal)
ddp_reuse_precompiled_header(ft_worker)
add_executable(ddp_fault_tolerance_tests test_fault_tolerance.cpp)
target_link_libraries(ddp_fault_tolerance_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_fault_tolerance_tests)
add_dependencies(ddp_fault_tolerance_tests ft_worker wine_ddp)
gtest_discover_tests(ddp_fault_tolerance_tests PROPERTIES LABELS "multiprocess" TIMEOUT 120
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# ddprun --fault-tolerance (issue 36, the launcher's side): workers restarted alone, the store
# keeper ddp_ft_store, PET_FAULT_TOLERANCE, restart mode unchanged, a lost c10d node, and ddp's
# own fault-tolerant workers (ft_worker) healing under ddprun. The worker ft_store_worker opens
# DDP_FT_STORE through ddp's own open_ft_store.
add_executable(ft_store_worker workers/ft_store_worker.cpp)
target_link_libraries(ft_store_worker PRIVATE ddp_internal)
ddp_reuse_precompiled_header(ft_store_worker)
add_executable(test_ddprun_fault_tolerance test_ddprun_fault_tolerance.cpp)
target_link_libraries(test_ddprun_fault_tolerance PRIVATE ddp_test_support GTest::gtest_main)
add_dependencies(test_ddprun_fault_tolerance ddprun ddp_ft_store ft_store_worker ft_worker)
gtest_discover_tests(test_ddprun_fault_tolerance PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_TIMEOUT 30)

# The etcd v2 client and the c10d store over it against a real 3-member etcd cluster
# (support/etcd_cluster.h; each test skips without /usr/bin/etcd).
add_executable(test_etcd_store test_etcd_store.cpp)
target_link_libraries(test_etcd_store PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(test_etcd_store)
gtest_discover_tests(test_etcd_store PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_MODE PRE_TEST
                     DISCOVERY_TIMEOUT 60)

# ddprun --rdzv-backend etcd-v2 against a real 3-member etcd cluster: the round, a failure
# across nodes, an etcd member's death, and a fault-tolerant job losing node 0 and a member.
add_executable(test_etcd_rendezvous test_etcd_rendezvous.cpp)
target_link_libraries(test_etcd_rendezvous PRIVATE ddp_test_support GTest::gtest_main)
target_include_directories(test_etcd_rendezvous PRIVATE ${PROJECT_SOURCE_DIR}/src)
add_dependencies(test_etcd_rendezvous ddprun ft_store_worker ft_worker)
gtest_discover_tests(test_etcd_rendezvous PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_TIMEOUT 30)

# The shared-memory backend (src/comm/backend_shm.cpp) on real ranks: against
# Gloo, a killed or stopped peer, the automatic choice and its overrides.
add_executable(ddp_shm_tests test_shm.cpp)
target_link_libraries(ddp_shm_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_shm_tests)
gtest_discover_tests(ddp_shm_tests PROPERTIES LABELS "multiprocess;shm" TIMEOUT 240
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# The store-host loss across network-namespace nodes: etcd members and ddprun agents on three
# "nodes", the whole of node 0 lost (label cluster: needs root; skips without it or etcd).
add_executable(test_etcd_cluster_nodes test_etcd_cluster_nodes.cpp)
target_link_libraries(test_etcd_cluster_nodes PRIVATE ddp_test_support GTest::gtest_main)
target_include_directories(test_etcd_cluster_nodes PRIVATE ${PROJECT_SOURCE_DIR}/src)
add_dependencies(test_etcd_cluster_nodes ddprun ft_worker)
gtest_discover_tests(test_etcd_cluster_nodes PROPERTIES LABELS "cluster" TIMEOUT 300 RUN_SERIAL TRUE
                     DISCOVERY_TIMEOUT 30)

# bench/gpt_bench under ddprun --fault-tolerance (bench/churn_bench.py's job): a worker killed,
# the others train on, the restarted one heals from a live peer.
add_executable(test_gpt_bench_fault_tolerance test_gpt_bench_fault_tolerance.cpp)
target_link_libraries(test_gpt_bench_fault_tolerance PRIVATE ddp_test_support GTest::gtest_main)
add_dependencies(test_gpt_bench_fault_tolerance ddprun ddp_ft_store gpt_bench)
gtest_discover_tests(test_gpt_bench_fault_tolerance PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_TIMEOUT 30)

# Issue 36's goals at 4 namespace nodes x 1 rank on 1 Gbit/s links, under ddprun
# --fault-tolerance: a worker killed, stopped, cut off, and healed over its link, timed against
# the goals (label cluster: needs root; skips without it).
add_executable(ddp_ft_across_nodes_tests test_ft_across_nodes.cpp)
target_link_libraries(ddp_ft_across_nodes_tests PRIVATE ddp_test_support GTest::gtest_main)
target_include_directories(ddp_ft_across_nodes_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
add_dependencies(ddp_ft_across_nodes_tests ddprun ft_worker)
gtest_discover_tests(ddp_ft_across_nodes_tests PROPERTIES LABELS "cluster" TIMEOUT 300 RUN_SERIAL TRUE
                     DISCOVERY_TIMEOUT 30)

# When the shared-memory backend runs a collective (src/comm/backend_shm.cpp): asynchronous ones
# of any size on its own thread (overlap), asyncOp false on the caller's, queued ones by a waiter.
add_executable(ddp_shm_overlap_tests test_shm_overlap.cpp)
target_link_libraries(ddp_shm_overlap_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_shm_overlap_tests)
gtest_discover_tests(ddp_shm_overlap_tests PROPERTIES LABELS "multiprocess;shm" TIMEOUT 120
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Healing sharded across live members, the log's account of a lost member's in-flight samples,
# and Wine's held-out accuracy through 10 injected failures (issue 36). ft_heal_worker is one
# replica: an MLP of a chosen width, or Wine's model and split (wine_data).
add_executable(ft_heal_worker workers/ft_heal_worker.cpp)
target_link_libraries(ft_heal_worker PRIVATE wine_data ddp::ddp)
target_include_directories(ft_heal_worker PRIVATE ${PROJECT_SOURCE_DIR}/examples/wine)
ddp_reuse_precompiled_header(ft_heal_worker)
add_executable(ddp_ft_healing_tests test_ft_healing.cpp)
target_link_libraries(ddp_ft_healing_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_ft_healing_tests)
add_dependencies(ddp_ft_healing_tests ft_heal_worker)
gtest_discover_tests(ddp_ft_healing_tests PROPERTIES LABELS "multiprocess" TIMEOUT 150
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# ddprun --fault-tolerance over a long job's life (issue 36, helper A2): restarted workers leave
# no zombies or descriptors behind, and a worker that fails at start-up twice alike ends the job
# in one line. Shell-script workers; no torch in the jobs. And the etcd store's deleteKey after
# a lost answer, against a real etcd cluster (skips without /usr/bin/etcd).
add_executable(ddprun_ft_lifecycle_tests test_ddprun_ft_lifecycle.cpp test_etcd_store_delete.cpp)
target_link_libraries(ddprun_ft_lifecycle_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddprun_ft_lifecycle_tests)
add_dependencies(ddprun_ft_lifecycle_tests ddprun ddp_ft_store)
gtest_discover_tests(ddprun_ft_lifecycle_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# DiLoCo under FaultTolerance (issue 38 item 5 with issue 36, helper C3): a replica lost mid-run
# drops out of the average, a restarted one heals at a round's start; without faults the
# trajectory equals DiLoCo over a group. And the progress file ddprun's start-up rule reads.
add_executable(ft_diloco_worker workers/ft_diloco_worker.cpp)
target_link_libraries(ft_diloco_worker PRIVATE ddp_internal)
ddp_reuse_precompiled_header(ft_diloco_worker)
add_executable(ddp_ft_diloco_tests test_ft_diloco.cpp)
target_link_libraries(ddp_ft_diloco_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_ft_diloco_tests)
add_dependencies(ddp_ft_diloco_tests ft_diloco_worker)
gtest_discover_tests(ddp_ft_diloco_tests PROPERTIES LABELS "multiprocess" TIMEOUT 300
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Issue 37, defaults that fit the link (helper H3): DDP without a comm hook reduces
# hierarchically when its Gloo group spans hosts with several ranks on one; the choice
# (a pure function), 2 named hosts of 2 ranks (DDP_SHM_HOST_ID), and 2 network namespaces
# of 2 ranks under ddprun (root; skipped otherwise).
add_executable(ddp_hierarchical_default_tests test_hierarchical_default.cpp)
target_link_libraries(ddp_hierarchical_default_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_hierarchical_default_tests)
add_dependencies(ddp_hierarchical_default_tests ddprun ddp_worker)
gtest_discover_tests(ddp_hierarchical_default_tests PROPERTIES LABELS "multiprocess" TIMEOUT 300
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# FaultTolerance's vote (issue 36, the per-step cost): no store operation without a fault; a
# member whose vote's answer was lost learns the verdict from the store (ft_vote_seams.cpp).
add_executable(ddp_ft_vote_tests test_ft_vote.cpp)
target_link_libraries(ddp_ft_vote_tests PRIVATE ddp_test_support GTest::gtest_main)
add_dependencies(ddp_ft_vote_tests ddprun ddp_ft_store ft_worker)
gtest_discover_tests(ddp_ft_vote_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180 DISCOVERY_TIMEOUT 30)

# FaultTolerance keeps buffers in step (issue 36, helper B4): BatchNorm statistics equal on every
# member at every step boundary through a crash and a rejoin, drifting apart without the
# broadcast, and a stopped rank 0 costing the deadline, not a hang (ft_worker FT_BATCHNORM=1).
add_executable(ddp_ft_buffers_tests test_ft_buffers.cpp)
target_link_libraries(ddp_ft_buffers_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_ft_buffers_tests)
add_dependencies(ddp_ft_buffers_tests ft_worker)
gtest_discover_tests(ddp_ft_buffers_tests PROPERTIES LABELS "multiprocess" TIMEOUT 150
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# The liveness connection's reader (src/fault/socket_watch.h), against hostile bytes; torch-free,
# so `make sanitize` builds it under ASan and UBSan too.
add_executable(ddp_liveness_inbound_tests test_liveness_inbound.cpp)
target_link_libraries(ddp_liveness_inbound_tests PRIVATE ddp_internal GTest::gtest_main)
gtest_discover_tests(ddp_liveness_inbound_tests PROPERTIES LABELS "unit" TIMEOUT 60 DISCOVERY_TIMEOUT 30)

# FSDPOptions::replicate_hook (HSDP's across-replica stage through a CommHook): 4 real ranks,
# 2 replicas x 2 shards, against HSDP on the 2-D mesh; a failing hook, a failed shard reduction,
# a mesh that already replicates.
add_executable(ddp_fsdp_replicate_hook_tests test_fsdp_replicate_hook.cpp)
target_link_libraries(ddp_fsdp_replicate_hook_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_fsdp_replicate_hook_tests)
gtest_discover_tests(ddp_fsdp_replicate_hook_tests PROPERTIES LABELS "multiprocess" TIMEOUT 240
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# ddprun --ft-replica-size (fault-tolerant HSDP, helper R): replica groups of S consecutive local
# ranks share one DDP_FT_REPLICA_ID and fail and restart as one unit, for one restart; S = 1 is
# today's behaviour. Shell-script workers; no torch in the jobs.
add_executable(ddprun_ft_replica_groups_tests test_ddprun_ft_replica_groups.cpp)
target_link_libraries(ddprun_ft_replica_groups_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddprun_ft_replica_groups_tests)
add_dependencies(ddprun_ft_replica_groups_tests ddprun ddp_ft_store)
gtest_discover_tests(ddprun_ft_replica_groups_tests PROPERTIES LABELS "multiprocess" TIMEOUT 180
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Fault-tolerant HSDP (include/ddp/fault_tolerant_hsdp.h, issue 36): under ddprun
# --fault-tolerance --ft-replica-size 2, with the test binary as its own worker.
add_executable(ddp_ft_hsdp_tests test_ft_hsdp.cpp)
target_link_libraries(ddp_ft_hsdp_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_ft_hsdp_tests)
add_dependencies(ddp_ft_hsdp_tests ddprun ddp_ft_store)
# RUN_SERIAL: each test starts 4 workers and a store keeper at once, which two at a time
# on 2 cores made start-up alone take seconds.
gtest_discover_tests(ddp_ft_hsdp_tests PROPERTIES LABELS "multiprocess" TIMEOUT 150 RUN_SERIAL TRUE
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)

# Fault tolerance's fixed-size mode with spares (FaultToleranceOptions::fixed_size, issue 36).
add_executable(ddp_ft_spares_tests test_ft_spares.cpp)
target_link_libraries(ddp_ft_spares_tests PRIVATE ddp_internal ddp_test_support GTest::gtest_main)
ddp_reuse_precompiled_header(ddp_ft_spares_tests)
add_dependencies(ddp_ft_spares_tests ft_worker)
gtest_discover_tests(ddp_ft_spares_tests PROPERTIES LABELS "multiprocess" TIMEOUT 150
                     DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60)
