#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"
#include "common/tagged_word.hpp"
#include "epx/config.hpp"
#include "formats/scale_format.hpp"

namespace epx {

constexpr int kMaxNvlRanks = 8;    // NVLink domain size the normal kernels support
constexpr int kMaxTopk = 16;       // top-k supported by every mode
constexpr int kMaxExperts = 4096;  // per-expert counters reserved in the notify area
constexpr int kMaxChannels = 128;  // channels (num_sms / 2) the queue counters are reserved for
constexpr size_t kNormalAlign = 128;

EPX_HD constexpr size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The per-call shape of a normal-mode dispatch.
struct NormalShape {
  int num_ranks;
  int num_experts;
  int hidden;       // channels per token
  int x_row_bytes;  // bytes of one dispatched token row: RowFormat::row_bytes(hidden)
  int num_scales;   // 4-byte scale words per row: 0 (BF16), the caller's, or RowFormat::scale_words(hidden)
  int num_topk;     // 0 when dispatch carries no top-k
};

// Tokens [begin, end) of a rank's batch that channel `channel` carries: contiguous ranges of
// ceil(T / C) tokens, so the receive order (source rank, then token index) is channel after channel.
struct TokenRange {
  int begin;
  int end;
};
EPX_HD int tokens_per_channel(int num_tokens, int num_channels) {
  return (num_tokens + num_channels - 1) / num_channels;
}
EPX_HD TokenRange channel_token_range(int num_tokens, int num_channels, int channel) {
  const int per_channel = tokens_per_channel(num_tokens, num_channels);
  const int begin = channel * per_channel < num_tokens ? channel * per_channel : num_tokens;
  const int end = begin + per_channel < num_tokens ? begin + per_channel : num_tokens;
  return {begin, end};
}

// Queue arithmetic shared by the kernels and the CPU tests. Counters are monotonic uint32 that may wrap: a
// count is always a difference from the value a call started at.
EPX_HD int count_since(uint32_t counter, uint32_t base) {
  return static_cast<int>(counter - base);
}
// Records a sender may write now: the queue holds `queue_tokens`, it wrote `pushed` and the receiver
// consumed `consumed` of them (both counted from the start of the call).
EPX_HD int queue_room(int pushed, int consumed, int queue_tokens) {
  return queue_tokens - (pushed - consumed);
}
// Queue slot of entry `entry` (counted from the start of the call, so every call starts at slot 0).
EPX_HD int queue_slot(uint32_t entry, int queue_tokens) {
  return static_cast<int>(entry % static_cast<uint32_t>(queue_tokens));
}

// One row travelling through a queue: the payload, then its metadata, padded to 16 bytes so every record
// starts 16-byte aligned. Dispatch records carry the token row, FP8 scales, top-k ids (int32, global) and
// weights, and the source token index; combine records carry the BF16 row and the top-k weights.
struct NormalRecord {
  int x_bytes;
  int num_scales;
  int num_topk_idx;
  int num_topk_weights;
  bool with_src_idx;

  EPX_HD size_t scales_offset() const { return size_t(x_bytes); }
  EPX_HD size_t topk_idx_offset() const { return scales_offset() + sizeof(float) * num_scales; }
  EPX_HD size_t topk_weights_offset() const { return topk_idx_offset() + sizeof(int) * num_topk_idx; }
  EPX_HD size_t src_idx_offset() const { return topk_weights_offset() + sizeof(float) * num_topk_weights; }
  EPX_HD size_t bytes() const { return align_up(src_idx_offset() + (with_src_idx ? sizeof(int) : 0), 16); }

