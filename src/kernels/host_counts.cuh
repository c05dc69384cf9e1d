#pragma once

#include "device/ptx.cuh"
#include "epx/common/tagged_word.hpp"
#include "kernels/normal_kernels.hpp"

namespace epx::kernels {

// Publishes `value` as host count `index` (HostCountIndex) when the host waits for the counts. Each word is
// written whole with the notify's sequence, so the host needs no flag written after them (and the kernel
// no system fence before one).
__device__ __forceinline__ void publish_host_count(const HostCounts& host, int index, int value) {
  if (host.words != nullptr) device::st_relaxed_sys_u64(host.words + index, pack_tagged(host.sequence, value));
}

}  // namespace epx::kernels
