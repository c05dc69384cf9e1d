#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace epx {

// Counts cross (to peers, to the host) as one 64-bit word: the sequence number of the notify that wrote it
// above the count. A reader polls until the word carries the sequence it expects, so neither a barrier nor
// a flag written after the counts is needed, and a word left by an earlier call is never taken for this
// one's. Sequences start at 1 and skip 0, so zeroed memory never matches.
EPX_HD uint64_t pack_tagged(uint32_t sequence, int value) {
  return (uint64_t(sequence) << 32) | uint32_t(value);
}
EPX_HD uint32_t tagged_sequence(uint64_t word) {
  return static_cast<uint32_t>(word >> 32);
}
EPX_HD int tagged_value(uint64_t word) {
  return static_cast<int>(static_cast<uint32_t>(word));
}
EPX_HD uint32_t next_sequence(uint32_t sequence) {
  return sequence + 1 == 0 ? 1 : sequence + 1;
}

}  // namespace epx
