#pragma once

#include "common/host_device.hpp"

// How a within-node combine divides a channel's work between its two blocks. The sender block sends the
// rows this rank received back to their sources and, with the warps sending does not need, reduces a share
// of the channel's tokens beside the reducer block: a reducer reads two rows per token (its own copy and the
// peer's) where a sender reads one, and a block's reads are what bound it (~46 GB/s per SM, docs/
// BENCHMARKS.md), so a reducer block alone is the long pole. Plain arithmetic shared by the kernel and the
// CPU tests (tests/cpu/test_combine_warp_roles.cpp).
namespace epx::kernels {

struct CombineSenderRoles {
  int send;    // warps sending to the peers (the first ones)
  int reduce;  // warps reducing the sender block's share of the tokens (the last ones)
};

// The reducing warps of a sender block of `queue_warps` when not told (EPX_COMBINE_SENDER_REDUCE_WARPS): with
// 2 ranks a quarter, so that both blocks read about as much (the reducer 16 warps' share of two rows per
// token, the sender one row per token and its 4 warps' share of two); with more ranks the warps that no
// peer's group takes (queue_warps % (ranks - 1)), which would idle otherwise.
EPX_HD int default_combine_sender_reduce_warps(int queue_warps, int num_ranks) {
  if (num_ranks == 2) return queue_warps / 4;
  return num_ranks > 2 ? queue_warps % (num_ranks - 1) : 0;
}

// `requested` reducing warps (-1: the default) of a sender block of `queue_warps`, bounded so that every peer
// keeps a sending warp; none with one rank (both blocks reduce then, without queues).
EPX_HD CombineSenderRoles combine_sender_roles(int queue_warps, int num_ranks, int requested) {
  if (num_ranks <= 1) return {queue_warps, 0};
  int reduce = requested >= 0 ? requested : default_combine_sender_reduce_warps(queue_warps, num_ranks);
  const int most = queue_warps - (num_ranks - 1);
  if (reduce > most) reduce = most;
  if (reduce < 0) reduce = 0;
  return {queue_warps - reduce, reduce};
}

// A channel's tokens in batches that alternate between the two reducing parts: part 0 (the reducer block)
// takes `first` tokens, part 1 (the sender block's reducing warps) the next `second`, and so on. A batch of
// each part waits only for its own tokens' copies; each part tells a source how far it no longer needs the
// source's queue (its next batch's first record), and the source writes up to the smaller of the two plus
// the queue's size. NOTES: every record a batch waits for fits in the queue (a batch's records <= its
// tokens <= queue_tokens), and the part whose batch is earlier never waits for the other, so no chunk size
// deadlocks; batches of at most a quarter of the queue let the sender refill it while both parts reduce.
struct CombineBatches {
  int per_warp;  // tokens a warp streams per batch
  int warps[2];  // warps of each part that take tokens (the rest idle)
  int size[2];   // tokens of each part's batch
  EPX_HD int cycle() const { return size[0] + size[1]; }
  // Where part `part`'s batch k starts, from the channel's first token.
  EPX_HD int start(int part, int k) const { return k * cycle() + (part == 1 ? size[0] : 0); }
};

constexpr int kMaxCombineTokensPerWarp = 4;

EPX_HD CombineBatches combine_batches(int queue_tokens, int reducer_warps, int sender_reduce_warps) {
  CombineBatches b{};
  const int quarter = queue_tokens / (4 * reducer_warps);
  b.per_warp = quarter < 1 ? 1 : (quarter < kMaxCombineTokensPerWarp ? quarter : kMaxCombineTokensPerWarp);
  const int counts[2] = {reducer_warps, sender_reduce_warps};
  for (int part = 0; part < 2; ++part) {
    b.warps[part] = counts[part] < queue_tokens ? counts[part] : queue_tokens;
    b.size[part] = b.warps[part] * b.per_warp;
  }
  return b;
}

}  // namespace epx::kernels
