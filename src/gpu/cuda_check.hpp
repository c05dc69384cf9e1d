#pragma once

#include <cuda_runtime.h>

#include "epx/error.hpp"

// Every CUDA runtime/driver call goes through these, so a failure becomes an epx::Error carrying the call,
// the library's own error name and string, and the source location. A failed call also leaves its error as
// the thread's "last error"; it is cleared before throwing (cudaGetLastError resets errors that are not
// sticky), so a caught failure does not resurface at the next launch check.
#define EPX_CUDA_CHECK(call)                                                            \
  do {                                                                                  \
    const cudaError_t epx_status_ = (call);                                             \
    if (epx_status_ != cudaSuccess) {                                                   \
      (void)cudaGetLastError();                                                         \
      EPX_FAIL("CUDA call `", #call, "` failed: ", cudaGetErrorName(epx_status_), ": ", \
               cudaGetErrorString(epx_status_));                                        \
    }                                                                                   \
  } while (0)
