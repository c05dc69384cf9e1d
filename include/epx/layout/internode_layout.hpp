#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/common/host_device.hpp"
#include "epx/config.hpp"
#include "epx/layout/normal_layout.hpp"

// Normal mode across nodes: which rank is where, and the queues of the symmetric (NVSHMEM) buffer that carry
// tokens between nodes. The host sizes `num_rdma_bytes` with InternodeLayout; kernels address it with the
// same struct.
namespace epx {

constexpr int kMaxRdmaNodes = 16;       // nodes a normal-mode group across nodes may span
constexpr int kMaxInternodeRanks = 64;  // ranks of such a group (the Buffer's limit)

// Ranks [k * ranks_per_node, (k + 1) * ranks_per_node) form node k. A rank's "local rank" is its index inside
// its node; the ranks with the same local rank on every node form a rail, and every network queue joins two
// ranks of one rail (a token for node n leaves rank s towards rail_peer(s, n), which forwards it over
// NVLink).
struct NodeMap {
  int num_ranks;
  int ranks_per_node;

  EPX_HD int num_nodes() const { return num_ranks / ranks_per_node; }
  EPX_HD bool spans_nodes() const { return ranks_per_node < num_ranks; }
  EPX_HD int node_of(int rank) const { return rank / ranks_per_node; }
  EPX_HD int local_rank(int rank) const { return rank % ranks_per_node; }
  EPX_HD int rail_peer(int rank, int node) const { return node * ranks_per_node + local_rank(rank); }
  // The bits of `rank_mask` (bit r: rank r) that belong to `node`, as local ranks (bit j: local rank j).
  EPX_HD uint32_t local_mask(uint64_t rank_mask, int node) const {
    const uint64_t node_bits = ranks_per_node >= 64 ? ~uint64_t{0} : (uint64_t{1} << ranks_per_node) - 1;
    return static_cast<uint32_t>((rank_mask >> (node * ranks_per_node)) & node_bits);
  }
};

// Throws epx::Error naming `name` (the argument the value came from, e.g. "ranks_per_node" or
// "EPX_RANKS_PER_NODE") unless ranks_per_node >= 1, divides num_ranks, and, when the group spans nodes, is at
// most 8 (kMaxNvlRanks: a node is one NVLink domain).
void validate_node_split(int num_ranks, int ranks_per_node, const char* name = "ranks_per_node");

// One token (dispatch) or one partial sum (combine) travelling through a network queue: a NormalRecord (row,
// FP8 scales, int32 top-k ids and weights, source token index) followed, in dispatch, by the bitmask of the
// destination node's local ranks that need the token (what its forwarder delivers over NVLink), padded to 16
// bytes.
struct InternodeRecord {
  NormalRecord normal;
  bool with_rank_mask;

  EPX_HD size_t rank_mask_offset() const {
    return normal.src_idx_offset() + (normal.with_src_idx ? sizeof(int) : 0);
  }
  EPX_HD size_t bytes() const {
    return align_up(rank_mask_offset() + (with_rank_mask ? sizeof(uint32_t) : 0), 16);
  }

  EPX_HD static InternodeRecord dispatch(const NormalShape& shape) {
    return {NormalRecord::dispatch(shape), true};
  }
  // A node's partial sum of a token: its BF16 row and top-k weights.
  EPX_HD static InternodeRecord combine(int hidden, int num_topk) {
    return {NormalRecord::combine(hidden, num_topk), false};
  }
  // The largest record of any call with rows of up to `hidden_bytes` (= hidden * 2).
  static InternodeRecord largest(size_t hidden_bytes) { return {NormalRecord::largest(hidden_bytes), true}; }
};

// Layout of one rank's symmetric buffer for normal mode across nodes.
//
// NOTES: as in NormalLayout, tokens stream through bounded queues, so the size depends on (nodes, channels,
// queue tokens, record bytes), never on the batch. Rank s of node m talks over the network only to its rail
// peers: for every other node n and channel c it owns a send ring (records staged for n: NVSHMEM puts must
// read from the symmetric heap) and a receive queue (records from its rail peer on n), each of
// Q = num_max_rdma_chunked_recv_tokens records. Tokens for the rank's own node never cross the network, so
// there is no queue for it. Dispatch and combine use the same queues in opposite directions.
//
// Flow control is NormalLayout's: a monotonic tail in the owner's buffer (records the source put) and a
// monotonic head in the source's buffer (records the owner consumed), counts taken as differences from the
// call's start, entry e in slot e mod Q. The counters are uint64_t because NVSHMEM's signal operations
// (nvshmemx_signal_op, nvshmem_putmem_signal_nbi) update 64-bit words: a put followed by its tail update is
// one put-with-signal. Send ring slot e mod Q may be rewritten once the destination consumed entry e - Q.
//
//   Head: Control        barrier and "previous call done" signals from the rail peers, this rank's counts
//         QueueCounters  tail / head per (peer node, channel), and this rank's own running counts
//         NotifyHalf x 2 count exchange of dispatch, double-buffered like NormalLayout's
//   send rings        [N - 1 destination nodes][C channels][Q records]
//   receive queues    [N - 1 source nodes][C channels][Q records]
struct InternodeLayout {
  int num_nodes;
  int num_channels;
  int queue_tokens;  // Q: records one queue (and one send ring) holds
  int record_bytes;  // of this call's records

