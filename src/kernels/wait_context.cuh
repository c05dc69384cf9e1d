#pragma once

#include "device/wait.cuh"
#include "kernels/peer_context.hpp"

namespace epx::kernels {

// The WaitContext of every wait of a kernel of this group: where it reports, its bound, the abort words.
__device__ __forceinline__ device::WaitContext wait_context(const PeerContext& peers) {
  return {peers.failure_record, peers.rank, peers.timeout_ns, peers.abort};
}

}  // namespace epx::kernels
