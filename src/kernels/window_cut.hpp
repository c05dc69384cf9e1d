#pragma once

#include "common/host_device.hpp"
#include "formats/bits.hpp"

// How much of a window of tokens a sender may take when a destination's queue has room for only so many:
// plain bit arithmetic shared by the kernels and the CPU tests (tests/cpu/test_window_cut.cpp). A window is
// up to 32 tokens, one per lane; `needs` has a bit for each token the destination takes.
namespace epx::kernels {

// The bits of tokens [0, width) of a window (width in [0, 32]).
EPX_HD unsigned window_bits(int width) {
  return width >= 32 ? ~0u : (1u << width) - 1u;
}

// The tokens [0, result) of a window of `full` a sender may take when the destination needs those of `needs`
// and has room for `room` more: all of them, or up to (not including) the first one past the room. Tokens it
// does not need pass freely, so a cut window ends right before a needed token.
EPX_HD int tokens_within_room(unsigned needs, int room, int full) {
  if (popcount32(needs) <= room) return full;
  for (int i = 0; i < room; ++i) needs &= needs - 1;  // drop the ones that fit
  const int first_past = lowest_set_bit32(needs);
  return first_past < full ? first_past : full;
}

}  // namespace epx::kernels