  EPX_HD static NormalRecord dispatch(const NormalShape& shape) {
    return {shape.x_row_bytes, shape.num_scales, shape.num_topk, shape.num_topk, true};
  }
  EPX_HD static NormalRecord combine(int hidden, int num_topk) { return {hidden * 2, 0, 0, num_topk, false}; }
  // The largest record of any call with rows of up to `hidden_bytes` (= hidden * 2): the largest row of any
  // scale format with its default scales (largest_row_bytes: today BF16's), kMaxTopk ids and weights.
  static NormalRecord largest(size_t hidden_bytes) {
    return {static_cast<int>(largest_row_bytes(static_cast<int>(hidden_bytes / 2))), 0, kMaxTopk, kMaxTopk,
            true};
  }
};

// Map of one rank's normal-mode NVLink buffer; the host sizes with it, kernels address with it.
//
// NOTES: tokens stream through bounded queues, so the buffer depends on (ranks, channels, queue tokens,
// record bytes), never on the batch. Queue (src -> owner, channel) lives in the owner's buffer; the source
// writes records into it with posted NVLink stores and publishes how many it wrote (tail); the owner copies
// them out and publishes how many it consumed (head) into the source's buffer. Both counters are monotonic
// for the Buffer's life (compared by unsigned difference, so wrapping is harmless); each side keeps its own
// count at the end of a call and starts the next call from it, so no call resets anything. A rank's traffic
// to itself never enters a queue.
//
//   Control           launch arrivals, "calls done" signals
//   QueueCounters     tail / head per (peer, channel), and this rank's own running counts
//   NotifyHalf x 2    count exchange of dispatch, as tagged words (pack_tagged), double-buffered by the
//                     parity of the notify's sequence: a fast rank may write notify n+1 while a slow one
//                     still reads notify n, but never n+2 (that needs the slow rank's n+1 counts)
//   DirectPosts       a dispatch into the output window: where rows go, and when they are all there
//   queues            [R - 1 sources][C channels][Q records] of this call's record size
//
// A call's queues are carved for its own shape, so before a source writes into a peer's queues it waits
// until that peer finished its previous dispatch or combine launch (Control::done_signal): then nothing of
// an earlier call, whatever its shape, is still unread there.
struct NormalBufferMap {
  int num_ranks;
  int num_channels;
  int queue_tokens;  // Q: records one queue holds
  int record_bytes;  // of this call's records

  struct Control {
    int calls_done;                 // dispatch / combine launches this rank finished
    int launch_arrivals;            // blocks of the running dispatch / combine launch that finished
    int done_signal[kMaxNvlRanks];  // written by peer r: r's calls_done
    // A receive launched before its outputs were known: one block copies the outputs the host published
    // into this device-memory mirror (pointers, cancelled flag, then the sequence) for the others.
    uint64_t outputs_mirror[5];
    int outputs_cancelled;
    uint32_t outputs_sequence;
    // A dispatch that runs the count exchange: block 1 writes the launch's number (calls before it + 1) once
    // the handle's channel offsets are scanned and checked, for the sender blocks' own-row warps.
    int offsets_sequence;
    // A combine through the staging area (combine_staging_map.hpp): the gate before its copies writes the
    // launch's number (calls before it + 1); the flags after the copies carry it to the peers.
    int staging_call;
    int pad[32 - kMaxNvlRanks - 2 - 14];
    // [src], written by src at the start of each dispatch and combine launch: pack_tagged(its launch count,
    // the hash of its launch's ShapeFingerprint, whose values go to the abort words' launch slot).
    uint64_t launch_shape[kMaxNvlRanks];
  };
  static_assert(sizeof(Control) == sizeof(int) * (32 + 2 * kMaxNvlRanks),
                "Control: 32 ints, then launch_shape");

  struct QueueCounters {
    uint32_t tail[kMaxNvlRanks][kMaxChannels];      // [src][c], written by src: records it wrote to me
    uint32_t head[kMaxNvlRanks][kMaxChannels];      // [dst][c], written by dst: my records it consumed
    uint32_t sent[kMaxNvlRanks][kMaxChannels];      // [dst][c], own: records written to dst so far
    uint32_t consumed[kMaxNvlRanks][kMaxChannels];  // [src][c], own: records consumed from src so far
    // A combine's second reducer (the sender block's reducing warps, kernels/combine_warp_roles.hpp) keeps
    // its own pair, so that neither block reads a count the other may already have advanced in the same
    // call. head_second: [dst][c], written by dst's second reducer: the records of mine it no longer needs
    // (a source writes up to the smaller of head and head_second plus the queue's size). consumed_second:
    // [src][c], own: as consumed, for the second reducer (every dispatch receiver advances both).
    uint32_t head_second[kMaxNvlRanks][kMaxChannels];
    uint32_t consumed_second[kMaxNvlRanks][kMaxChannels];
  };

  struct NotifyHalf {                                     // tagged words (pack_tagged)
    uint64_t channel_counts[kMaxNvlRanks][kMaxChannels];  // [src][c], written by src: tokens it sends me in c
    uint64_t expert_counts[kMaxExperts];  // [src * L + le], written by src: its tokens for my le
    uint64_t shape_hash[kMaxNvlRanks];    // [src], written by src: the hash of its shape fingerprint
    uint64_t
        rank_totals[kMaxNvlRanks];  // [src], written by src: its tokens for me, when the caller gave them
  };

