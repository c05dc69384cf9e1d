#pragma once

#include <cstddef>
#include <cstdint>

#include "buffer_map/normal_buffer_map.hpp"
#include "common/host_device.hpp"
#include "epx/config.hpp"

// Normal mode across nodes: which rank is where, and the queues of the symmetric (NVSHMEM) buffer that carry
// tokens between nodes. The host sizes `num_rdma_bytes` with InternodeBufferMap; kernels address it with the
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

// Map of one rank's symmetric buffer for normal mode across nodes.
//
// NOTES: as in NormalBufferMap, tokens stream through bounded queues, so the size depends on (nodes,
// channels, queue tokens, record bytes), never on the batch. Rank s of node m talks over the network only to
// its rail peers: for every node n and channel c it owns a receive queue (records from its rail peer on n) of
// Q = num_max_rdma_chunked_recv_tokens records, and for every other node a send ring of Q records (records
// staged for n: network puts read from the symmetric heap). Its own node's queue is written in place (no
// put), so that node needs no ring. Dispatch and combine use the same queues in opposite directions: dispatch
// records travel from a token's source to the rail peers that forward it, combine partial sums back.
//
// Flow control is NormalBufferMap's: a monotonic tail in the owner's buffer (records the source put) and a
// monotonic head in the source's buffer (records the owner consumed), counts taken as differences from the
// call's start, entry e in slot e mod Q. The counters are uint64_t NVSHMEM signal words, always advanced by
// NVSHMEM_SIGNAL_ADD (a put followed by its tail update is one put-with-signal): additions commute, so
// signals that land out of order still leave the right count. Send ring slot e mod Q may be rewritten once
// the destination consumed entry e - Q (consuming it implies the put that carried it completed).
//
//   Head: Control        "previous call done" signals from the rail peers, notify arrival signals, counts
//         QueueCounters  tail / head per (peer node, channel), and this rank's own running counts
//         NotifyHalf x 2 the count exchange: one message per source rank (double-buffered by the parity of
//                        the notify sequence: a fast rank may write notify n+1 while a slow one reads n)
//         NotifySend     this rank's outgoing messages, staged for the puts
//         LaunchShapes   the rail peers' launch fingerprints, and this rank's staged for the puts
//   low-latency barrier  LowLatencyBufferMap's clean barrier (untouched by normal mode)
//   send rings        [N - 1 destination nodes][C channels][Q records]
//   receive queues    [N source nodes][C channels][Q records]
struct InternodeBufferMap {
  int num_nodes;
  int num_channels;
  int queue_tokens;  // Q: records one queue (and one send ring) holds
  int record_bytes;  // of this call's records

  struct Control {
    uint64_t done_signal[kMaxRdmaNodes];         // added by the rail peer on node n: its finished launches
    uint64_t notify_signal[kMaxInternodeRanks];  // added by rank s: notifies whose message s delivered here
    uint64_t calls_done;                         // dispatch / combine launches this rank finished
    int op_count;                                // notifies started (the sequence of the last one)
    int launch_arrivals;                         // blocks of the running launch that finished
    int notify_arrivals;                         // channel blocks of the running notify that staged counts
    int pad[29];
  };
  static_assert(sizeof(Control) ==
                    sizeof(uint64_t) * (kMaxRdmaNodes + kMaxInternodeRanks + 1) + sizeof(int) * 32,
                "Control must keep its size (adjust pad)");

  struct QueueCounters {
    uint64_t tail[kMaxRdmaNodes][kMaxChannels];  // [src node][c], added by the rail peer: records it put
    uint64_t head[kMaxRdmaNodes][kMaxChannels];  // [dst node][c], added by the rail peer: records consumed
    uint64_t sent[kMaxRdmaNodes][kMaxChannels];  // [dst node][c], own: records put to that node so far
    uint64_t consumed[kMaxRdmaNodes][kMaxChannels];  // [src node][c], own: records consumed from it so far
  };

  // The count exchange. Source s's message to rank r: s's shape fingerprint (every receiver compares it
  // with its own before trusting the counts), the tokens of each channel s sends to r, the tokens of each
  // channel s sends to r's node (its forwarder, when r is s's rail peer, needs them), and its tokens for each
  // of r's local experts. Message i sits at i * message_stride(R) ints.
  struct NotifyMessageView {
    int* shape;                // [kShapeInts]: the sender's ShapeFingerprint (core/shape_fingerprint.hpp)
    int* rank_channel_counts;  // [C]
    int* node_channel_counts;  // [C]
    int* expert_counts;        // [E / R]
  };
  static constexpr int kShapeInts = 12;  // ints of a ShapeFingerprint (checked where kernels use it)
  static constexpr int kNotifyInts = kMaxInternodeRanks * (kShapeInts + 2 * kMaxChannels) + kMaxExperts;
  struct NotifyHalf {
    int messages[kNotifyInts];  // [source rank]
  };
  struct NotifySend {
    int messages[kNotifyInts];  // [destination rank]
  };
  EPX_HD static int message_stride(int num_ranks) {
    return kShapeInts + 2 * kMaxChannels + kMaxExperts / num_ranks;
  }
  // Ints of a message with `num_channels` channels and `num_local_experts` experts per rank.
  EPX_HD static int message_ints(int num_channels, int num_local_experts) {
    return kShapeInts + 2 * num_channels + num_local_experts;
  }
  EPX_HD static NotifyMessageView message(int* messages, int index, int num_ranks, int num_channels) {
    int* m = messages + size_t(index) * message_stride(num_ranks);
    int* counts = m + kShapeInts;
    return {m, counts, counts + num_channels, counts + 2 * num_channels};
  }

