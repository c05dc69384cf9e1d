// A self-check of the NVSHMEM device interface: every rank sends one stamped block to its right neighbour.
#include <cuda_runtime.h>

#include <vector>

#include "common/cuda_check.hpp"
#include "core/wait_record.hpp"
#include "transport/nvshmem/nvshmem_device.cuh"
#include "transport/nvshmem/nvshmem_heap.hpp"

namespace epx::transport::nvshmem {

namespace {

constexpr int kRingWords = 1024;  // 4 KiB block
// Heap use: [0, 4 KiB) outgoing block, [4 KiB, 8 KiB) incoming block, then the signal.
constexpr size_t kSendOffset = 0;
constexpr size_t kRecvOffset = kRingWords * sizeof(uint32_t);
constexpr size_t kSignalOffset = 2 * kRecvOffset;

__device__ uint32_t ring_stamp(int rank, int word) {
  return static_cast<uint32_t>(rank) * 0x9E3779B1u + static_cast<uint32_t>(word);
}

__global__ void ring_kernel(char* base, int rank, int num_ranks, uint64_t round, device::WaitContext ctx,
                            int* num_wrong) {
  auto* send = reinterpret_cast<uint32_t*>(base + kSendOffset);
  auto* recv = reinterpret_cast<uint32_t*>(base + kRecvOffset);
  auto* signal = reinterpret_cast<uint64_t*>(base + kSignalOffset);
  for (int i = threadIdx.x; i < kRingWords; i += blockDim.x) send[i] = ring_stamp(rank, i);
  __syncthreads();
  const int right = (rank + 1) % num_ranks;
  const int left = (rank + num_ranks - 1) % num_ranks;
  if (threadIdx.x < 32) {
    put_block_warp(recv, send, kRingWords * sizeof(uint32_t), right);
    if (threadIdx.x == 0) {
      fence();
      signal_add(signal, 1, right);
      quiet();
    }
  }
  if (threadIdx.x == 0) wait_signal_at_least(signal, round, ctx, left, WaitPhase::kBarrier);
  __syncthreads();
  for (int i = threadIdx.x; i < kRingWords; i += blockDim.x)
    if (recv[i] != ring_stamp(left, i)) atomicAdd(num_wrong, 1);
}

}  // namespace

int nvshmem_ring_check(const NvshmemHeap& heap, unsigned long long timeout_ns) {
  EPX_CHECK(heap.bytes() >= kSignalOffset + sizeof(uint64_t), "heap.bytes()", heap.bytes(),
            "must be >= 8 KiB + 8 for the ring check");
  // The signal only grows, so each check waits for one more arrival than the last.
  uint64_t round = 0;
  EPX_CUDA_CHECK(cudaMemcpy(&round, static_cast<char*>(heap.base()) + kSignalOffset, sizeof(round),
                            cudaMemcpyDeviceToHost));
  heap.barrier();
  WaitTimeoutRecord* record = nullptr;
  int* num_wrong = nullptr;
  EPX_CUDA_CHECK(cudaMallocManaged(&record, sizeof(WaitTimeoutRecord)));
  EPX_CUDA_CHECK(cudaMallocManaged(&num_wrong, sizeof(int)));
  *record = WaitTimeoutRecord{};
  *num_wrong = 0;
  ring_kernel<<<1, 256>>>(static_cast<char*>(heap.base()), heap.rank(), heap.num_ranks(), round + 1,
                          device::WaitContext{record, heap.rank(), timeout_ns}, num_wrong);
  EPX_CUDA_CHECK_LAUNCH();
  const cudaError_t status = cudaDeviceSynchronize();
  const int result = *num_wrong;
  const WaitTimeoutRecord seen = *record;
  cudaFree(record);
  cudaFree(num_wrong);
  if (seen.flag == 1) EPX_FAIL("NVSHMEM ring check: ", describe_wait_timeout(seen));
  EPX_CUDA_CHECK(status);
  heap.barrier();
  return result;
}

}  // namespace epx::transport::nvshmem
