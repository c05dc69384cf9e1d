#pragma once

#include "common/host_device.hpp"

// How a within-node dispatch's sender block divides its warps between sending and copying rows this rank
// keeps (DispatchArgs::sender_own_warps): plain arithmetic shared by the kernel and the CPU tests
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

// The own-row warps a within-node dispatch asks for when not told (EPX_DISPATCH_SENDER_OWN_WARPS): measured
// on 2 x H100 (docs/BENCHMARKS.md, "Own rows in the sender blocks").
EPX_HD int default_sender_own_warps(int num_ranks, int num_channels) {
  (void)num_ranks;
  (void)num_channels;
  return 0;
}

}  // namespace epx::kernels
