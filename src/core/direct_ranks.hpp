#pragma once

#include <cstdint>
#include <vector>

namespace epx {

// The ranks a rank writes with plain stores, not the transport's puts, where sender and receiver must choose
// alike (low latency: a LogFMT row arrives packed from a rank that puts and in place from one that stores,
// and the receiver reads it by its own choice). `maps[r]`: bit q set where rank r's GPU maps rank q's
// buffer (the transport's load/store reach); `node`: the ranks of this rank's node, always mapped. Rank
// `rank` stores into q where both map each other; `puts_only` (EPX_INTERNODE_PUTS=1 on every rank) keeps
// the node's ranks only. Groups of at most 64 ranks.
inline uint64_t direct_ranks(const std::vector<uint64_t>& maps, int rank, uint64_t node, bool puts_only) {
  if (puts_only) return node;
  uint64_t both = 0;
  for (int q = 0; q < static_cast<int>(maps.size()); ++q) {
    const bool mine = ((maps[rank] >> q) & 1u) != 0;
    const bool theirs = ((maps[q] >> rank) & 1u) != 0;
    if (mine && theirs) both |= uint64_t{1} << q;
  }
  return both | node;
}

}  // namespace epx
