// The low-latency kernels for groups spanning several NVLink nodes: ranks outside this rank's node are
// reached with NVSHMEM puts from this rank's staging areas (the same kernel sources as the NVLink-only
// build).
#include "kernels/low_latency_clean.cuh"
#include "kernels/low_latency_combine.cuh"
#include "kernels/low_latency_dispatch.cuh"
#include "transport/nvshmem/low_latency_nvshmem.hpp"
#include "transport/nvshmem/nvshmem_device.cuh"

namespace epx::kernels {

namespace {

struct NvshmemRemote {
  static constexpr bool kEnabled = true;
  __device__ static void put_warp(void* dst, const void* src, size_t bytes, int rank) {
    transport::nvshmem::put_block_warp(dst, src, bytes, rank);
  }
  __device__ static void put_int(int* dst, int value, int rank) {
    transport::nvshmem::put_int(dst, value, rank);
  }
  __device__ static void put_u64(uint64_t* dst, uint64_t value, int rank) {
    transport::nvshmem::put_u64(dst, value, rank);
  }
  __device__ static void quiet() { transport::nvshmem::quiet(); }
};

}  // namespace

void launch_low_latency_dispatch_remote(const LowLatencyDispatchArgs& args, cudaStream_t stream) {
  launch_low_latency_dispatch_with<NvshmemRemote>(args, stream);
}

void launch_low_latency_combine_remote(const LowLatencyCombineArgs& args, cudaStream_t stream) {
  launch_low_latency_combine_with<NvshmemRemote>(args, stream);
}

void launch_low_latency_clean_remote(const LowLatencyCleanArgs& args, cudaStream_t stream) {
  launch_low_latency_clean_with<NvshmemRemote>(args, stream);
}

}  // namespace epx::kernels

namespace epx::transport::nvshmem {

void preload_low_latency_remote_kernels() {
  kernels::preload_low_latency_dispatch_with<kernels::NvshmemRemote>();
  kernels::preload_low_latency_combine_with<kernels::NvshmemRemote>();
  kernels::preload_low_latency_clean_with<kernels::NvshmemRemote>();
}

}  // namespace epx::transport::nvshmem

#include "transport/nvshmem/internode_nvshmem.cuh"
