#include "transport/nvshmem/nvshmem_heap.hpp"

#include "transport/nvshmem/nvshmem_api.cuh"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "gpu/cuda_check.hpp"

namespace epx::transport::nvshmem {

namespace {

std::atomic<bool> heap_alive{false};

}  // namespace

NvshmemHeap::NvshmemHeap(Bootstrap& bootstrap, size_t bytes)
    : bytes_(bytes), rank_(bootstrap.rank()), num_ranks_(bootstrap.num_ranks()) {
  EPX_CHECK(bytes > 0, "bytes", bytes, "must be > 0");
  if (heap_alive.exchange(true))
    EPX_FAIL("NVSHMEM is already initialised in this process (one NvshmemHeap at a time)");
  try {
    // NVSHMEM reserves its heap at initialisation (1 GiB unless told): make room for this allocation unless
    // the user chose a size.
    const size_t heap_bytes =
        (bytes + (size_t(64) << 20) + (size_t(2) << 20) - 1) / (size_t(2) << 20) * (size_t(2) << 20);
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap_bytes).c_str(), /*overwrite=*/0);
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (rank_ == 0 && nvshmemx_get_uniqueid(&id) != 0) EPX_FAIL("nvshmemx_get_uniqueid failed on rank 0");
    // Everyone takes rank 0's id (gathered as bytes: the first sizeof(id) bytes are rank 0's).
    const std::vector<std::byte> ids = bootstrap.all_gather(&id, sizeof(id));
    std::memcpy(&id, ids.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank_, num_ranks_, &id, &attr) != 0)
      EPX_FAIL("nvshmemx_set_attr_uniqueid_args failed on rank ", rank_);
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
      EPX_FAIL("nvshmemx_init_attr failed on rank ", rank_);
    if (nvshmem_my_pe() != rank_ || nvshmem_n_pes() != num_ranks_) {
      EPX_FAIL("NVSHMEM numbered rank ", rank_, " of ", num_ranks_, " as PE ", nvshmem_my_pe(), " of ",
               nvshmem_n_pes());
    }
    base_ = nvshmem_malloc(bytes);
    if (base_ == nullptr) {
      nvshmem_finalize();
      EPX_FAIL("nvshmem_malloc(", bytes, ") failed on rank ", rank_, " (raise NVSHMEM_SYMMETRIC_SIZE?)");
    }
    EPX_CUDA_CHECK(cudaMemset(base_, 0, bytes));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    nvshmem_barrier_all();
  } catch (...) {
    heap_alive = false;
    throw;
  }
}

NvshmemHeap::~NvshmemHeap() {
  // Collective: nvshmem_free and nvshmem_finalize synchronise all PEs.
  cudaDeviceSynchronize();
  if (base_ != nullptr) nvshmem_free(base_);
  nvshmem_finalize();
  heap_alive = false;
}

void* NvshmemHeap::peer_pointer(int rank, size_t offset) const {
  EPX_CHECK(rank >= 0 && rank < num_ranks_, "rank", rank, "must be in [0, num_ranks)");
  EPX_CHECK(offset < bytes_, "offset", offset, "must be inside the heap allocation");
  return nvshmem_ptr(static_cast<char*>(base_) + offset, rank);
}

void NvshmemHeap::barrier() const {
  nvshmem_barrier_all();
}

}  // namespace epx::transport::nvshmem
