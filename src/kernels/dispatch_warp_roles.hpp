#pragma once

#include "common/host_device.hpp"

// How a within-node dispatch's blocks divide their warps: the sender block between sending and copying rows
// this rank keeps (DispatchArgs::sender_own_warps), the receiver block between its own rows and a group per
// source (DispatchArgs::receiver_own_warps). Plain arithmetic shared by the kernel and the CPU tests
// (tests/cpu/test_dispatch_warp_roles.cpp).
namespace epx::kernels {

struct SenderWarpRoles {
  int send;  // warps sending to the peers (the first ones)
  int own;   // warps copying own rows beside the receiver block's (the last ones)
};

// `requested` own-row warps of a sender block of `queue_warps`, bounded so that every peer keeps a sending
// warp; none with one rank (both blocks copy then).
EPX_HD SenderWarpRoles sender_warp_roles(int queue_warps, int num_ranks, int requested) {
  int own = 0;
  if (num_ranks > 1 && requested > 0) {
    const int most = queue_warps - (num_ranks - 1);
    own = requested < most ? requested : (most > 0 ? most : 0);
  }
  return {queue_warps - own, own};
}

// The own-row warps of a sender block of `queue_warps` when not told (EPX_DISPATCH_SENDER_OWN_WARPS). With 2
// ranks a receiver block copies twice what its sender sends (the own rows and the arrived ones): a quarter of
// the sender's warps taking own rows was fastest at 8 to 24 SMs and no slower at 32 (2 x H100, 4,096 and
// 16,384 tokens; docs/BENCHMARKS.md). With more ranks the warps that no peer's group takes (queue_warps
// % (ranks - 1)), which would idle otherwise. Into the output window (`to_window`, `sender_blocks` blocks
// sending) the receiver block copies only own rows, with all its warps, and at 2 ranks the senders send with
// up to kWindowSendWarps warps in all, the rest of theirs copying own rows: every warp sending read 15-25 %
// faster than 12 of 16 at 8 and 16 SMs; with the window-posting kernel 168 sending warps in all (14 of 16
// at 24 SMs, 11 at 32) read 4-7 % faster than 192 at 24 and 32 SMs (2 x H200, docs/BENCHMARKS.md; more
// stores in flight than the link drains slow it down).
constexpr int kWindowSendWarps = 168;
EPX_HD int default_sender_own_warps(int queue_warps, int num_ranks, bool to_window = false,
                                    int sender_blocks = 1) {
  if (num_ranks == 2 && to_window) {
    const int blocks = sender_blocks > 0 ? sender_blocks : 1;
    const int send = (kWindowSendWarps + blocks - 1) / blocks;
    return send < queue_warps ? queue_warps - send : 0;
  }
  if (num_ranks == 2) return queue_warps / 4;
  return num_ranks > 2 ? queue_warps % (num_ranks - 1) : 0;
}

// The own-row warps of a receiver block of `queue_warps` when not told (EPX_DISPATCH_RECEIVER_OWN_WARPS): an
// equal share per rank, except BF16 rows with 2 ranks, where 4 of 16 (more warps on the arrived rows, the
// long pole) read 6 % faster at 8 and 16 SMs and no slower at 24 and 32; FP8 rows read 5-8 % slower with 4
// (2 x H100, docs/BENCHMARKS.md).
EPX_HD int default_receiver_own_warps(int queue_warps, int num_ranks, bool scaled_rows) {
  if (num_ranks == 2 && !scaled_rows) return queue_warps / 4;
  return queue_warps / (num_ranks > 0 ? num_ranks : 1);
}

struct ReceiverWarpRoles {
  int own;         // warps copying own rows (the first ones)
  int per_source;  // then a group of this many warps per source, in peer order; any warps left over idle
};

// A receiver block of `queue_warps`: `requested` own-row warps (the kernel passes the switch's value, else
// default_receiver_own_warps), at most what leaves every source a warp, and at least 1 unless the sender
// block has own-row warps (`sender_own` > 0): then 0 may leave every receiver warp to the sources, the
// sender's warps copying all the own rows. With one rank every warp copies own rows.
EPX_HD ReceiverWarpRoles receiver_warp_roles(int queue_warps, int num_ranks, int requested, int sender_own) {
  if (num_ranks <= 1) return {queue_warps, 0};
  const int peers = num_ranks - 1;
  int own = requested;
  const int most = queue_warps - peers;
  const int least = sender_own > 0 ? 0 : 1;
  if (own > most) own = most;
  if (own < least) own = least;
  return {own, (queue_warps - own) / peers};
}

}  // namespace epx::kernels
