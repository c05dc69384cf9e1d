# Finds NVSHMEM (headers, libnvshmem_device.a, libnvshmem_host.so.3) and builds the NVSHMEM transport when
# EPX_WITH_NVSHMEM is ON, or AUTO and found. The transport lives in its own library because NVSHMEM device
# code needs relocatable device code and a device link step; the rest of EPX does not pay for that.
epx_python_wheel_dir(_epx_nvshmem_wheel nvidia.nvshmem)
set(_epx_nvshmem_hints $ENV{NVSHMEM_HOME} ${_epx_nvshmem_wheel})
find_path(EPX_NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_epx_nvshmem_hints} PATH_SUFFIXES include)
find_library(EPX_NVSHMEM_DEVICE_LIBRARY NAMES libnvshmem_device.a HINTS ${_epx_nvshmem_hints} PATH_SUFFIXES lib)
find_library(EPX_NVSHMEM_HOST_LIBRARY NAMES nvshmem_host libnvshmem_host.so.3 HINTS ${_epx_nvshmem_hints}
             PATH_SUFFIXES lib)
set(_epx_nvshmem_found OFF)
if(EPX_NVSHMEM_INCLUDE_DIR AND EPX_NVSHMEM_DEVICE_LIBRARY AND EPX_NVSHMEM_HOST_LIBRARY)
  set(_epx_nvshmem_found ON)
endif()
if(EPX_WITH_NVSHMEM STREQUAL "ON" AND NOT _epx_nvshmem_found)
  message(FATAL_ERROR "EPX_WITH_NVSHMEM=ON but NVSHMEM was not found (set NVSHMEM_HOME or pip install "
                      "nvidia-nvshmem-cu13==3.4.5)")
endif()
set(EPX_HAVE_NVSHMEM OFF)
if(_epx_nvshmem_found AND NOT EPX_WITH_NVSHMEM STREQUAL "OFF")
  set(EPX_HAVE_NVSHMEM ON)
endif()
message(STATUS "EPX NVSHMEM transport: ${EPX_HAVE_NVSHMEM} (${EPX_NVSHMEM_INCLUDE_DIR})")

if(EPX_HAVE_NVSHMEM)
  file(GLOB EPX_NVSHMEM_SOURCES CONFIGURE_DEPENDS src/transport/nvshmem/*.cpp src/transport/nvshmem/*.cu)
  if(EPX_NVSHMEM_SOURCES)
    add_library(epx_nvshmem STATIC ${EPX_NVSHMEM_SOURCES})
    set_target_properties(epx_nvshmem PROPERTIES CUDA_SEPARABLE_COMPILATION ON CUDA_RESOLVE_DEVICE_SYMBOLS ON)
    target_include_directories(epx_nvshmem PUBLIC ${PROJECT_SOURCE_DIR}/include PRIVATE ${PROJECT_SOURCE_DIR}/src)
    # SYSTEM: NVSHMEM's own headers are not warning-clean under our flags.
    target_include_directories(epx_nvshmem SYSTEM PUBLIC ${EPX_NVSHMEM_INCLUDE_DIR})
    # epx_core only: epx_cuda links this library (no cycle, so a clean parallel build orders them).
    target_link_libraries(epx_nvshmem PUBLIC epx_core CUDA::cudart ${EPX_NVSHMEM_HOST_LIBRARY} ${EPX_NVSHMEM_DEVICE_LIBRARY})
    target_compile_definitions(epx_nvshmem PUBLIC EPX_HAVE_NVSHMEM=1)
    target_compile_options(epx_nvshmem PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
    # The runtime reaches the transport through runtime/remote_memory.hpp and the *_remote launchers.
    target_link_libraries(epx_cuda PUBLIC epx_nvshmem)
  endif()
endif()
if(NOT TARGET epx_nvshmem)
  # The same entry points, refusing with a clear error.
  target_sources(epx_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src/transport/none/remote_none.cpp)
endif()
