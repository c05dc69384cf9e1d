# CUDA part of EPX: the runtime (Buffer, transports) and the kernels, one library.
# Hopper: the kernels use sm_90 instructions (cp.async.bulk copies, mbarrier transaction counts,
# fence.proxy.async) and none of the 90a-only ones (wgmma, setmaxnreg); 90a is the target the measurements
# used. Set before enable_language(CUDA), which would otherwise take nvcc's default (sm_75 for CUDA 13).
if(NOT CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90a)
endif()
enable_language(CUDA)
# CMake 3.25 does not know nvcc 13's C++20 flag: tell it.
set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)

# NCCL: only the benchmark's baseline uses it. /usr/local/cuda on dev/CI machines, a pip wheel on GPU images.
include(cmake/find_python_wheel.cmake)
epx_python_wheel_dir(_epx_nccl_wheel nvidia.nccl)
find_path(EPX_NCCL_INCLUDE_DIR nccl.h HINTS ${_epx_nccl_wheel}/include ${CUDAToolkit_INCLUDE_DIRS})
find_library(EPX_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_epx_nccl_wheel}/lib ${CUDAToolkit_LIBRARY_DIR})

file(GLOB EPX_CUDA_SOURCES CONFIGURE_DEPENDS src/gpu/*.cpp src/runtime/*.cpp src/kernels/*.cu
     src/transport/cuda_ipc/*.cpp src/transport/shared_host/*.cpp)
add_library(epx_cuda STATIC ${EPX_CUDA_SOURCES})
target_include_directories(epx_cuda PUBLIC ${PROJECT_SOURCE_DIR}/include PRIVATE ${PROJECT_SOURCE_DIR}/src)
# No libcuda link: CI and dev machines have no driver; driver entry points come via cudaGetDriverEntryPoint.
target_link_libraries(epx_cuda PUBLIC epx_core CUDA::cudart)
target_compile_options(epx_cuda PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${EPX_WARNINGS}>
                       $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-Wall>)
target_compile_definitions(epx_cuda PUBLIC EPX_WITH_CUDA=1)

# NVSHMEM transport (optional): from NVSHMEM_HOME or the nvidia-nvshmem-cu13 wheel.
include(cmake/nvshmem.cmake)
