#pragma once

// LogFMT-10 coding on the device, as the low-latency combine sends and receives it: a warp encodes a row's
// groups (each lane four values, the codes assembled into the group's stream with shuffles), and the receive
// decodes a returned row 8 channels at a time. The number format itself (a group's parameters, a value's
// code, packed rows) is src/formats/logfmt.hpp's, which the CPU reference shares.
#include <cstddef>
#include <cstdint>

#include "formats/logfmt.hpp"
#include "kernels/low_latency_common.cuh"

namespace epx::kernels {

namespace {

using namespace low_latency;

// LogFMT on the wire, inside one combine slot (the format's fields, arranged for aligned stores):
//   payload of group g at g * 256: 160 bytes of codes, or the 256 bytes of BF16 of a fallback group
//   metadata of group g at G * 256 + 4 g: max_bits | min_bits << 16 (max_bits = marker for a fallback)
// G * 260 bytes in all, which is what LowLatencyBufferMap::combine_slot_bytes() reserves.
constexpr int kLogfmtPayloadStride = kLogfmtGroupSize * 2;
constexpr int kLogfmtCodeWords = kLogfmtCodeBytes / 4;  // 40

// A LogFMT group's constants in shared memory, computed once per group by one thread and read by the lanes
// that encode or decode its values (each costs two reproducible log2 splits and three divisions, which a
// lane per chunk or per group would otherwise repeat). max_bits = kLogfmtFallbackMarker: a BF16 group.
struct alignas(16) LogfmtDecodeConstants {
  LogfmtParams params;
};
struct alignas(16) LogfmtEncodeConstants {
  LogfmtParams params;
  LogfmtFastEncode fast;
};

// A copy of shared-memory constants in registers, read with vector loads once: through a reference, the
// compiler reloads each field inside the branches that use it, once per value.
template <typename Constants>
__device__ __forceinline__ Constants in_registers(const Constants& shared) {
  static_assert(sizeof(Constants) % sizeof(int4) == 0);
  int4 words[sizeof(Constants) / sizeof(int4)];
#pragma unroll
  for (int i = 0; i < int(sizeof(Constants) / sizeof(int4)); ++i)
    words[i] = reinterpret_cast<const int4*>(&shared)[i];
  Constants copy;
  memcpy(&copy, words, sizeof(copy));
  return copy;
}

// Where group `group`'s payload starts in a LogFMT slot: at 256 g, or in a packed row (logfmt.hpp) after the
// payloads of the groups before it, `fallbacks_before` of them fallback groups.
__device__ __forceinline__ size_t logfmt_payload_offset(int group, bool packed, int fallbacks_before) {
  return packed ? logfmt_packed_offset(group, fallbacks_before) : size_t(group) * kLogfmtPayloadStride;
}

// ---- Encode ----

// A lane's four codes, bit for bit logfmt_encode_value's: one hardware log2 settles most values
// (logfmt_encode_settled); the rest take the reference one per round, so the warp runs the reference as
// many times as its lane with the most unsettled values holds (often none or once), not four times.
__device__ __forceinline__ unsigned long long logfmt_encode4(const float (&values)[4],
                                                             const LogfmtParams& params,
                                                             const LogfmtFastEncode& fast) {
  // The mantissa is in [1, 2), never subnormal: the approximation without the subnormal fix-up.
  const auto log2_mantissa = [](float m) {
    float log2_m;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(log2_m) : "f"(m));
    return log2_m;
  };
  int codes[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) codes[i] = logfmt_encode_settled(values[i], params, fast, log2_mantissa);
  for (;;) {
    // The first unsettled value, picked with selects so that values and codes stay in registers.
    const int pick = codes[0] < 0 ? 0 : codes[1] < 0 ? 1 : codes[2] < 0 ? 2 : codes[3] < 0 ? 3 : -1;
    if (!__any_sync(kFullMask, pick >= 0)) break;
    if (pick >= 0) {
      const float x = pick == 0 ? values[0] : pick == 1 ? values[1] : pick == 2 ? values[2] : values[3];
      const int code = logfmt_encode_value(x, params);
#pragma unroll
      for (int i = 0; i < 4; ++i) codes[i] = pick == i ? code : codes[i];
    }
  }
  return logfmt_pack_codes4(static_cast<uint16_t>(codes[0]), static_cast<uint16_t>(codes[1]),
                            static_cast<uint16_t>(codes[2]), static_cast<uint16_t>(codes[3]));
}

// Group `group` of a row (lane l holds channels 4l..4l+3 in `raw`) into its payload (at `payload`) and
// metadata word.
__device__ __forceinline__ void encode_logfmt_group(char* payload, uint32_t* meta, int group, const uint2 raw,
                                                    const LogfmtEncodeConstants& constants, int lane) {
  if (constants.params.max_bits == kLogfmtFallbackMarker) {  // warp-uniform
    reinterpret_cast<uint2*>(payload)[lane] = raw;
    if (lane == 0) meta[group] = kLogfmtFallbackMarker;
    return;
  }
  const float values[4] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xFFFF0000u),
                           __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xFFFF0000u)};
  const unsigned long long packed = logfmt_encode4(values, constants.params, constants.fast);
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    const int word = lane + 32 * round;
    const int bit = 32 * min(word, kLogfmtCodeWords - 1);
    const int src_lane = bit / 40;
    const int shift = bit - 40 * src_lane;
    const unsigned long long low = __shfl_sync(kFullMask, packed, src_lane);
    const unsigned long long high = __shfl_sync(kFullMask, packed, min(src_lane + 1, 31));
    if (word < kLogfmtCodeWords)
      reinterpret_cast<uint32_t*>(payload)[word] =
          static_cast<uint32_t>((low >> shift) | (high << (40 - shift)));
  }
  if (lane == 0)
    meta[group] = constants.params.max_bits | (static_cast<uint32_t>(constants.params.min_bits) << 16);
}

