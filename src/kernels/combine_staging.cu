#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "gpu/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/preload.hpp"
#include "kernels/wait_context.cuh"

// The two small kernels around a staged combine's copy-engine copies (combine_staging_map.hpp).
namespace epx::kernels {

namespace {

// Thread r < R: waits until peer r (in the mask) finished every launch before this one, so nothing of its
// staging slot is still to be read; then thread 0 writes the launch's number for the flags.
__global__ void staging_gate_kernel(StagingGateArgs args) {
  const int calls = calls_before(args.peers);
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < args.peers.num_ranks && ((args.peers_mask >> peer) & 1u) != 0) {
    device::wait_at_least(&NormalBufferMap::control(args.peers.local_base)->done_signal[peer], calls,
                          wait_context(args.peers), peer, WaitPhase::kPreviousCall);
  }
  __syncthreads();
  if (threadIdx.x == 0) NormalBufferMap::control(args.peers.local_base)->staging_call = calls + 1;
}

// Thread i raises flag i: the copies before this launch in its stream are complete; the fence makes them
// visible to the peers' loads before the flag is.
__global__ void staging_flags_kernel(StagingFlagArgs args) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= args.count) return;
  const int value = *reinterpret_cast<const volatile int*>(args.staging_call);
  __threadfence_system();
  device::st_release_sys(reinterpret_cast<int*>(args.flags[i]), value);
}

}  // namespace

void launch_staging_gate(const StagingGateArgs& args, cudaStream_t stream) {
  launch(staging_gate_kernel, {1u, unsigned(kMaxNvlRanks), 0, Residency::kIndependent}, stream, args);
}

void launch_staging_flags(const StagingFlagArgs& args, cudaStream_t stream) {
  launch(staging_flags_kernel, {1u, unsigned(kMaxNvlRanks), 0, Residency::kIndependent}, stream, args);
}

void preload_combine_staging_kernels() {
  preload_kernel(staging_gate_kernel);
  preload_kernel(staging_flags_kernel);
}

}  // namespace epx::kernels
