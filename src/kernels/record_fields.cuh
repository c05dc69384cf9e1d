#pragma once

#include <cstdint>

#include "buffer_map/normal_buffer_map.hpp"
#include "device/ptx.cuh"
#include "kernels/warp_copy.cuh"

// What normal-mode records carry besides the row. A dispatch record's small fields (FP8 scales, top-k ids and
// weights, the source index) are one lane's share in registers. A warp loads them before the row's copy and
// stores them after it, so their loads travel with the row's first loads: a record costs the row's round
// trips only. (Loaded and stored field by field after the row, each loop of loads followed by its stores cost
// a round trip more: two to three per record, as many as an FP8 row's own.)
namespace epx::kernels {

// Scales a lane holds (two): rows of up to 64 scale words, e.g. hidden 8,192 at 128-channel blocks. Words
// past them are copied after the row, a round trip each 32.
constexpr int kScaleWordsPerLane = 2;
constexpr int kScalesInRegisters = kScaleWordsPerLane * 32;

struct RecordFields {
  uint32_t scales[kScaleWordsPerLane];  // words lane and lane + 32
  int topk_idx;                         // lanes < num_topk_idx: a global expert id
  float topk_weight;
  int src_idx;
};

// A global expert id as `rank`'s local expert id, or -1 when another rank (or nobody) holds it.
__device__ __forceinline__ int to_local_expert(int global_expert, int rank, int experts_per_rank) {
  const int local = global_expert - rank * experts_per_rank;
  return (global_expert >= 0 && local >= 0 && local < experts_per_rank) ? local : -1;
}

// A 4-byte word that peers may rewrite while the kernel runs (kCoherent: a queue record) or an input.
template <bool kCoherent>
__device__ __forceinline__ uint32_t load_word(const void* address) {
  return kCoherent ? device::ld_b32(address) : device::ld_nc_b32(address);
}

// Token `token`'s fields from the dispatch inputs.
__device__ __forceinline__ RecordFields load_input_fields(const NormalRecord& r, const float* x_scales,
                                                          const int64_t* topk_idx, const float* topk_weights,
                                                          int token, int lane) {
  RecordFields f{{0u, 0u}, -1, 0.0f, token};
  const float* scales = x_scales + static_cast<size_t>(token) * r.num_scales;
#pragma unroll
  for (int i = 0; i < kScaleWordsPerLane; ++i) {
    if (lane + 32 * i < r.num_scales) f.scales[i] = load_word<false>(scales + lane + 32 * i);
  }
  if (lane < r.num_topk_idx) {
    const size_t k = static_cast<size_t>(token) * r.num_topk_idx + lane;
    f.topk_idx = static_cast<int>(static_cast<int64_t>(device::ld_nc_b64(topk_idx + k)));
    if (topk_weights != nullptr) f.topk_weight = __uint_as_float(load_word<false>(topk_weights + k));
  }
  return f;
}

// The fields of the queue record at `record`.
__device__ __forceinline__ RecordFields load_record_fields(const NormalRecord& r, const char* record,
                                                           int lane) {
  RecordFields f{{0u, 0u}, -1, 0.0f, 0};
  const char* scales = record + r.scales_offset();
#pragma unroll
  for (int i = 0; i < kScaleWordsPerLane; ++i) {
    if (lane + 32 * i < r.num_scales) f.scales[i] = load_word<true>(scales + 4 * (lane + 32 * i));
  }
  if (lane < r.num_topk_idx) {
    f.topk_idx = static_cast<int>(load_word<true>(record + r.topk_idx_offset() + 4 * lane));
    f.topk_weight = __uint_as_float(load_word<true>(record + r.topk_weights_offset() + 4 * lane));
  }
  if (r.with_src_idx) f.src_idx = static_cast<int>(load_word<true>(record + r.src_idx_offset()));
  return f;
}

// Stores the token's scale words to `out`: those `f` holds, then [kScalesInRegisters, num_scales) from
// `scales` (the token's, read after the row).
template <bool kCoherent>
__device__ __forceinline__ void store_scale_words(uint32_t* out, const RecordFields& f, const void* scales,
                                                  int num_scales, int lane) {
#pragma unroll
  for (int i = 0; i < kScaleWordsPerLane; ++i) {
    if (lane + 32 * i < num_scales) out[lane + 32 * i] = f.scales[i];
  }
  for (int g = kScalesInRegisters + lane; g < num_scales; g += 32)
    out[g] = load_word<kCoherent>(static_cast<const uint32_t*>(scales) + g);
}

// Stores `f` into the dispatch record at `record` (top-k ids as int32). `scales`: the token's scales, for
// words past the registers.
template <bool kCoherent>
__device__ __forceinline__ void store_record_fields(char* record, const NormalRecord& r,
                                                    const RecordFields& f, const void* scales, int lane) {
  store_scale_words<kCoherent>(reinterpret_cast<uint32_t*>(record + r.scales_offset()), f, scales,
                               r.num_scales, lane);
  if (lane < r.num_topk_idx) {
    reinterpret_cast<int*>(record + r.topk_idx_offset())[lane] = f.topk_idx;
    reinterpret_cast<float*>(record + r.topk_weights_offset())[lane] = f.topk_weight;
  }
  if (lane == 0 && r.with_src_idx) *reinterpret_cast<int*>(record + r.src_idx_offset()) = f.src_idx;
}

// Where a received row's fields go (recv_topk_idx may be null: no top-k outputs; recv_src_idx null: a
// cached dispatch into the output window, whose handle holds them already).
struct FieldOutputs {
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
};

// Stores `f` as output row `row`: its scales, its top-k as `rank`'s local expert ids (-1 and weight 0 for
// other ranks' experts) and its source index. `scales`: where the token's scales are, for words past the
// registers.
template <bool kCoherent>
__device__ __forceinline__ void store_output_fields(const FieldOutputs& out, const NormalRecord& r, int row,
                                                    const RecordFields& f, const void* scales, int rank,
                                                    int experts_per_rank, int lane) {
  store_scale_words<kCoherent>(
      reinterpret_cast<uint32_t*>(out.recv_x_scales + static_cast<size_t>(row) * r.num_scales), f, scales,
      r.num_scales, lane);
  const int num_topk = r.num_topk_idx;
  if (out.recv_topk_idx != nullptr && lane < num_topk) {
    const int local = to_local_expert(f.topk_idx, rank, experts_per_rank);
    out.recv_topk_idx[static_cast<size_t>(row) * num_topk + lane] = local;
    out.recv_topk_weights[static_cast<size_t>(row) * num_topk + lane] = local >= 0 ? f.topk_weight : 0.0f;
  }
  if (lane == 0 && out.recv_src_idx != nullptr) out.recv_src_idx[row] = f.src_idx;
}

// Copies token `token` (row, scales, top-k ids as int32 and weights, its index) into the dispatch record at
// `record` with the warp's plain stores (a peer's queue over NVLink, or a local staging slot).
__device__ __forceinline__ void write_token_record(char* record, const NormalRecord& r, const void* x,
                                                   const float* x_scales, const int64_t* topk_idx,
                                                   const float* topk_weights, int token, int lane) {
  const RecordFields fields = load_input_fields(r, x_scales, topk_idx, topk_weights, token, lane);
  warp_copy<false>(record, static_cast<const char*>(x) + static_cast<size_t>(token) * r.x_bytes, r.x_bytes,
                   lane);
  store_record_fields<false>(record, r, fields, x_scales + static_cast<size_t>(token) * r.num_scales, lane);
}

// Copies combine input row `row` (the expert output and its top-k weights) into the combine record at
// `record`, the weight's load first as above.
__device__ __forceinline__ void write_combine_record(char* record, const NormalRecord& r, const void* x,
                                                     const float* topk_weights, size_t row, int lane) {
  const bool has_weight = lane < r.num_topk_weights;
  const uint32_t weight = has_weight ? load_word<false>(topk_weights + row * r.num_topk_weights + lane) : 0u;
  warp_copy<false>(record, static_cast<const char*>(x) + row * r.x_bytes, r.x_bytes, lane);
  if (has_weight) reinterpret_cast<uint32_t*>(record + r.topk_weights_offset())[lane] = weight;
}

}  // namespace epx::kernels
