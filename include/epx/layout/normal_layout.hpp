#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/common/host_device.hpp"

namespace epx {

constexpr int kMaxNvlRanks = 8;                 // NVLink domain size the normal kernels support
constexpr int kMaxTopk = 16;                    // top-k supported by every mode
constexpr int kMaxExperts = 4096;               // per-expert counters reserved in the control area
constexpr int kDefaultMaxTokensPerRank = 4096;  // what the size hints plan for
constexpr size_t kNormalAlign = 128;

EPX_HD constexpr size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The per-call shape that decides how the normal-mode NVLink buffer is carved up.
struct NormalShape {
  int num_ranks;
  int num_experts;
  int hidden;       // channels per token
  int x_row_bytes;  // bytes of one dispatched token row: hidden*2 (BF16) or hidden (FP8)
  int num_scales;   // float scales per row: 0 (BF16) or hidden/128 (FP8)
  int num_topk;     // 0 when dispatch carries no top-k
};

// Layout of one rank's normal-mode NVLink buffer; the host sizes with it, kernels address with it.
//
// NOTES: design is "publish locally, pull remotely" for dispatch and for combine (whose pull is fused into
// the reduce). Every region a rank writes before a barrier and others read after it exists twice (parity of
// the operation counter), so a fast rank can start operation n+1 while a slow one still reads operation n:
// the barrier of n+1 cannot complete before everybody finished n, so n+2 may reuse n's half safely.
//
//   control                         barrier signals and counters (not double-buffered)
//   per parity p in {0, 1}:
//     send_counts[R]                tokens this rank sends to each destination
//     expert_counts[kMaxExperts]    this rank's tokens per global expert (each token once per expert)
//     send_lists[R][cap]            per destination, the source token indices in ascending order
//     stage_x[cap][x_row_bytes]     this rank's tokens, read by the destinations
//     stage_scales[cap][num_scales]
//     stage_topk_idx[cap][K]        int32 global expert ids
//     stage_topk_weights[cap][K]
//     combine_x[R][cap][hidden]     BF16 expert outputs this rank returns to each source rank, staged for
//                                   that rank to read (the own part stays unused: combine reads its own
//                                   rows from its input)
//     combine_weights[R][cap][K]
struct NormalLayout {
  NormalShape shape;
  int capacity;        // tokens per rank the buffer holds (cap above)
  size_t half_stride;  // bytes between the two halves: fixed by the buffer size, not by the shape, so
                       // operations of different shapes still alternate between the same two address ranges

  struct Control {
    int barrier_signal[kMaxNvlRanks];  // written by peer r: the number of barriers r has entered
    int barrier_count;                 // barriers this rank has entered
    int op_count;                      // normal-mode operations started; its parity picks the half
    int staged_signal[kMaxNvlRanks];   // written by peer r: the number of dispatch stages r has finished
    int stage_count;                   // dispatch stages this rank has finished
    int stage_arrivals;                // blocks of the running stage launch that are done (last resets it)
    int parity_acks;                   // stage blocks that read op_count (notify's barrier waits, resets)
    int pad[32 - 2 * kMaxNvlRanks - 5];
  };
  static_assert(sizeof(Control) == sizeof(int) * 32, "Control must stay 32 ints (adjust pad)");
  static constexpr size_t kControlBytes = align_up(sizeof(int) * 32, kNormalAlign);

  EPX_HD size_t send_counts_bytes() const { return align_up(sizeof(int) * shape.num_ranks, kNormalAlign); }
  EPX_HD size_t expert_counts_bytes() const { return align_up(sizeof(int) * kMaxExperts, kNormalAlign); }
  EPX_HD size_t send_lists_bytes() const {
    return align_up(sizeof(int) * size_t(shape.num_ranks) * capacity, kNormalAlign);
  }
  EPX_HD size_t stage_x_bytes() const { return align_up(size_t(capacity) * shape.x_row_bytes, kNormalAlign); }
  EPX_HD size_t stage_scales_bytes() const {
    return align_up(sizeof(float) * size_t(capacity) * shape.num_scales, kNormalAlign);
  }
  EPX_HD size_t stage_topk_bytes() const {
    return align_up(sizeof(int) * size_t(capacity) * shape.num_topk, kNormalAlign);
  }
  EPX_HD size_t combine_row_bytes() const { return size_t(shape.hidden) * 2; }
  EPX_HD size_t combine_x_bytes() const {
    return align_up(size_t(shape.num_ranks) * capacity * combine_row_bytes(), kNormalAlign);
  }
  EPX_HD size_t combine_weights_bytes() const {
    return align_up(sizeof(float) * size_t(shape.num_ranks) * capacity * shape.num_topk, kNormalAlign);
  }