// Reduce-scatter of 8 key words (logfmt_key_word) per lane over the warp with max_u16x2 (order-independent):
// returns word (lane >> 2) reduced over all 32 lanes, in 5 rounds of 4 + 2 + 1 + 1 + 1 shuffles (8 separate
// reductions take 40).
__device__ __forceinline__ uint32_t reduce_scatter8(uint32_t (&keys)[8], int lane) {
#pragma unroll
  for (int half = 4; half >= 1; half /= 2) {
    const int offset = 4 * half;  // 16, 8, 4: the upper half of lanes keeps the upper half of the keys
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const uint32_t sent = upper ? keys[j] : keys[j + half];
      const uint32_t kept = upper ? keys[j + half] : keys[j];
      keys[j] = max_u16x2(kept, __shfl_xor_sync(kFullMask, sent, offset));
    }
  }
  uint32_t key = keys[0];
  key = max_u16x2(key, __shfl_xor_sync(kFullMask, key, 2));
  return max_u16x2(key, __shfl_xor_sync(kFullMask, key, 1));
}

// A group's encode constants from its reduced key word (logfmt_key_word), into the warp's scratch. Not
// inlined: the lone-group and the batch path share one copy.
__device__ __noinline__ void store_encode_constants(LogfmtEncodeConstants& constants, uint32_t key) {
  const float max_key = logfmt_max_key_of(key);
  if (!logfmt_group_qualifies(max_key)) {
    constants.params.max_bits = kLogfmtFallbackMarker;
    return;
  }
  constants.params = logfmt_params(max_key, logfmt_min_key_of(key));
  constants.fast = logfmt_fast_encode_setup(constants.params);
}

// ---- Decode ----

// Channels 8q..8q+7 of a returned LogFMT row as loaded: codes 8q..8q+7 (bits [80q, 80q + 80) of the
// group's code stream, bytes 10q.. (2-byte aligned), in words x, y, z) or, in a fallback group, the chunk's
// 8 BF16 values.
struct LogfmtChunk {
  int4 words;
};

// Chunk `chunk` of a returned row whose group (its payload at `payload`) is a fallback (BF16) group or not.
__device__ __forceinline__ LogfmtChunk load_logfmt_chunk(const char* payload, int chunk, bool fallback) {
  const int q = chunk % 16;  // 8-channel chunk inside the group
  if (fallback) return {__ldcg(reinterpret_cast<const int4*>(payload) + q)};
  const unsigned short* halves = reinterpret_cast<const unsigned short*>(payload + 10 * q);
  return {make_int4(static_cast<int>(__ldcg(halves) | (static_cast<uint32_t>(__ldcg(halves + 1)) << 16)),
                    static_cast<int>(__ldcg(halves + 2) | (static_cast<uint32_t>(__ldcg(halves + 3)) << 16)),
                    static_cast<int>(__ldcg(halves + 4)), 0)};
}

// Code j (0..7) of a chunk's 80 code bits: bits 0..63 in `low`, 64..79 in `high`.
__device__ __forceinline__ uint16_t code_of_80(unsigned long long low, uint32_t high, int j) {
  const int bit = 10 * j;
  const uint32_t code = bit + 10 <= 64 ? static_cast<uint32_t>(low >> bit)
                        : bit >= 64    ? high >> (bit - 64)
                                       : static_cast<uint32_t>(low >> bit) | (high << (64 - bit));
  return static_cast<uint16_t>(code & 0x3FFu);
}

// The chunk's 8 values, as the reference's combine sees them, given its group's constants.
__device__ __forceinline__ void decode_logfmt_chunk(const LogfmtChunk& loaded,
                                                    const LogfmtDecodeConstants& constants, float* values) {
  const LogfmtParams& params = constants.params;
  if (params.max_bits == kLogfmtFallbackMarker) {
    unpack_bf16x8(loaded.words, values);
    return;
  }
  const unsigned long long low =
      static_cast<uint32_t>(loaded.words.x) |
      (static_cast<unsigned long long>(static_cast<uint32_t>(loaded.words.y)) << 32);
  const uint32_t high = static_cast<uint32_t>(loaded.words.z);
#pragma unroll
  for (int j = 0; j < 8; ++j) values[j] = logfmt_decode_value(code_of_80(low, high, j), params);
}

// A returned group's decode constants from its metadata word (max_bits = the marker for a BF16 group).
__device__ __forceinline__ LogfmtDecodeConstants returned_group_constants(uint32_t meta) {
  LogfmtDecodeConstants constants;
  const uint16_t max_bits = static_cast<uint16_t>(meta & 0xFFFFu);
  if (max_bits == kLogfmtFallbackMarker) {
    constants.params.max_bits = kLogfmtFallbackMarker;
  } else {
    constants.params = logfmt_params_from_meta(max_bits, static_cast<uint16_t>(meta >> 16));
  }
  return constants;
}

}  // namespace

}  // namespace epx::kernels
