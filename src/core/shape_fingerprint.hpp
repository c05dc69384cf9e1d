#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace epx {

// What every rank of a collective call must agree on. A rank posts its fingerprint next to what it tells its
// peers (normal mode: with the counts of notify; low latency: with the receive flags), and every receiver
// compares it with its own: shapes that differ between ranks become an error on every rank, never a write
// through offsets computed from another shape.
enum class ShapeField : int32_t {
  kHidden = 0,
  kRowBytes = 1,   // bytes of one token row (BF16 or FP8 x, or raw bytes)
  kNumScales = 2,  // scale words per row
  kNumTopk = 3,    // top-k columns the records carry
  kNumExperts = 4,
  kNumChannels = 5,  // normal mode: the channels of the config (num_sms / 2)
  kQueueTokens = 6,  // normal mode: records per queue (num_max_nvl_chunked_recv_tokens)
  kMaxTokens = 7,    // low latency: num_max_dispatch_tokens_per_rank (M)
  // low latency: FP8, rounded scales, UE8M0, listings, LogFMT (as the kernel runs it), pre-reduced, LogFMT
  // within the node bits; normal launches: operation and FP8; normal notify:
  // whether num_tokens_per_rank was given
  kFormat = 8,
  // normal mode across nodes: records per network queue (num_max_rdma_chunked_recv_tokens); a combine within
  // a node: the rows of its staging slot (buffer_map/combine_staging_map.hpp; 0: none)
  kNetworkQueueTokens = 9,
  kWarpRoles = 10,  // normal combine within a node: the reducing warps of each sender block
};
constexpr int kNumShapeFields = 11;

struct ShapeFingerprint {
  int32_t hash;  // of the values: receivers compare it first, one word
  int32_t values[kNumShapeFields];
};

// FNV-1a over the values; never 0, so a slot nobody wrote never matches.
EPX_HD int32_t shape_hash(const int32_t (&values)[kNumShapeFields]) {
  uint32_t hash = 2166136261u;
  for (int i = 0; i < kNumShapeFields; ++i) {
    const uint32_t value = static_cast<uint32_t>(values[i]);
    for (int byte = 0; byte < 4; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xffu;
      hash *= 16777619u;
    }
  }
  return static_cast<int32_t>(hash == 0 ? 1u : hash);
}

EPX_HD ShapeFingerprint make_shape_fingerprint(const int32_t (&values)[kNumShapeFields]) {
  ShapeFingerprint fingerprint{};
  for (int i = 0; i < kNumShapeFields; ++i) fingerprint.values[i] = values[i];
  fingerprint.hash = shape_hash(values);
  return fingerprint;
}

// The first field where `a` and `b` differ, or -1.
EPX_HD int first_differing_field(const ShapeFingerprint& a, const ShapeFingerprint& b) {
  for (int i = 0; i < kNumShapeFields; ++i)
    if (a.values[i] != b.values[i]) return i;
  return -1;
}

// "num_experts", "hidden", ... ("?" outside the enum).
const char* shape_field_name(int field);

}  // namespace epx
