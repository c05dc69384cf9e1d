#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "buffer_map/low_latency_buffer_map.hpp"
#include "core/shape_fingerprint.hpp"
#include "epx/low_latency.hpp"
#include "kernels/peer_context.hpp"

// Launchers of the low-latency (decode) kernels; each takes one Args struct of plain pointers.
// Every launch is capturable in a CUDA graph: no allocation, no host synchronisation.
namespace epx::kernels {

// Rank masks: two words of device memory per Buffer that every low-latency kernel reads when it runs (one
// load per block at its start), so a mask changed between CUDA graph replays takes effect at the next replay.
// Bit r of `masked` set: rank r's traffic is skipped (nothing is sent to it, no signal of it is awaited, its
// receive counts are 0 and combine leaves its experts out like -1 entries).
struct LowLatencyMaskArgs {
  unsigned long long* masked = nullptr;
  unsigned long long* masked_by_timeout = nullptr;  // bit r: a wait of this rank timed out on r and masked it
  bool shrink = false;  // enable_shrink: a wait that times out on a peer masks it instead of aborting
};

// Which phases one launch runs. Send-only followed later by receive-only is the receive hook: between the
// two, no SM is held while the data is in flight.
enum LowLatencyPhase : int { kLowLatencySend = 1, kLowLatencyRecv = 2, kLowLatencyBoth = 3 };

// Phase boundaries the low-latency kernels stamp when `phase_stamps` is set (EPX_LL_PHASE_STAMPS=1, for
// epx-bench's breakdown): thread 0 of block b writes the global timer (ns) at
// phase_stamps[b * kNumPhaseStamps + stamp]. Dispatch: entry, prologue (abort check, mask), histogram and
// counts stored (the routing block's first pass and its scan), counted (the routing block's counts and lists
// written), ids (a sending block's first token's destinations found), sent
// (tokens and routing written), published (flags released), arrived (every source's flag seen), scanned
// (counts scanned), delivered (rows copied out), exit. Combine: the same, with "counted" when the send's pair
// counts are scanned, "ids" when the receive read its token's top-k ids and weights, "delivered" after the
// reduction and "scanned" unused.
enum LowLatencyStamp : int {
  kStampEntry,
  kStampPrologue,
  kStampHistogram,
  kStampCountsStored,
  kStampCounted,
  kStampIds,
  kStampSent,
  kStampPublished,
  kStampArrived,
  kStampScanned,
  kStampDelivered,
  kStampExit,
  kNumPhaseStamps
};
constexpr int kMaxPhaseStampBlocks = 1024;

struct LowLatencyDispatchArgs {
  PeerContext peers;  // low-latency buffer bases of every rank (nullptr: not mapped here, reached by puts)
  LowLatencyBufferMap map;
  int half;        // which half of the double buffer this call uses
  int phases;      // LowLatencyPhase bits
  int num_blocks;  // one block per SM: every block must be resident (receivers spin on senders)

  LowLatencyDispatchInput in;    // the caller's: the send phase's tokens, the statistics
  LowLatencyDispatchOutput out;  // the receive phase's outputs (caller memory)
  RowFormat format;              // the scale format of in's flags, resolved by the host once per call
  SmallDivisor topk;             // in.num_topk: a top-k entry's token and position without a division
  ShapeFingerprint shape;        // posted with the receive flags, compared by every receiver
  LowLatencyMaskArgs mask;
  uint64_t* phase_stamps;  // [num_blocks][kNumPhaseStamps] or nullptr (LowLatencyStamp)
};
void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, cudaStream_t stream);
// Dynamic shared memory the dispatch kernel needs (the routing histogram grows with E); the host checks it
// against the device limit before launching.
size_t low_latency_dispatch_smem_bytes(const LowLatencyBufferMap& map);

struct LowLatencyCombineArgs {
  PeerContext peers;
  LowLatencyBufferMap map;
  int half;
  int phases;
  int num_blocks;

  // The caller's; `in.x` is the expert outputs in the dispatch output order: the caller's, or (zero copy) the
  // map's combine_send rows.
  LowLatencyCombineInput in;
  LowLatencyHandle handle;  // the dispatch's: which tokens the rows belong to
  void* out;                // [T, H] BF16
  ShapeFingerprint shape;   // posted with the receive flags, compared by every receiver
  LowLatencyMaskArgs mask;
  uint64_t* phase_stamps;  // [num_blocks][kNumPhaseStamps] or nullptr (LowLatencyStamp)
};
void launch_low_latency_combine(const LowLatencyCombineArgs& args, cudaStream_t stream);

// Resets this rank's signals in both halves, then meets every rank at a barrier, so no peer sends into the
// buffer before every rank has reset (collective).
// The barrier leaves masked ranks out (with enable_shrink, a rank it times out on is masked).
struct LowLatencyCleanArgs {
  PeerContext peers;
  LowLatencyBufferMap map;
  LowLatencyMaskArgs mask;
};
void launch_low_latency_clean(const LowLatencyCleanArgs& args, cudaStream_t stream);

// The mask calls (low_latency_update_mask_buffer, ..._query_..., ..._clean_...): one small kernel, stream
// ordered with the low-latency calls. Atomic on the mask word, since a running kernel with enable_shrink may
// set bits of it.
enum class LowLatencyMaskOp : int { kSet, kClear, kCleanAll, kQuery };
struct LowLatencyMaskUpdateArgs {
  LowLatencyMaskArgs mask;
  LowLatencyMaskOp op;
  int rank;          // kSet / kClear: the rank whose bit changes
  int num_ranks;     // kQuery: entries of mask_status
  int* mask_status;  // kQuery: int32 [num_ranks] (device), 1 = masked
};
void launch_low_latency_mask_update(const LowLatencyMaskUpdateArgs& args, cudaStream_t stream);

// The same three kernels for groups with ranks outside this rank's NVLink node (other nodes, or virtual
// nodes): those ranks are reached through the NVSHMEM transport (transport/nvshmem), whose heap must hold
// the buffer. Where EPX was built without NVSHMEM they throw epx::Error.
void launch_low_latency_dispatch_remote(const LowLatencyDispatchArgs& args, cudaStream_t stream);
void launch_low_latency_combine_remote(const LowLatencyCombineArgs& args, cudaStream_t stream);
void launch_low_latency_clean_remote(const LowLatencyCleanArgs& args, cudaStream_t stream);

}  // namespace epx::kernels
