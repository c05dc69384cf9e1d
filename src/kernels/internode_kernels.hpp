#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "buffer_map/internode_buffer_map.hpp"
#include "kernels/normal_kernels.hpp"

// Launchers of normal mode across nodes (maps: InternodeBufferMap for the symmetric buffer,
// ForwardBufferMap for the NVLink buffer). The kernels need the NVSHMEM transport; without it the launchers
// throw.
namespace epx::kernels {

// Where a rank stands: its NVLink peers (PeerContext over the NVLink buffers; nullptr outside its node), its
// symmetric buffer (the same offsets are valid on every rank) and the node split.
struct InternodeContext {
  PeerContext peers;
  void* rdma_base;
  NodeMap nodes;
  // Rail peers the transport maps (load/store) are written directly; false sends to every other node through
  // the transport's puts, as over a NIC (EPX_INTERNODE_PUTS=1: the tests run that path on GPUs that map).
  bool map_rail_peers = true;
};

// Host-mapped counts of the internode notify: HostCounts at HostCountIndex (rows, rows per source, aligned
// rows per local expert, the invalid-id flag, and the records this rank forwards).
struct InternodeNotifyArgs {
  InternodeContext context;
  int num_channels;
  const uint8_t* is_token_in_rank;   // [T, R]
  const int* num_tokens_per_expert;  // [E] or nullptr
  int num_tokens;
  int num_experts;
  int expert_alignment;
  HandleArrays
      handle;  // is_token_in_rank (copy), recv_channel_offset, node_channel_offset, per-expert counts
  HostCounts host;
  const int* invalid_id;          // host-mapped flag of the layout kernel, republished with the counts
  ShapeFingerprint shape;         // what every rank must agree on; travels in every count message
  PhaseReport* phases = nullptr;  // EPX_NORMAL_PHASES=1: block 0's steps (kernels/phase_clock.cuh); else null
};
void launch_internode_notify(const InternodeNotifyArgs& args, cudaStream_t stream);

struct InternodeDispatchArgs {
  InternodeContext context;
  InternodeBufferMap rdma;
  ForwardBufferMap nvl;
  InternodeRecord record;
  int num_tokens;
  int num_experts;
  int rdma_chunk_tokens;  // records per put-with-signal
  int nvl_chunk_tokens;   // unused by dispatch's forwarders (they publish what they took), kept for symmetry
  const uint8_t* is_token_in_rank;  // [T, R]: the input's, or a cached handle's copy
  DispatchInput in;                 // the caller's (x, scales, top-k: what the kernel reads of it)
  HandleArrays handle;
  DispatchOutput out;
  ShapeFingerprint shape;         // the launch's: checked by every receiver before a source's first record
  PhaseReport* phases = nullptr;  // [kPhaseStreams] (EPX_NORMAL_PHASES=1), else null
};
void launch_internode_dispatch(const InternodeDispatchArgs& args, cudaStream_t stream);

struct InternodeCombineArgs {
  InternodeContext context;
  InternodeBufferMap rdma;
  ForwardBufferMap nvl;
  InternodeRecord record;  // combine records: BF16 row and the top-k weights (num_topk_weights: 0 = none)
  int num_tokens;
  int rdma_chunk_tokens;
  int nvl_chunk_tokens;
  HandleArrays handle;
  CombineInput in;  // the caller's (x, top-k weights, biases)
  CombineOutput out;
  ShapeFingerprint shape;         // the launch's: checked by every reducer before a source's first row
  PhaseReport* phases = nullptr;  // [kPhaseStreams] (EPX_NORMAL_PHASES=1), else null
};
void launch_internode_combine(const InternodeCombineArgs& args, cudaStream_t stream);

}  // namespace epx::kernels