  // A dispatch into outputs in the output window (Buffer::nvl_output_window) skips the queues: the receiver
  // posts where each source's rows go, the source stores them there and then says it is done. The outputs a
  // receiver posts, in this order; the source indices go to the receiver's queues (idle while it receives
  // into its window), which it copies into its handle (none for a cached dispatch, whose handle has them).
  enum DirectOutput {
    kDirectX,
    kDirectScales,
    kDirectTopkIdx,
    kDirectTopkWeights,
    kDirectSrcIdx,
    kDirectOutputs
  };
  struct DirectPosts {
    // [dst][c], written by dst: pack_tagged(its launch number, the first row of my channel c's rows there).
    uint64_t first_row[kMaxNvlRanks][kMaxChannels];
    // [dst][DirectOutput], written by dst: pack_tagged(its launch number, the output's offset from dst's
    // buffer base in 16-byte units, or -1 when it has none).
    uint64_t outputs[kMaxNvlRanks][kDirectOutputs];
    // [src][c], written by src: its launch number once channel c's rows are all stored into my outputs.
    int rows_done[kMaxNvlRanks][kMaxChannels];
  };

  static constexpr size_t kControlOffset = 0;
  static constexpr size_t kCountersOffset = align_up(sizeof(Control), kNormalAlign);
  static constexpr size_t kNotifyOffset = kCountersOffset + align_up(sizeof(QueueCounters), kNormalAlign);
  static constexpr size_t kNotifyHalfBytes = align_up(sizeof(NotifyHalf), kNormalAlign);
  static constexpr size_t kDirectOffset = kNotifyOffset + 2 * kNotifyHalfBytes;
  static constexpr size_t kQueuesOffset = kDirectOffset + align_up(sizeof(DirectPosts), kNormalAlign);

  EPX_HD size_t queue_bytes() const { return size_t(queue_tokens) * record_bytes; }
  EPX_HD size_t total_bytes() const {
    return kQueuesOffset + size_t(num_ranks - 1) * num_channels * queue_bytes();
  }

  EPX_HD static Control* control(void* base) { return reinterpret_cast<Control*>(base); }
  EPX_HD static QueueCounters* counters(void* base) {
    return reinterpret_cast<QueueCounters*>(static_cast<char*>(base) + kCountersOffset);
  }
  EPX_HD static DirectPosts* direct(void* base) {
    return reinterpret_cast<DirectPosts*>(static_cast<char*>(base) + kDirectOffset);
  }
  // The half notify `sequence` uses.
  EPX_HD static NotifyHalf* notify(void* base, uint32_t sequence) {
    return reinterpret_cast<NotifyHalf*>(static_cast<char*>(base) + kNotifyOffset +
                                         (sequence & 1u) * kNotifyHalfBytes);
  }
  // Queue index of `src` in `owner`'s buffer: owners keep no queue from themselves.
  EPX_HD static int source_slot(int src, int owner) { return src < owner ? src : src - 1; }
  // In the buffer at `base` (owned by `owner`): the record holding entry `entry` (counted from the start of
  // this call) of the queue from `src` on `channel`.
  EPX_HD char* record(void* base, int src, int owner, int channel, uint32_t entry) const {
    const size_t queue_idx = size_t(source_slot(src, owner)) * num_channels + channel;
    return static_cast<char*>(base) + kQueuesOffset + queue_idx * queue_bytes() +
           size_t(queue_slot(entry, queue_tokens)) * record_bytes;
  }

  // The map of a call with `config` and records of `record` on `num_ranks` ranks.
  static NormalBufferMap of(int num_ranks, const Config& config, const NormalRecord& record) {
    return {num_ranks, config.num_channels(), config.num_max_nvl_chunked_recv_tokens,
            static_cast<int>(record.bytes())};
  }
};

// Checks a shape (ranks, experts, hidden, top-k) and throws epx::Error naming the bad argument.
void validate_normal_shape(const NormalShape& shape);

// Throws epx::Error naming the bytes needed when `map` does not fit a buffer of `buffer_bytes`.
void check_normal_map_fits(const NormalBufferMap& map, size_t buffer_bytes);

// NVLink bytes per rank for normal-mode calls with `config` (what Config::get_nvl_buffer_size_hint returns):
// (R - 1) * C * Q records of the largest record for `hidden_bytes`, plus the fixed control and notify areas.
size_t normal_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, const Config& config = Config{});

}  // namespace epx
