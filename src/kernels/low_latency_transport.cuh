#pragma once

#include <cstddef>
#include <cstdint>

#include "device/ptx.cuh"
#include "kernels/normal_kernels.hpp"

// How the low-latency kernels reach another rank. A rank whose buffer this GPU maps (PeerContext::peer_bases
// entry set: an NVLink peer of the same node, or a rank of another node that the transport maps, over an
// NVLink fabric or P2P) takes plain stores into its memory. Any other rank goes through `Remote`, a transport
// policy:
//   kEnabled                        false compiles the remote branches out (the NVLink-only kernels)
//   put_warp(dst, src, bytes, rank) warp-collective, non-blocking put of [src, src + bytes) of this rank's
//                                   buffer to symmetric address `dst` (this rank's address of the place)
//   put_int(dst, value, rank)       one int, from one thread
//   put_u64(dst, value, rank)       one 8-byte word, whole, from one thread
//   quiet()                         every put this thread issued is complete (sources reusable, data at the
//                                   target)
// The NVSHMEM policy lives in transport/nvshmem, which builds these kernels a second time with it.
namespace epx::kernels::low_latency {

struct NoRemote {
  static constexpr bool kEnabled = false;
  __device__ static void put_warp(void*, const void*, size_t, int) {}
  __device__ static void put_int(int*, int, int) {}
  __device__ static void put_u64(uint64_t*, uint64_t, int) {}
  __device__ static void quiet() {}
};

template <typename Remote>
__device__ __forceinline__ bool is_direct(const PeerContext& peers, int rank) {
  return !Remote::kEnabled || peers.peer_bases[rank] != nullptr;
}

// Whether `rank` is of this rank's NVLink node: its abort words are mapped here, which the node's ranks'
// are, exactly. A mapped rank of another node takes stores like the node's ranks, but what travels to it
// (LogFMT codes) and where its shape fingerprint lands are those of another node.
__device__ __forceinline__ bool same_node(const PeerContext& peers, int rank) {
  return peers.abort.peers[rank] != nullptr;
}

// `value` into `rank`'s int at `offset` with release semantics: after every store and completed put this
// thread ordered before it.
template <typename Remote>
__device__ __forceinline__ void signal_rank(const PeerContext& peers, int rank, size_t offset, int value) {
  if (is_direct<Remote>(peers, rank)) {
    device::st_release_sys(reinterpret_cast<int*>(static_cast<char*>(peers.peer_bases[rank]) + offset),
                           value);
  } else {
    Remote::put_int(reinterpret_cast<int*>(static_cast<char*>(peers.local_base) + offset), value, rank);
    Remote::quiet();
  }
}

}  // namespace epx::kernels::low_latency
