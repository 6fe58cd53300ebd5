# Locates LibTorch from the pinned torch wheel and exposes it as the interface
# target ddp_torch (CPU: torch, torch_cpu, c10) and, where the CUDA toolkit is
# present, ddp_torch_cuda (torch_cuda, c10_cuda) for the NCCL backend.
#
# The wheel's TorchConfig.cmake is used when the CUDA toolkit is installed,
# since the CUDA wheel's config requires it. Without a toolkit we describe the
# libraries ourselves: the CPU ones always, so a machine without CUDA still
# builds ddp for CPU, and the CUDA ones too when the wheel is a CUDA build
# that ships its CUDA and NCCL headers (GPU machines without a toolkit).

#
# An installed ddp package presets DDP_TORCH_CMAKE_PREFIX to the torch it was
# built against; otherwise DDP_PYTHON (or python3) tells where torch is.

if(TARGET ddp_torch)
  return()
endif()

if(NOT DDP_TORCH_CMAKE_PREFIX)
  if(NOT DDP_PYTHON)
    find_program(DDP_PYTHON NAMES python3 REQUIRED)
  endif()
  execute_process(
    COMMAND ${DDP_PYTHON} -c "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
    OUTPUT_VARIABLE _ddp_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _ddp_torch_rc)
  if(NOT _ddp_torch_rc EQUAL 0)
    message(FATAL_ERROR "ddp: ${DDP_PYTHON} cannot import torch. Run 'make' (which runs scripts/setup.sh) or pass -DDDP_PYTHON=<venv>/bin/python.")
  endif()
  string(REPLACE "\n" ";" _ddp_torch_info "${_ddp_torch_info}")
  list(GET _ddp_torch_info 0 DDP_TORCH_CMAKE_PREFIX)
  list(GET _ddp_torch_info 1 DDP_TORCH_VERSION)
  message(STATUS "ddp: torch ${DDP_TORCH_VERSION} at ${DDP_TORCH_CMAKE_PREFIX}")
endif()
get_filename_component(DDP_TORCH_ROOT "${DDP_TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
# Decided afresh at each configure: the cached answer of an earlier one (say,
# before -DDDP_FORCE_CPU_TORCH=ON) must not enable NCCL without torch_cuda.
set(DDP_WITH_NCCL OFF)

find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND AND NOT DDP_FORCE_CPU_TORCH)
  list(APPEND CMAKE_PREFIX_PATH "${DDP_TORCH_CMAKE_PREFIX}")
  find_package(Torch REQUIRED)
  add_library(ddp_torch INTERFACE)
  target_link_libraries(ddp_torch INTERFACE torch_cpu c10)
  target_include_directories(ddp_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
  add_library(ddp_torch_cuda INTERFACE)
  target_link_libraries(ddp_torch_cuda INTERFACE torch c10_cuda)
  # NCCL's header comes from the CUDA toolkit or the nvidia-nccl wheel.
  find_path(DDP_NCCL_INCLUDE_DIR nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS}
          "${DDP_TORCH_ROOT}/../nvidia/nccl/include"
          "${DDP_TORCH_ROOT}/../nvidia/cu13/include")
  if(DDP_NCCL_INCLUDE_DIR)
    set(DDP_WITH_NCCL ON)
    message(STATUS "ddp: NCCL backend enabled (nccl.h in ${DDP_NCCL_INCLUDE_DIR})")
  endif()
else()
  foreach(_lib torch torch_cpu c10)
    add_library(ddp_imported_${_lib} SHARED IMPORTED)
    set_target_properties(ddp_imported_${_lib} PROPERTIES
      IMPORTED_LOCATION "${DDP_TORCH_ROOT}/lib/lib${_lib}.so")
  endforeach()
  add_library(ddp_torch INTERFACE)
  target_link_libraries(ddp_torch INTERFACE ddp_imported_torch_cpu ddp_imported_c10)
  target_include_directories(ddp_torch SYSTEM INTERFACE
    "${DDP_TORCH_ROOT}/include" "${DDP_TORCH_ROOT}/include/torch/csrc/api/include")

  # GPU machines often have the driver and pip's CUDA torch but no toolkit.
  # The CUDA wheel brings the CUDA and NCCL headers (nvidia/*/include) and
  # libraries; they are enough for the NCCL backend, and linking torch_cuda
  # is what registers CUDA with torch at run time.
  if(EXISTS "${DDP_TORCH_ROOT}/lib/libtorch_cuda.so" AND NOT DDP_FORCE_CPU_TORCH)
    get_filename_component(_ddp_nvidia "${DDP_TORCH_ROOT}/../nvidia" ABSOLUTE)
    file(GLOB _ddp_wheel_includes LIST_DIRECTORIES true "${_ddp_nvidia}/*/include")
    file(GLOB _ddp_wheel_libs LIST_DIRECTORIES true "${_ddp_nvidia}/*/lib")
    find_path(DDP_CUDA_WHEEL_INCLUDE_DIR cuda_runtime_api.h HINTS ${_ddp_wheel_includes} NO_DEFAULT_PATH)
    find_path(DDP_NCCL_INCLUDE_DIR nccl.h HINTS ${_ddp_wheel_includes} NO_DEFAULT_PATH)
    if(DDP_CUDA_WHEEL_INCLUDE_DIR AND DDP_NCCL_INCLUDE_DIR)
      foreach(_lib torch_cuda c10_cuda)
        add_library(ddp_imported_${_lib} SHARED IMPORTED)
        set_target_properties(ddp_imported_${_lib} PROPERTIES
          IMPORTED_LOCATION "${DDP_TORCH_ROOT}/lib/lib${_lib}.so")
      endforeach()
      # Named as TorchConfig names it: CMakeLists.txt reads its definitions.
      add_library(torch_cuda INTERFACE IMPORTED)
      set_target_properties(torch_cuda PROPERTIES INTERFACE_COMPILE_DEFINITIONS "USE_C10D_NCCL")
      add_library(ddp_torch_cuda INTERFACE)
      target_link_libraries(ddp_torch_cuda INTERFACE ddp_imported_torch_cuda ddp_imported_c10_cuda)
      target_include_directories(ddp_torch_cuda SYSTEM INTERFACE "${DDP_CUDA_WHEEL_INCLUDE_DIR}")
      # libtorch_cuda finds the wheel's CUDA libraries through its RUNPATH at
      # run time; the linker needs to be told where they are.
      foreach(_dir ${_ddp_wheel_libs})
        target_link_options(ddp_torch_cuda INTERFACE "LINKER:-rpath-link,${_dir}")
      endforeach()
      set(DDP_WITH_NCCL ON)
      message(STATUS "ddp: no CUDA toolkit, but torch's CUDA wheel: NCCL backend enabled "
                     "(CUDA headers in ${DDP_CUDA_WHEEL_INCLUDE_DIR}, nccl.h in ${DDP_NCCL_INCLUDE_DIR})")
    endif()
  endif()
  if(NOT DDP_WITH_NCCL)
    message(STATUS "ddp: no CUDA toolkit; building the CPU path only (gloo)")
  endif()
endif()
set(DDP_WITH_NCCL ${DDP_WITH_NCCL} CACHE INTERNAL "")
