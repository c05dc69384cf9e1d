#pragma once

#include "common/tagged_word.hpp"
#include "core/abort_word.hpp"
#include "core/shape_fingerprint.hpp"
#include "device/ptx.cuh"
#include "device/wait.cuh"

// Cross-rank agreement on shapes (core/shape_fingerprint.hpp): a sender posts its fingerprint into the
// receiver's abort-words allocation, in a slot of its own, before the signal that publishes its data; the
// receiver compares it after acquiring that signal. That allocation is mapped within an NVLink node; ranks on
// other nodes get the fingerprint through the symmetric buffer instead (internode_common.cuh,
// low_latency_common.cuh), and compare it with the same helpers.
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

// ---- Launch fingerprints over NVLink (normal mode): a launch posts its fingerprint to a peer at its start,
// the values into the peer's abort-words slot for this rank (`values`; nullptr: not mapped) and then a tagged
// word (the launch number, the hash) with release; the peer checks it before it reads this rank's first
// record of the launch. ----

// Whether a tagged launch word carries launch `launch` or a later one.
__device__ __forceinline__ bool launch_posted(uint64_t word, uint32_t launch) {
  return static_cast<int32_t>(tagged_sequence(word) - launch) >= 0;
}

// One thread.
__device__ __forceinline__ void post_launch_shape_to(ShapeFingerprint* values, uint64_t* tag, uint32_t launch,
                                                     const ShapeFingerprint& shape) {
  if (values != nullptr) post_shape(values, shape);
  device::st_release_sys_u64(tag, pack_tagged(launch, shape.hash));
}

// One thread, before reading `peer`'s records of launch `launch`: waits (bounded) for the peer's tagged word
// at `tag` and compares; false when the wait was abandoned or the fingerprint differs (then the group is
// aborted, naming the field; `values`: the peer's values, nullptr when not mapped: nothing to name, no
// report). A peer already in a later launch (it sent nothing more here) overwrote its word and is not
// checked.
__device__ __forceinline__ bool check_launch_shape_at(const device::WaitContext& ctx, int peer,
                                                      const uint64_t* tag, const ShapeFingerprint* values,
                                                      uint32_t launch, const ShapeFingerprint& shape,
                                                      WaitPhase phase) {
  uint64_t word = 0;
  const auto posted = [launch](uint64_t w) { return launch_posted(w, launch); };
  const bool arrived = device::spin_until_loaded(
      [tag] { return device::ld_acquire_sys_u64(tag); }, posted,
      [](uint64_t w) { return static_cast<int64_t>(tagged_sequence(w)); }, launch, ctx, peer, phase, word);
  if (!arrived || tagged_sequence(word) != launch || tagged_value(word) == shape.hash) return arrived;
  if (values == nullptr) return true;
  report_shape_mismatch(ctx, peer, shape, values);
  return false;
}

}  // namespace epx::kernels
