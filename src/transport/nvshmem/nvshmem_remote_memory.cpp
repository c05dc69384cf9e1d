// Low-latency memory on the NVSHMEM symmetric heap for groups spanning several NVLink nodes.
#include <memory>

#include "epx/error.hpp"
#include "runtime/remote_memory.hpp"
#include "transport/nvshmem/internode_nvshmem.hpp"
#include "transport/nvshmem/low_latency_nvshmem.hpp"
#include "transport/nvshmem/nvshmem_heap.hpp"

namespace epx {

RemoteMemory allocate_remote_memory(Bootstrap& bootstrap, size_t bytes, int ranks_per_node) {
  EPX_CHECK(ranks_per_node >= 1, "ranks_per_node", ranks_per_node, "must be >= 1");
  auto heap = std::make_shared<transport::nvshmem::NvshmemHeap>(bootstrap, bytes);
  transport::nvshmem::preload_low_latency_remote_kernels();
  transport::nvshmem::preload_internode_kernels();
  RemoteMemory memory;
  memory.local = heap->base();
  memory.bytes = heap->bytes();
  const int node = bootstrap.rank() / ranks_per_node;
  for (int rank = 0; rank < bootstrap.num_ranks(); ++rank) {
    void* const reachable = heap->peer_pointer(rank, 0);
    memory.reachable.push_back(reachable);
    void* mapped = nullptr;
    if (rank / ranks_per_node == node) {
      mapped = reachable;
      if (mapped == nullptr) {
        EPX_FAIL(
            "rank ", bootstrap.rank(), " can not map rank ", rank,
            " of its node through NVSHMEM (nvshmem_ptr is null): the ranks of a node must be NVLink peers");
      }
    }
    memory.bases.push_back(mapped);
  }
  memory.owner = std::move(heap);
  return memory;
}

}  // namespace epx