  // Launch fingerprints across nodes (kernels/internode_common.cuh): every dispatch and combine launch puts
  // its launch number and ShapeFingerprint to its rail peers at its start; a rail peer checks it before it
  // reads the launch's first record from this rank. Double-buffered by the launch's parity: a rail peer
  // cannot finish launch k + 1 before this rank finished launch k (it waits for that before it sends here),
  // so its launch k + 2 never overwrites what launch k reads.
  static constexpr int kLaunchShapeInts = 1 + kShapeInts;  // the launch number, then the fingerprint
  struct LaunchShapes {
    uint64_t signal[kMaxRdmaNodes];  // added by the rail peer on node n once its fingerprint landed
    int from_node[2][kMaxRdmaNodes][kLaunchShapeInts];  // [launch parity][n]: the rail peer's
    int own[2][kLaunchShapeInts];                       // this rank's, staged for the puts
  };

  // The fixed areas, each 128-byte aligned, at the start of the buffer; the queues follow.
  struct Head {
    alignas(kNormalAlign) Control control;
    alignas(kNormalAlign) QueueCounters counters;
    alignas(kNormalAlign) NotifyHalf notify[2];
    alignas(kNormalAlign) NotifySend send;
    alignas(kNormalAlign) LaunchShapes launch_shapes;
  };
  static constexpr size_t kHeadBytes = align_up(sizeof(Head), kNormalAlign);
  // One Buffer's symmetric buffer also serves low-latency mode (LowLatencyBufferMap): the low-latency clean
  // barrier sits between the head and the queues, so each mode's monotonic counters survive the other's
  // calls.
  static constexpr size_t kLowLatencyBarrierOffset = kHeadBytes;
  static constexpr size_t kLowLatencyBarrierBytes = 512;
  static constexpr size_t kQueuesOffset = kHeadBytes + kLowLatencyBarrierBytes;

  EPX_HD size_t queue_bytes() const { return size_t(queue_tokens) * record_bytes; }
  EPX_HD size_t num_send_rings() const { return size_t(num_nodes - 1) * num_channels; }
  EPX_HD size_t num_recv_queues() const { return size_t(num_nodes) * num_channels; }
  EPX_HD size_t recv_queues_offset() const { return kQueuesOffset + num_send_rings() * queue_bytes(); }
  EPX_HD size_t total_bytes() const { return recv_queues_offset() + num_recv_queues() * queue_bytes(); }

  EPX_HD static Head* head(void* base) { return static_cast<Head*>(base); }
  // Index of `peer_node` among the other nodes of a rank on `own_node` (no ring to its own node).
  EPX_HD static int node_slot(int peer_node, int own_node) {
    return peer_node < own_node ? peer_node : peer_node - 1;
  }
  // In the buffer at `base` of a rank on `own_node`: the send ring record of entry `entry` (counted from the
  // start of this call) towards `dst_node` != own_node on `channel`.
  EPX_HD char* send_record(void* base, int dst_node, int own_node, int channel, uint64_t entry) const {
    return static_cast<char*>(base) + kQueuesOffset +
           record_offset(node_slot(dst_node, own_node), channel, entry);
  }
  // ... and the receive queue record of entry `entry` from `src_node` (own node included) on `channel`.
  EPX_HD char* recv_record(void* base, int src_node, int channel, uint64_t entry) const {
    return static_cast<char*>(base) + recv_queues_offset() + record_offset(src_node, channel, entry);
  }

  // The map of a call with `config` (its channels and num_max_rdma_chunked_recv_tokens) and records of
  // `record` on `num_nodes` nodes.
  static InternodeBufferMap of(int num_nodes, const Config& config, const InternodeRecord& record) {
    return {num_nodes, config.num_channels(), config.num_max_rdma_chunked_recv_tokens,
            static_cast<int>(record.bytes())};
  }

 private:
  EPX_HD size_t record_offset(int slot, int channel, uint64_t entry) const {
    return (size_t(slot) * num_channels + channel) * queue_bytes() +
           size_t(entry % static_cast<uint64_t>(queue_tokens)) * record_bytes;
  }
};