  struct Control {
    uint64_t barrier_signal[kMaxRdmaNodes];  // put by the rail peer on node n: barriers it has entered
    uint64_t done_signal[kMaxRdmaNodes];     // put by the rail peer on node n: its finished launches
    uint64_t barrier_count;                  // barriers this rank has entered
    uint64_t calls_done;                     // dispatch / combine launches this rank finished
    int op_count;                            // notifies started; its parity picks the notify half
    int launch_arrivals;                     // blocks of the running launch that finished
    int pad[30];
  };
  static_assert(sizeof(Control) == sizeof(uint64_t) * (2 * kMaxRdmaNodes + 2) + sizeof(int) * 32,
                "Control must keep its size (adjust pad)");

  struct QueueCounters {
    uint64_t tail[kMaxRdmaNodes][kMaxChannels];  // [src node][c], put by the rail peer: records it wrote
    uint64_t head[kMaxRdmaNodes][kMaxChannels];  // [dst node][c], put by the rail peer: records it consumed
    uint64_t sent[kMaxRdmaNodes][kMaxChannels];  // [dst node][c], own: records put to that node so far
    uint64_t consumed[kMaxRdmaNodes][kMaxChannels];  // [src node][c], own: records consumed from it so far
  };

  struct NotifyHalf {
    int rank_channel_counts[kMaxInternodeRanks][kMaxChannels];  // [src rank][c]: tokens it sends me in c
    int node_channel_counts[kMaxRdmaNodes][kMaxChannels];  // [src node][c]: records its rail peer puts to me
    int expert_counts[kMaxExperts];                        // [src * L + le]: its tokens for my local expert
  };

  // The fixed areas, each 128-byte aligned, at the start of the buffer; the queues follow.
  struct Head {
    alignas(kNormalAlign) Control control;
    alignas(kNormalAlign) QueueCounters counters;
    alignas(kNormalAlign) NotifyHalf notify[2];
  };
  static constexpr size_t kQueuesOffset = align_up(sizeof(Head), kNormalAlign);

  EPX_HD size_t queue_bytes() const { return size_t(queue_tokens) * record_bytes; }
  // Queues in each direction (send rings, receive queues).
  EPX_HD size_t num_queues() const { return size_t(num_nodes - 1) * num_channels; }
  EPX_HD size_t recv_queues_offset() const { return kQueuesOffset + num_queues() * queue_bytes(); }
  EPX_HD size_t total_bytes() const { return kQueuesOffset + 2 * num_queues() * queue_bytes(); }

  EPX_HD static Head* head(void* base) { return static_cast<Head*>(base); }
  // Index of `peer_node` among the other nodes of a rank on `own_node` (no queue to its own node).
  EPX_HD static int node_slot(int peer_node, int own_node) {
    return peer_node < own_node ? peer_node : peer_node - 1;
  }
  // In the buffer at `base` of a rank on `own_node`: the send ring record of entry `entry` (counted from the
  // start of this call) towards `dst_node` on `channel`.
  EPX_HD char* send_record(void* base, int dst_node, int own_node, int channel, uint32_t entry) const {
    return static_cast<char*>(base) + kQueuesOffset +
           record_offset(node_slot(dst_node, own_node), channel, entry);
  }
  // ... and the receive queue record of entry `entry` from `src_node` on `channel`.
  EPX_HD char* recv_record(void* base, int src_node, int own_node, int channel, uint32_t entry) const {
    return static_cast<char*>(base) + recv_queues_offset() +
           record_offset(node_slot(src_node, own_node), channel, entry);
  }

  // The layout of a call with `config` (its channels and num_max_rdma_chunked_recv_tokens) and records of
  // `record` on `num_nodes` nodes.
  static InternodeLayout of(int num_nodes, const Config& config, const InternodeRecord& record) {
    return {num_nodes, config.num_channels(), config.num_max_rdma_chunked_recv_tokens,
            static_cast<int>(record.bytes())};
  }

 private:
  EPX_HD size_t record_offset(int slot, int channel, uint32_t entry) const {
    return (size_t(slot) * num_channels + channel) * queue_bytes() +
           size_t(queue_slot(entry, queue_tokens)) * record_bytes;
  }
};

// Throws epx::Error naming the bytes needed when `layout` does not fit a buffer of `buffer_bytes`
// (num_rdma_bytes).
void check_internode_layout_fits(const InternodeLayout& layout, size_t buffer_bytes);

// Symmetric-buffer bytes per rank for normal mode across nodes with `config` (what
// Config::get_rdma_buffer_size_hint returns): 2 (N - 1) C Q records of the largest record for `hidden_bytes`
// plus the fixed control, counter and notify areas, a multiple of 128; 0 when the group is one node.
size_t internode_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int ranks_per_node,
                                       const Config& config = Config{});

}  // namespace epx
