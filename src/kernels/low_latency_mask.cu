// The rank-mask calls of low-latency mode: set, clear, clean and query the Buffer's mask word.
#include "gpu/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/low_latency_kernels.hpp"
#include "kernels/preload.hpp"

namespace epx::kernels {

namespace {

__global__ void low_latency_mask_kernel(const LowLatencyMaskUpdateArgs args) {
  const unsigned long long bit = 1ull << args.rank;
  switch (args.op) {
    case LowLatencyMaskOp::kSet:
      if (threadIdx.x == 0) atomicOr(args.mask.masked, bit);
      break;
    case LowLatencyMaskOp::kClear:
      if (threadIdx.x == 0) {
        atomicAnd(args.mask.masked, ~bit);
        atomicAnd(args.mask.masked_by_timeout, ~bit);
      }
      break;
    case LowLatencyMaskOp::kCleanAll:
      if (threadIdx.x == 0) {
        atomicExch(args.mask.masked, 0ull);
        atomicExch(args.mask.masked_by_timeout, 0ull);
      }
      break;
    case LowLatencyMaskOp::kQuery: {
      const unsigned long long masked = __ldcg(args.mask.masked);
      for (int r = threadIdx.x; r < args.num_ranks; r += blockDim.x)
        args.mask_status[r] = static_cast<int>((masked >> r) & 1ull);
      break;
    }
  }
}

}  // namespace

void launch_low_latency_mask_update(const LowLatencyMaskUpdateArgs& args, cudaStream_t stream) {
  launch(low_latency_mask_kernel, {1, 64, 0, Residency::kIndependent}, stream, args);
}

void preload_low_latency_mask_kernels() {
  preload_kernel(low_latency_mask_kernel);
}

}  // namespace epx::kernels
