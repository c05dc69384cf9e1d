#pragma once

// Code shared by host (tests, reference) and device (kernels) is marked EPX_HD. Plain C++ compilers see
// ordinary inline functions, so every number format and buffer map is unit-tested on the CPU.
#if defined(__CUDACC__)
#define EPX_HD __host__ __device__ __forceinline__
#else
#define EPX_HD inline
#endif
