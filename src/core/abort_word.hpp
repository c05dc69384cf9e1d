#pragma once

#include <cstdint>
#include <string>

#include "common/host_device.hpp"
#include "core/shape_fingerprint.hpp"
#include "core/wait_record.hpp"

namespace epx {

// The abort word: one int per rank in device memory that every rank of its NVLink node maps. 0 while the
// group runs. The first wait of any rank that gives up (a timeout, a capacity error) writes a description of
// its cause into its own word and every word it reaches; every bounded wait polls its own rank's word and
// stops waiting once it is set, so one rank's failure releases the others instead of leaving them to time
// out one after another. Only Buffer::reset() clears it.
//
// NOTES: the cause is packed into the word itself (one 32-bit store or CAS, no ordering between several
// words to get right): bit 30 marks it set, bits 16..23 hold the phase, bits 8..15 the peer + 1 (the
// capacity check names peer -1), bits 0..7 the rank that gave up.
struct AbortCause {
  int rank = 0;  // the rank whose wait gave up first
  int peer = 0;  // the peer it waited for (-1: none, e.g. the capacity check)
  WaitPhase phase = WaitPhase::kNone;
};

constexpr int32_t kAbortWordSet = 1 << 30;

EPX_HD int32_t encode_abort_word(int rank, int peer, WaitPhase phase) {
  return kAbortWordSet | ((static_cast<int32_t>(phase) & 0xff) << 16) | (((peer + 1) & 0xff) << 8) |
         (rank & 0xff);
}

EPX_HD bool abort_word_is_set(int32_t word) {
  return word != 0;
}

EPX_HD AbortCause decode_abort_word(int32_t word) {
  AbortCause cause;
  cause.rank = word & 0xff;
  cause.peer = ((word >> 8) & 0xff) - 1;
  cause.phase = static_cast<WaitPhase>((word >> 16) & 0xff);
  return cause;
}

// The small allocation every rank of a node maps (Buffer: "abort words"): the abort word, then the shape
// fingerprints peers post (core/shape_fingerprint.hpp), one slot per sender so no two ranks write the same.
struct AbortWordsMap {
  static constexpr int kMaxRanks = 64;  // kMaxLowLatencyRanks
  static constexpr size_t kWordOffset = 0;
  // [2 notify parities][src]: normal-mode dispatch notify.
  static constexpr size_t kNormalShapesOffset = 128;
  // [2 halves][2 ops][src]: low-latency dispatch and combine.
  static constexpr size_t kLowLatencyShapesOffset =
      kNormalShapesOffset + sizeof(ShapeFingerprint) * 2 * kMaxRanks;
  // [src]: normal-mode dispatch and combine launches (the latest launch of each source).
  static constexpr size_t kNormalLaunchShapesOffset =
      kLowLatencyShapesOffset + sizeof(ShapeFingerprint) * 4 * kMaxRanks;
  static constexpr size_t kBytes = kNormalLaunchShapesOffset + sizeof(ShapeFingerprint) * kMaxRanks;

  EPX_HD static ShapeFingerprint* normal_shape(void* base, int parity, int src) {
    return reinterpret_cast<ShapeFingerprint*>(static_cast<char*>(base) + kNormalShapesOffset) +
           parity * kMaxRanks + src;
  }
  EPX_HD static ShapeFingerprint* normal_launch_shape(void* base, int src) {
    return reinterpret_cast<ShapeFingerprint*>(static_cast<char*>(base) + kNormalLaunchShapesOffset) + src;
  }
  EPX_HD static ShapeFingerprint* low_latency_shape(void* base, int half, int op, int src) {
    return reinterpret_cast<ShapeFingerprint*>(static_cast<char*>(base) + kLowLatencyShapesOffset) +
           (half * 2 + op) * kMaxRanks + src;
  }
};

// Where a kernel finds the abort words: its own rank's, and every rank's as mapped on this GPU.
struct AbortWords {
  int* local = nullptr;         // this rank's word (device memory)
  int* const* peers = nullptr;  // device array [num_ranks]; nullptr for ranks outside this NVLink node
  int num_ranks = 0;
};

// "rank 2 gave up waiting for peer 1 in barrier" / "rank 0 hit the capacity check".
std::string describe_abort_cause(const AbortCause& cause);

// What the host says when it finds a peer's abort word set but no record of its own (the rank that, e.g.,
// skipped a call): "rank 1: the group was aborted: rank 0 gave up waiting for peer 1 in barrier".
std::string describe_abort_word(int rank, int32_t word);

}  // namespace epx
