#pragma once

// Normal mode across nodes: the NVSHMEM builds of its kernels (kernels/internode_*.cuh). Included by
// low_latency_nvshmem.cu: every NVSHMEM kernel lives in one translation unit, since nvlink refuses two
// translation units' views of NVSHMEM's device state ("Size doesn't match for nvshmemi_device_state_d").
#include "kernels/internode_combine.cuh"
#include "kernels/internode_dispatch.cuh"
#include "kernels/internode_notify.cuh"
#include "kernels/preload.hpp"
#include "transport/nvshmem/internode_nvshmem.hpp"
#include "transport/nvshmem/nvshmem_api.cuh"

namespace epx::kernels {

namespace {

struct NvshmemInternode {
  __device__ static void put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* signal,
                                         uint64_t add, int rank) {
    nvshmem_fence();  // after the earlier puts of this thread to `rank`: tails count records in order
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, add, NVSHMEM_SIGNAL_ADD, rank);
  }
  // nvshmem_ptr: non-null exactly for the PEs NVSHMEM reaches by load/store (its P2P transport: NVLink or
  // PCIe peers); it maps the peer's whole heap at one offset, so the pointer of one symmetric address
  // serves the whole allocation.
  __device__ static void* peer_pointer(void* symmetric, int rank) { return nvshmem_ptr(symmetric, rank); }
  __device__ static void signal_add(uint64_t* signal, uint64_t add, int rank) {
    nvshmemx_signal_op(signal, add, NVSHMEM_SIGNAL_ADD, rank);
  }
  __device__ static void quiet() { nvshmem_quiet(); }
};

}  // namespace

void launch_internode_notify(const InternodeNotifyArgs& args, cudaStream_t stream) {
  internode::launch_notify_with<NvshmemInternode>(args, stream);
}

void launch_internode_dispatch(const InternodeDispatchArgs& args, cudaStream_t stream) {
  internode::launch_dispatch_with<NvshmemInternode>(args, stream);
}

void launch_internode_combine(const InternodeCombineArgs& args, cudaStream_t stream) {
  internode::launch_combine_with<NvshmemInternode>(args, stream);
}

}  // namespace epx::kernels

namespace epx::transport::nvshmem {

void preload_internode_kernels() {
  kernels::preload_kernel(kernels::internode::notify_kernel<kernels::NvshmemInternode>);
  using kernels::internode::kBf16DispatchThreads, kernels::internode::kFp8DispatchThreads;
  kernels::preload_kernel(
      kernels::internode::dispatch_kernel<kernels::NvshmemInternode, kBf16DispatchThreads>);
  kernels::preload_kernel(
      kernels::internode::dispatch_kernel<kernels::NvshmemInternode, kFp8DispatchThreads>);
  kernels::preload_kernel(kernels::internode::combine_kernel<kernels::NvshmemInternode>);
}

}  // namespace epx::transport::nvshmem
