#pragma once

#include "common/tagged_word.hpp"
#include "device/ptx.cuh"
#include "kernels/normal_kernels.hpp"

namespace epx::kernels {

// Publishes `value` as host count `index` (HostCountIndex) when the host waits for the counts. Each word is
// written whole with the notify's sequence, so the host needs no flag written after them.
__device__ __forceinline__ void publish_host_count(const HostCounts& host, int index, int value) {
  if (host.words != nullptr)
    device::st_relaxed_sys_u64(host.words + index, pack_tagged(host.sequence, value));
}

// Called by every thread of the block once its host counts are written: pushes them out to the host now.
// NOTES: stores to host memory may otherwise wait in the GPU's caches until the stream goes idle, and with a
// receive launched behind the notify it does not: the host would not see the counts (measured: +100 us per
// dispatch). The fence is cumulative over the block's writes that bar.sync ordered before it.
__device__ __forceinline__ void flush_host_counts(const HostCounts& host) {
  if (host.words == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
}

}  // namespace epx::kernels
