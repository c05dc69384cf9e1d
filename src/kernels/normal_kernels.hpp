#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "buffer_map/combine_staging_map.hpp"
#include "buffer_map/layout_board_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "common/host_device.hpp"
#include "core/shape_fingerprint.hpp"
#include "epx/normal.hpp"
#include "kernels/peer_context.hpp"

// Launchers of the normal-mode kernels; each takes one Args struct of plain pointers.
namespace epx::kernels {

// Threads of every block of the within-node dispatch and combine (kernels/normal_queue.cuh); the host
// resolves the combine's warp roles (combine_warp_roles.hpp) from them.
constexpr int kQueueThreads = 512;
constexpr int kQueueWarps = kQueueThreads / 32;

// Device-side handle arrays (allocated by the host, filled by the kernels).
struct HandleArrays {
  uint8_t* is_token_in_rank;  // [T, R] copy, for cached dispatch
  int* send_head;             // [T, R]: entry of token t in its channel's stream to rank r, -1 if not sent
  int* recv_channel_offset;   // [R * C + 1]: first received row of (source, channel), source-major
  int* recv_src_idx;          // [rows]
  int* num_recv_tokens_per_expert;  // [L] rounded to expert_alignment
  // Across nodes only (send_head then holds [T, N]: entry of token t in its channel's stream to node n):
  int* node_channel_offset = nullptr;  // [N * C + 1]: first record from the rail peer of (node, channel)
  uint8_t* forward_mask = nullptr;     // [records]: the local ranks each record from a rail peer went to
  // One node: [R*R + 2*R*C], DeepEP's matrices derived from recv_channel_offset
  // (DispatchHandle::deep_ep_matrices_device); nullptr: not written.
  int* deep_ep_matrices = nullptr;
};

struct LayoutArgs {
  const int64_t* topk_idx;
  int num_tokens, num_topk, num_experts, num_ranks;
  int* num_tokens_per_rank;
  int* num_tokens_per_expert;
  bool* is_token_in_rank;
  int* invalid_id_flag;  // host-mapped: set to 1 + the first bad id's token index when an id is out of range
  int ranks_per_node;    // nodes are blocks of this many consecutive ranks
  int* num_tokens_per_rdma_rank;  // [num_ranks / ranks_per_node] tokens per node (once per node), or nullptr
  // Device memory of layout_scratch_bytes(num_ranks), zero between launches: word 0 counts the blocks that
  // finished, then the rank, expert and node counts the blocks add up. The last block to finish moves them
  // into the outputs and zeroes them: the outputs need no clearing before the launch (no memset calls).
  int* scratch = nullptr;
  // One node: the last block posts the counts into every rank's row of the layout board under
  // `board_sequence` (the notify this layout feeds). `board` nullptr: nothing is posted.
  uint64_t* board = nullptr;
  LayoutBoardMap board_map{1};
  uint32_t board_sequence = 0;
  int rank = 0;
};
// LayoutArgs::scratch's size: the block count, then a count per rank, per expert (up to kMaxExperts) and per
// node (up to one per rank).
constexpr size_t layout_scratch_bytes(int num_ranks) {
  return sizeof(int) * (1 + 2 * static_cast<size_t>(num_ranks) + kMaxExperts);
}
void launch_layout(const LayoutArgs& args, cudaStream_t stream);

// Host-mapped counts notify publishes as tagged words (pack_tagged with `sequence`): [0] rows, [1 + r] rows
// from source r, [1 + R + le] aligned rows of local expert le, then what the path adds (HostCountIndex).
// The host waits until every word it reads carries the sequence: no flag orders them (the kernel's closing
// fence only pushes them out of the GPU's caches sooner).
struct HostCounts {
  uint64_t* words;  // nullptr: nobody waits (worst-case mode)
  uint32_t sequence;
};
struct HostCountIndex {
  int num_ranks, num_local_experts;
  EPX_HD int rows() const { return 0; }
  EPX_HD int rows_from(int src) const { return 1 + src; }
  EPX_HD int expert(int le) const { return 1 + num_ranks + le; }
  EPX_HD int invalid_id() const { return 1 + num_ranks + num_local_experts; }       // 1 + token, or 0
  EPX_HD int forward_records() const { return 2 + num_ranks + num_local_experts; }  // across nodes
  // Words a notify publishes: up to the invalid-id flag, or up to the forwarded records across nodes.
  EPX_HD int num_words(bool across_nodes) const {
    return (across_nodes ? forward_records() : invalid_id()) + 1;
  }
};

// The outputs of a receive launched before the host knew the row count (dispatch_notify with
// DispatchOverlap::kLaunchReceive): the host writes the pointers into host-mapped memory once it allocated
// them, then `sequence` (x86 stores become visible in order); the kernel's blocks that write rows wait
// for it. `cancelled`: the host gave up (e.g. rejected outputs): rows are consumed but written nowhere.
struct PublishedOutputs {
  void* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  int cancelled;
  int rows;           // rows the outputs hold (the host sized them by its counts)
  uint32_t sequence;  // written last
};

struct NotifyArgs {
  PeerContext peers;
  uint32_t sequence;  // of this notify, the same on every rank (pack_tagged)
  int num_channels;
  const uint8_t* is_token_in_rank;   // [T, R] (bool bytes)
  const int* num_tokens_per_expert;  // [E] or nullptr
  // [R] or nullptr: tokens this rank sends each rank (the layout's); given, the host's counts go out
  // without waiting for the channel counts, which are checked against them (WaitPhase::kRankCounts).
  const int* num_tokens_per_rank;
  int num_tokens;
  int num_experts;
  int expert_alignment;
  int num_worst_tokens;  // 0 or the row capacity of the outputs
  HandleArrays handle;   // is_token_in_rank (copy), recv_channel_offset, num_recv_tokens_per_expert
  HostCounts host;
  const int* invalid_id;   // host-mapped flag of the layout kernel, republished with the counts
  ShapeFingerprint shape;  // what every rank must agree on; travels with the counts
};
// The count exchange: one block per channel counts what it will send to each rank and posts the counts as
// tagged words; one block posts the per-expert counts and gathers what arrives. No barrier: constant cost
// in T apart from the per-channel counting.
void launch_dispatch_notify(const NotifyArgs& args, cudaStream_t stream);

// What this rank's host read off the layout board for one notify, checked by the launch that runs its count
// exchange against what the sources send (WaitPhase::kLayoutCounts), before any row is written.
struct BoardCheck {
  bool active = false;               // the host read its counts off the board
  int rows_from[kMaxNvlRanks] = {};  // the rows it read for each source
};

// What the leader of one stream of channel 0 spent, summed over launches (EPX_NORMAL_PHASES=1; see
// kernels/phase_clock.cuh): cycles per step and in all, records moved. Lives in host-mapped memory.
enum class PhaseStream : int {
  kDispatchSend,     // steps: waiting for room, writing, publishing
  kDispatchReceive,  // waiting for records, copying, releasing
  kCombineSend,      // waiting for room, writing, publishing
  kNodesSend,        // across nodes: network senders (room, writing, publishing)
  kNodesForward,     // across nodes: forwarders (polling, copying, giving back)
  kDispatchOwnRows,  // the rank's own rows, copied by the receiving block: scanning, copying, draining
  kNodesReduce,      // combine across nodes: node reducers (room, summing, publishing)
  kNodesCombine,     // combine across nodes: the final reducer (waiting for partials, summing, giving back)
  kNodesNotify,      // count exchange across nodes: block 0 (channel counts, messages, host counts)
  kCombineReduce,    // within a node: a reducer lane of warp 0 (waiting for a peer's copies, adding and
                     // storing, batch end, waiting for its bulk loads to land)
  kCount
};
struct PhaseReport {
  static constexpr int kPhases = 4;  // a stream's steps; streams with fewer leave the rest at 0
  long long cycles[kPhases];
  long long total_cycles;
  long long records;
  int record_bytes;
  int launches;
  // The latest launch: the leader's end on the GPU's global timer (ns) and its cycles from start to end, so
  // the streams of one launch share a clock (when the reducers end after the senders, and by how much).
  unsigned long long last_end_ns;
  long long last_cycles;
};
constexpr int kPhaseStreams = static_cast<int>(PhaseStream::kCount);

struct DispatchArgs {
  PeerContext peers;
  NormalBufferMap map;
  NormalRecord record;
  int num_tokens;
  int num_experts;
  int chunk_tokens;                 // records per published chunk
  const uint8_t* is_token_in_rank;  // [T, R]: the input's, or a cached handle's copy
  DispatchInput in;                 // the caller's (x, scales, top-k: what the kernel reads of it)
  HandleArrays handle;
  int num_out_rows;  // rows of the outputs (N, or num_worst_tokens)
  DispatchOutput out;
  // Non-null: the outputs above (and handle.recv_src_idx) are not known yet; they arrive here.
  ShapeFingerprint shape{};  // of this launch (normal_launch_fingerprint), checked by every receiver
  const PublishedOutputs* published = nullptr;
  uint32_t published_sequence = 0;
  // With `published`: the outputs above (and handle.recv_src_idx) are a guess with room for this many rows;
  // when the notify's row count fits, the rows go there and nothing is waited for.
  int guess_rows = 0;
  // The count exchange runs in this launch (kernels/notify_steps.cuh), no notify kernel before it: senders
  // count and post their channel, block 1 exchanges and publishes the host's counts, blocks that write rows
  // scan the offsets themselves. Needs the per-rank totals and a guess; is_token_in_rank is then the
  // caller's map (the senders copy it into the handle).
  bool with_notify = false;
  NotifyArgs notify{};
  BoardCheck board{};
  PhaseReport* phases = nullptr;  // [kPhaseStreams] (EPX_NORMAL_PHASES=1), else null
  // Warps of each sender block that copy rows this rank keeps beside the receiver block's (2 ranks or more;
  // the kernel leaves every peer at least one sending warp): the receiver copies the own rows and the rows
  // that arrive, the sender only what crosses the link. -1: default_sender_own_warps.
  int sender_own_warps = -1;
  // Warps of each receiver block that copy own rows, the rest in a group per source (receiver_warp_roles;
  // -1: default_receiver_own_warps; 0: none, while the sender block has own-row warps).
  int receiver_own_warps = -1;
  // The Buffer has an output window (within one node, 2 ranks or more): every receiver posts how it receives
  // (NormalBufferMap::DirectPosts) and each source sends each destination that way
  // (kernels/normal_window.cuh).
  bool window_posts = false;
  // With window_posts: this rank's outputs lie in the window; the sources store rows straight into them and
  // the receiver blocks copy the own rows; no queue carries them.
  bool to_window = false;
  // With window_posts and `published`: the guess (guess_rows) lies in the window, so this rank receives into
  // it when the rows fit, which the device knows once the counts are (receives_into_window); block 1 posts
  // the way then instead of first thing.
  bool window_guess = false;
  // This rank's outputs (or the guess) in NormalBufferMap::DirectOutput order: offsets from its buffer base
  // in 16-byte units (-1: none).
  int window_outputs[NormalBufferMap::kDirectOutputs] = {-1, -1, -1, -1, -1};
};
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);

