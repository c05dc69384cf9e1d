#pragma once

#include "core/abort_word.hpp"
#include "core/shape_fingerprint.hpp"
#include "device/wait.cuh"

// Cross-rank agreement on shapes (core/shape_fingerprint.hpp): a sender posts its fingerprint into the
// receiver's abort-words allocation, in a slot of its own, before the signal that publishes its data; the
// receiver compares it after acquiring that signal. Only ranks of this NVLink node are checked (the
// allocation is mapped there).
namespace epx::kernels {

// Writes `mine` into `slot` (one thread). Plain stores: the caller's signal releases them.
__device__ __forceinline__ void post_shape(ShapeFingerprint* slot, const ShapeFingerprint& mine) {
  slot->hash = mine.hash;
#pragma unroll
  for (int i = 0; i < kNumShapeFields; ++i) slot->values[i] = mine.values[i];
}

// The slow part of check_shape: names the field and gives up.
__device__ __forceinline__ void report_shape_mismatch(const device::WaitContext& ctx, int peer,
                                                      const ShapeFingerprint& mine,
                                                      const volatile ShapeFingerprint* theirs) {
  ShapeFingerprint copy{};
  copy.hash = theirs->hash;
  for (int i = 0; i < kNumShapeFields; ++i) copy.values[i] = theirs->values[i];
  const int field = first_differing_field(mine, copy);
  const int index = field < 0 ? 0 : field;
  device::raise_abort(ctx, peer, WaitPhase::kShapeMismatch, mine.values[index], copy.values[index], 0, index);
}

// After acquiring `peer`'s signal: true when the fingerprint it posted in `slot` is this rank's; else records
// the first field that differs and aborts the group (every rank checks, so every rank reports).
__device__ __forceinline__ bool check_shape(const device::WaitContext& ctx, int peer,
                                            const ShapeFingerprint& mine, const ShapeFingerprint* slot) {
  if (*reinterpret_cast<const volatile int32_t*>(&slot->hash) == mine.hash) return true;
  report_shape_mismatch(ctx, peer, mine, slot);
  return false;
}

}  // namespace epx::kernels