// Map of one rank's NVLink buffer for normal mode across nodes: the queues through which a forwarder
// (the rail peer that received a token from the network) hands it to the ranks of its node, and through
// which those ranks return their rows in combine.
//
// NOTES: the NVLink queue from forwarder f to rank l is split into one sub-queue per source node m of
// Q / N records (Q = num_max_nvl_chunked_recv_tokens): sub-queue (f -> l, m, c) carries exactly the rows
// that rank (m, local f) sends l on channel c, in token order, so l places them without any routing
// information, and streams from different source nodes never wait for each other (a full sub-queue stalls
// only its own source node). Combine sends rows back through the same sub-queues (l -> f, m, c), in the
// order l received them. Counters are NormalBufferMap's (uint32, monotonic, differences from the call's
// start), per (local peer, source node, channel).
//
//   Control        "previous call done" signals and launch fingerprints of the node's ranks
//   QueueCounters  tail / head per (local peer, source node, channel), and own running counts
//   queues         [L - 1 local writers][N source nodes][C channels][Q / N records]
struct ForwardBufferMap {
  int ranks_per_node;  // L
  int num_nodes;       // N
  int num_channels;
  int queue_tokens;  // Q / N: records one sub-queue holds
  int record_bytes;

  struct Control {
    int done_signal[kMaxNvlRanks];  // written by local rank l: the launches it finished
    int pad[32 - kMaxNvlRanks];
    // Written by local rank l at the start of each launch: the launch number tagged with its fingerprint's
    // hash (the values go to the abort-words slot; kernels/shape_check.cuh).
    uint64_t launch_shape[kMaxNvlRanks];
  };
  struct QueueCounters {
    uint32_t tail[kMaxNvlRanks][kMaxRdmaNodes][kMaxChannels];      // [writer][m][c]: records it wrote to me
    uint32_t head[kMaxNvlRanks][kMaxRdmaNodes][kMaxChannels];      // [reader][m][c]: my records it consumed
    uint32_t sent[kMaxNvlRanks][kMaxRdmaNodes][kMaxChannels];      // own: records written to reader so far
    uint32_t consumed[kMaxNvlRanks][kMaxRdmaNodes][kMaxChannels];  // own: records consumed from writer
  };
  struct Head {
    alignas(kNormalAlign) Control control;
    alignas(kNormalAlign) QueueCounters counters;
  };
  static constexpr size_t kQueuesOffset = align_up(sizeof(Head), kNormalAlign);

  EPX_HD size_t queue_bytes() const { return size_t(queue_tokens) * record_bytes; }
  EPX_HD size_t total_bytes() const {
    return kQueuesOffset + size_t(ranks_per_node - 1) * num_nodes * num_channels * queue_bytes();
  }
  EPX_HD static Head* head(void* base) { return static_cast<Head*>(base); }
  // In the buffer of local rank `owner`: entry `entry` of the sub-queue from local rank `writer` != owner for
  // source node `node` on `channel`.
  EPX_HD char* record(void* owner_base, int writer, int owner, int node, int channel, uint32_t entry) const {
    const int slot = writer < owner ? writer : writer - 1;
    const size_t queue_idx = (size_t(slot) * num_nodes + node) * num_channels + channel;
    return static_cast<char*>(owner_base) + kQueuesOffset + queue_idx * queue_bytes() +
           size_t(queue_slot(entry, queue_tokens)) * record_bytes;
  }

  // The map of a call with `config` on nodes of `ranks_per_node` ranks; Q / N rounds down.
  static ForwardBufferMap of(int ranks_per_node, int num_nodes, const Config& config,
                             const InternodeRecord& record) {
    return {ranks_per_node, num_nodes, config.num_channels(),
            config.num_max_nvl_chunked_recv_tokens / num_nodes, static_cast<int>(record.bytes())};
  }
};

// Throws epx::Error naming the bytes needed when `map` does not fit a buffer of `buffer_bytes`
// (num_nvl_bytes), or when its sub-queues would hold no record (num_max_nvl_chunked_recv_tokens < nodes).
void check_forward_map_fits(const ForwardBufferMap& map, size_t buffer_bytes);

// Throws epx::Error naming the bytes needed when `map` does not fit a buffer of `buffer_bytes`
// (num_rdma_bytes).
void check_internode_map_fits(const InternodeBufferMap& map, size_t buffer_bytes);

// Symmetric-buffer bytes per rank for normal mode across nodes with `config` (what
// Config::get_rdma_buffer_size_hint returns): 2 (N - 1) C Q records of the largest record for `hidden_bytes`
// plus the fixed control, counter and notify areas, a multiple of 128; 0 when the group is one node.
// NVLink bytes per rank the forwarding queues need with `config` on `num_ranks` ranks for rows of up to
// `hidden_bytes`, whatever the node size (the largest over every split into nodes of at most 8); 0 when no
// split into several nodes exists.
size_t forward_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, const Config& config);

size_t internode_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int ranks_per_node,
                                       const Config& config = Config{});

}  // namespace epx