struct CombineArgs {
  PeerContext peers;
  NormalBufferMap map;
  NormalRecord record;  // num_topk_weights = the top-k reduced (0: no weights)
  int num_tokens;
  int chunk_tokens;
  HandleArrays handle;
  CombineInput in;  // the caller's (x, top-k weights, biases)
  CombineOutput out;
  ShapeFingerprint shape{};       // of this launch (normal_launch_fingerprint), checked by every receiver
  PhaseReport* phases = nullptr;  // as DispatchArgs::phases, for the senders
  // Warps of each sender block that reduce a share of the tokens, as the host resolved them
  // (combine_sender_roles; the launch's fingerprint carries them, so ranks that differ fail the shape check:
  // a source writes by both reducers' words when there are two).
  int sender_reduce_warps = 0;
  // Each sender group's last warp publishes the tail while the others write on (default with 2 ranks,
  // EPX_COMBINE_PUBLISHER_WARP; groups of 3 or more warps). The receivers see the same protocol either way.
  bool publisher_warp = false;
  // The staging area (combine_staging_map.hpp; enabled() false: none): peers whose rows fit return them
  // there by copy engine, this rank returns its rows to such peers likewise (the host copies), and their
  // queues stay idle.
  CombineStagingMap staging{};
};
void launch_combine(const CombineArgs& args, cudaStream_t stream);

// Before a staged combine's copies, on the comm stream: waits until each peer in `peers_mask` finished every
// launch before this one (so its staging slot is read), then writes the launch's number into this rank's
// Control::staging_call for the flags.
struct StagingGateArgs {
  PeerContext peers;
  unsigned peers_mask;  // bit r: this rank returns rows to r through r's staging area
};
void launch_staging_gate(const StagingGateArgs& args, cudaStream_t stream);

// After chunk k of a staged combine's copies, on the staging stream: raises `flags[i]` (in the peers' areas)
// to this rank's Control::staging_call, after a system-scope fence.
struct StagingFlagArgs {
  uint32_t* flags[kMaxNvlRanks];
  int count;
  const int* staging_call;  // this rank's Control::staging_call
};
void launch_staging_flags(const StagingFlagArgs& args, cudaStream_t stream);

}  // namespace epx::kernels
