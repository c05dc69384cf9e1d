#include "transport/cuda_ipc/ipc_memory.hpp"

#include <cstring>
#include <string>

#include "gpu/cuda_check.hpp"
#include "gpu/device_info.hpp"

namespace epx {

namespace {

// What each rank tells the others about its allocation.
struct IpcAnnouncement {
  cudaIpcMemHandle_t handle;
  size_t bytes;
  char pci_bus_id[32];
};

}  // namespace

IpcMemory::IpcMemory(Bootstrap& bootstrap, size_t bytes, const char* what, int ranks_per_node)
    : rank_(bootstrap.rank()), bytes_(bytes) {
  const int num_ranks = bootstrap.num_ranks();
  int device = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&device));

  IpcAnnouncement mine{};
  void* local_base = nullptr;
  if (bytes > 0) {
    EPX_CUDA_CHECK(cudaMalloc(&local_base, bytes));
    // Zero so control words (barrier signals, counters) start from a known state on every rank.
    EPX_CUDA_CHECK(cudaMemset(local_base, 0, bytes));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    EPX_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, local_base));
  }
  mine.bytes = bytes;
  EPX_CUDA_CHECK(cudaDeviceGetPCIBusId(mine.pci_bus_id, sizeof(mine.pci_bus_id), device));
  const auto all = all_gather_value(bootstrap, mine);

  bases_.assign(num_ranks, nullptr);
  bases_[rank_] = local_base;
  for (int peer = 0; peer < num_ranks; ++peer) {
    if (all[peer].bytes != bytes) {
      release();
      EPX_FAIL("mismatched ", what, " sizes: rank ", rank_, " has ", bytes, " bytes, rank ", peer, " has ",
               all[peer].bytes, " (every rank must pass the same size)");
    }
  }
  if (bytes == 0) return;
  const int node_size = ranks_per_node > 0 ? ranks_per_node : num_ranks;
  for (int peer = 0; peer < num_ranks; ++peer) {
    if (peer == rank_ || peer / node_size != rank_ / node_size) continue;
    if (!device_reaches(device, all[peer].pci_bus_id)) {
      release();
      EPX_FAIL("rank ", rank_, " (GPU ", mine.pci_bus_id, ") cannot reach rank ", peer, " (GPU ",
               all[peer].pci_bus_id, ") by NVLink/P2P: all ranks of a node must be peers");
    }
    const cudaError_t status =
        cudaIpcOpenMemHandle(&bases_[peer], all[peer].handle, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      cudaGetLastError();
      bases_[peer] = nullptr;
      release();
      EPX_FAIL("rank ", rank_, " cannot map rank ", peer, "'s ", what,
               " with CUDA IPC: ", cudaGetErrorString(status),
               " (are both GPUs on one node and P2P-capable?)");
    }
  }
}

IpcMemory::~IpcMemory() {
  release();
}

void IpcMemory::release() noexcept {
  for (size_t peer = 0; peer < bases_.size(); ++peer) {
    if (bases_[peer] == nullptr) continue;
    if (static_cast<int>(peer) == rank_) {
      cudaFree(bases_[peer]);
    } else {
      cudaIpcCloseMemHandle(bases_[peer]);
    }
    bases_[peer] = nullptr;
  }
  bases_.clear();
}

}  // namespace epx