  // Offsets within one half, then the half's size.
  EPX_HD size_t send_counts_offset() const { return 0; }
  EPX_HD size_t expert_counts_offset() const { return send_counts_offset() + send_counts_bytes(); }
  EPX_HD size_t send_lists_offset() const { return expert_counts_offset() + expert_counts_bytes(); }
  EPX_HD size_t stage_x_offset() const { return send_lists_offset() + send_lists_bytes(); }
  EPX_HD size_t stage_scales_offset() const { return stage_x_offset() + stage_x_bytes(); }
  EPX_HD size_t stage_topk_idx_offset() const { return stage_scales_offset() + stage_scales_bytes(); }
  EPX_HD size_t stage_topk_weights_offset() const { return stage_topk_idx_offset() + stage_topk_bytes(); }
  EPX_HD size_t combine_x_offset() const { return stage_topk_weights_offset() + stage_topk_bytes(); }
  EPX_HD size_t combine_weights_offset() const { return combine_x_offset() + combine_x_bytes(); }
  EPX_HD size_t half_bytes() const { return combine_weights_offset() + combine_weights_bytes(); }

  EPX_HD size_t half_offset(int parity) const { return kControlBytes + size_t(parity) * half_stride; }
  EPX_HD size_t total_bytes() const { return kControlBytes + 2 * half_stride; }

  // Typed addresses inside a buffer whose base is `base` (a local or a peer's mapping).
  EPX_HD static Control* control(void* base) { return static_cast<Control*>(base); }
  EPX_HD char* half(void* base, int parity) const { return static_cast<char*>(base) + half_offset(parity); }
  EPX_HD int* send_counts(void* base, int parity) const {
    return reinterpret_cast<int*>(half(base, parity) + send_counts_offset());
  }
  EPX_HD int* expert_counts(void* base, int parity) const {
    return reinterpret_cast<int*>(half(base, parity) + expert_counts_offset());
  }
  EPX_HD int* send_list(void* base, int parity, int dst_rank) const {
    return reinterpret_cast<int*>(half(base, parity) + send_lists_offset()) + size_t(dst_rank) * capacity;
  }
  EPX_HD char* stage_x_row(void* base, int parity, int token_idx) const {
    return half(base, parity) + stage_x_offset() + size_t(token_idx) * shape.x_row_bytes;
  }
  EPX_HD float* stage_scales_row(void* base, int parity, int token_idx) const {
    return reinterpret_cast<float*>(half(base, parity) + stage_scales_offset()) +
           size_t(token_idx) * shape.num_scales;
  }
  EPX_HD int* stage_topk_idx_row(void* base, int parity, int token_idx) const {
    return reinterpret_cast<int*>(half(base, parity) + stage_topk_idx_offset()) +
           size_t(token_idx) * shape.num_topk;
  }
  EPX_HD float* stage_topk_weights_row(void* base, int parity, int token_idx) const {
    return reinterpret_cast<float*>(half(base, parity) + stage_topk_weights_offset()) +
           size_t(token_idx) * shape.num_topk;
  }
  // In the buffer at `base`: the row staged for `source_rank` (the rank the token came from), slot = the
  // token's position in that rank's send list to the buffer's owner.
  EPX_HD char* combine_x_row(void* base, int parity, int source_rank, int slot_idx) const {
    return half(base, parity) + combine_x_offset() +
           (size_t(source_rank) * capacity + slot_idx) * combine_row_bytes();
  }
  EPX_HD float* combine_weights_row(void* base, int parity, int source_rank, int slot_idx) const {
    return reinterpret_cast<float*>(half(base, parity) + combine_weights_offset()) +
           (size_t(source_rank) * capacity + slot_idx) * shape.num_topk;
  }

  // The largest capacity whose halves fit in a buffer of `buffer_bytes` (capacity 0 if not even one token
  // fits).
  static NormalLayout fit(const NormalShape& shape, size_t buffer_bytes);
  // The smallest layout holding `capacity` tokens.
  static NormalLayout with_capacity(const NormalShape& shape, int capacity) {
    NormalLayout layout{shape, capacity, 0};
    layout.half_stride = layout.half_bytes();
    return layout;
  }
};

// Checks a shape (ranks, experts, hidden, top-k) and throws epx::Error naming the bad argument.
void validate_normal_shape(const NormalShape& shape);

// NVLink bytes a rank needs for `max_tokens_per_rank` tokens of `hidden_bytes` (= hidden * 2) with up to
// kMaxTopk top-k and FP8 scales; rounded up to 2 MiB. What Config::get_nvl_buffer_size_hint returns.
size_t normal_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks,
                                   int max_tokens_per_rank = kDefaultMaxTokensPerRank);

}  // namespace epx
