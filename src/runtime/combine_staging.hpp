#pragma once

#include "buffer_map/combine_staging_map.hpp"
#include "epx/buffer.hpp"
#include "epx/normal.hpp"
#include "kernels/peer_context.hpp"
#include "runtime/dispatch_handle_state.hpp"

namespace epx {

// A within-node combine through the staging area (buffer_map/combine_staging_map.hpp): what the host adds
// around the combine kernel's launch on the comm stream.

// This combine's staging map: disabled (bytes 0) without an area, with one rank, in worst-case mode (the
// host does not know what it returns to each peer), above 16 SMs (the handle's channels x 2; where SM stores
// are faster) unless EPX_COMBINE_STAGING=1, or with EPX_COMBINE_STAGING=0 (read once; every rank must agree:
// the launch's fingerprint carries the slot's rows).
CombineStagingMap combine_staging_map(const Buffer& buffer, const DispatchHandle::State& state, int hidden,
                                      int num_topk);

// Before the kernel's launch: the gate kernel on the comm stream, then the copies of the rows this rank
// returns to each peer whose rows fit (and their top-k weights when `in` has them), with a flag kernel after
// each chunk, on the staging stream (`peers`: the normal-mode kernels' context) forked from the comm stream.
// Returns whether anything was forked (then join_staged_copies must follow the launch).
bool start_staged_copies(Buffer& buffer, const kernels::PeerContext& peers,
                         const DispatchHandle::State& state, const CombineInput& in,
                         const CombineStagingMap& map);

// After the kernel's launch: the comm stream waits for the staging stream's copies and flags.
void join_staged_copies(Buffer& buffer);

}  // namespace epx
