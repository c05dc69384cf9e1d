#include "gpu/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/notify_steps.cuh"
#include "kernels/preload.hpp"

namespace epx::kernels {

namespace {

constexpr int kNotifyThreads = 1024;

// Block 0 exchanges, blocks 1..C count their channel; with the per-rank totals block 1 then scans the
// offsets, off the host's path.
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs args) {
  if (blockIdx.x == 0) {
    exchange_counts<kNotifyThreads>(args);
  } else {
    count_channel<kNotifyThreads>(args, blockIdx.x - 1);
    if (blockIdx.x == 1 && args.num_tokens_per_rank != nullptr) scan_and_check_totals<kNotifyThreads>(args);
  }
}

}  // namespace

void launch_dispatch_notify(const NotifyArgs& args, cudaStream_t stream) {
  launch(notify_kernel, {unsigned(1 + args.num_channels), kNotifyThreads, 0, Residency::kCoResident}, stream,
         args);
}

void preload_normal_notify_kernels() {
  preload_kernel(notify_kernel);
}

}  // namespace epx::kernels
