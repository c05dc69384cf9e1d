#pragma once

// Low-latency dispatch: send phase (route, cast, write each token once per destination rank, publish) and
// receive phase (wait, expand rows into the packed per-expert output). See LowLatencyBufferMap for the
// protocol. Templated on the transport policy for ranks outside the NVLink node (low_latency_transport.cuh);
// the including file instantiates it.
#include <cuda_fp8.h>

#include "formats/bf16.hpp"
#include "formats/fp8.hpp"
#include "formats/ue8m0.hpp"
#include "gpu/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/low_latency_common.cuh"
#include "kernels/low_latency_transport.cuh"
#include "kernels/preload.hpp"
#include "kernels/warp_copy.cuh"

namespace epx::kernels {

namespace {

using namespace low_latency;

// Shared memory: a small fixed part, then one large area whose use depends on the phase.
struct DispatchSmallSmem {
  // Where this token's message is written: each mapped destination's receive slot, plus this rank's staging
  // slot when some destination is reached by puts.
  char* dst_msgs[kMaxTopk + 1];
  int num_dsts;
  int remote_dsts[kMaxTopk];  // destinations reached by puts from the staging slot
  int num_remote;
  int warp_sums[kNumWarps];
  unsigned long long masked;    // the rank mask as this launch sees it (load_rank_mask)
  unsigned long long left_out;  // sources the receive leaves out (wait_and_scan_counts)
  // How each source's wait ended, for the warps that poll its counts meanwhile: 0 still waiting, 1 arrived,
  // 2 left out or failed (wait_and_scan_counts).
  int source_state[kMaxLowLatencyRanks];
  int* dst_listings[kMaxTopk + 1];  // like dst_msgs, for the token's listings (dispatches with top-k weights)
  // peers.peer_bases, copied once per launch (the kernel's prologue): find_destinations takes a token's
  // destinations' bases from here, not from a global load on the sending blocks' chain. (The routing block's
  // stores read them from global memory: with these its lists came 0.1 us later at 128 tokens.)
  char* peer_bases[kMaxLowLatencyRanks];
};

size_t dispatch_smem_bytes(const LowLatencyBufferMap& map) {
  const size_t routing = sizeof(int) * size_t(kNumWarps) * map.num_experts;
  const size_t prefix = sizeof(int) * (size_t(map.num_experts) + 1);
  return align_up(sizeof(DispatchSmallSmem), 16) + (routing > prefix ? routing : prefix);
}

// ---- Send: routing ----

// The expert of entry `entry` the routing counts: its first listing, and not on a masked rank (else -1).
__device__ __forceinline__ int routed_expert(const LowLatencyDispatchArgs& args, int entry,
                                             unsigned long long masked, int64_t id) {
  const int expert = first_listed_expert(args.in.topk_idx, entry, args.topk, args.map.num_experts, id);
  return expert >= 0 && rank_masked(masked, args.map.expert_rank(expert)) ? -1 : expert;
}

// Lists staged for experts on ranks reached by puts go out once complete; `totals[e]` = list length.
template <typename Remote>
__device__ void put_staged_lists(const LowLatencyDispatchArgs& args, const int* totals) {
  const LowLatencyBufferMap& map = args.map;
  __syncthreads();
  for (int expert = threadIdx.x / 32; expert < map.num_experts; expert += kNumWarps) {
    const int dst = map.expert_rank(expert);
    const int count = totals[expert];
    if (count == 0 || is_direct<Remote>(args.peers, dst)) continue;
    Remote::put_warp(
        local_at<uint64_t>(args.peers, map.dispatch_recv_index_offset(args.half, map.local_expert_of(expert),
                                                                      args.peers.rank)),
        local_at<uint64_t>(args.peers, map.dispatch_send_index_offset(args.half, expert)),
        sizeof(uint64_t) * count, dst);
  }
}

// What a block's send reads first, loaded before the kernel's prologue barrier so that these round trips and
// the abort check's overlap. The routing block: each lane's first top-k entry of its warp's segment. A
// sending block: warp 0's top-k entries of its first token (lane < K) and every thread's first 16 channels of
// it.
struct SendPreload {
  bool first_token = false;  // a sending block's: id, v0 and v1 are of token blockIdx.x
  int64_t id = -1;
  int4 v0{}, v1{};
};

// Up to this many top-k entries (one per lane of the routing block's warp 0) the routing runs in that warp
// alone (route_few_entries): at 1 token the block-wide histogram's rounds were the chain's longest step.
constexpr int kFewEntries = 32;

// The entries [begin, end) of the T*K top-k entries warp `warp` of the routing block histograms (at most
// kFewEntries: all of them warp 0's).
__device__ __forceinline__ WordRange routing_segment(const LowLatencyDispatchArgs& args, int warp) {
  const int num_entries = args.in.num_tokens * args.in.num_topk;
  const int per_warp = num_entries <= kFewEntries ? kFewEntries : (num_entries + kNumWarps - 1) / kNumWarps;
  const int begin = min(num_entries, warp * per_warp);
  return {begin, min(num_entries, begin + per_warp)};
}

__device__ __forceinline__ SendPreload preload_send(const LowLatencyDispatchArgs& args) {
  SendPreload pre;
  const int lane = threadIdx.x % 32;
  if (blockIdx.x == gridDim.x - 1) {
    const WordRange segment = routing_segment(args, static_cast<int>(threadIdx.x) / 32);
    if (segment.begin + lane < segment.end) pre.id = args.in.topk_idx[segment.begin + lane];
    return pre;
  }
  const int token = static_cast<int>(blockIdx.x);
  if (token >= args.in.num_tokens) return pre;
  pre.first_token = true;
  if (threadIdx.x < 32 && lane < args.in.num_topk)
    pre.id = args.in.topk_idx[size_t(token) * args.in.num_topk + lane];
  const int group = threadIdx.x / 8;  // send_tokens' first group of this thread
  if (group < args.map.num_groups()) {
    const int4* row = static_cast<const int4*>(args.in.x) + size_t(token) * args.map.hidden / 8;
    const int chunk = group * 16 + threadIdx.x % 8 * 2;
    pre.v0 = device::ld_nc_v4(row + chunk);
    pre.v1 = device::ld_nc_v4(row + chunk + 1);
  }
  return pre;
}

// Expert `expert`'s list length into the count word its owner polls, under this call's `tag` (nothing goes to
// a masked rank).
template <typename Remote>
__device__ __forceinline__ void store_list_length(const LowLatencyDispatchArgs& args,
                                                  unsigned long long masked, uint64_t tag, int expert,
                                                  int length) {
  const LowLatencyBufferMap& map = args.map;
  const int dst = map.expert_rank(expert);
  if (rank_masked(masked, dst)) return;
  const size_t offset =
      map.dispatch_recv_count_offset(args.half, map.local_expert_of(expert), args.peers.rank);
  const uint64_t word = pack_low_latency_word(tag, length);
  if (is_direct<Remote>(args.peers, dst)) {
    device::st_relaxed_sys_u64(peer_at<uint64_t>(args.peers, dst, offset), word);
  } else {
    Remote::put_u64(local_at<uint64_t>(args.peers, offset), word, dst);
  }
}

// Top-k entry `entry` at `slot` of expert `expert`'s list, under this call's `tag`: in the owner's receive
// index when it is mapped, else staged here for put_staged_lists.
template <typename Remote>
__device__ __forceinline__ void write_list_entry(const LowLatencyDispatchArgs& args, uint64_t tag, int expert,
                                                 int slot, int entry) {
  const LowLatencyBufferMap& map = args.map;
  const int dst = map.expert_rank(expert);
  const uint64_t word = pack_low_latency_word(
      tag,
      pack_recv_index_entry(static_cast<int>(args.topk.div(entry)), static_cast<int>(args.topk.mod(entry))));
  if (is_direct<Remote>(args.peers, dst)) {
    device::st_relaxed_sys_u64(
        peer_at<uint64_t>(
            args.peers, dst,
            map.dispatch_recv_index_offset(args.half, map.local_expert_of(expert), args.peers.rank)) +
            slot,
        word);
  } else {
    local_at<uint64_t>(args.peers, map.dispatch_send_index_offset(args.half, expert))[slot] = word;
  }
}

// route_entries for at most kFewEntries entries: warp 0 holds them all (lane = entry, its id preloaded), so a
// listing's first occurrence in its token and its slot in its expert's list come from two matches, with no
// histogram, scan or load of the token's other ids; the block then stores every expert's list length.
template <typename Remote>
__device__ void route_few_entries(const LowLatencyDispatchArgs& args, int* lengths, unsigned long long masked,
                                  uint64_t tag, const SendPreload& pre) {
  const LowLatencyBufferMap& map = args.map;
  const int num_experts = map.num_experts;
  for (int expert = threadIdx.x; expert < num_experts; expert += kNumThreads) lengths[expert] = 0;
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const int token = static_cast<int>(args.topk.div(lane));
    int expert = lane < args.in.num_tokens * args.in.num_topk ? expert_of(pre.id, num_experts) : -1;
    // A lower lane of the same token listing the same expert: not this listing's first occurrence. (token <
    // 32: a key per (expert, token).)
    const unsigned same_listing = __match_any_sync(kFullMask, expert < 0 ? -1 : expert * 32 + token);
    if ((same_listing & ((1u << lane) - 1u)) != 0 ||
        (expert >= 0 && rank_masked(masked, map.expert_rank(expert)))) {
      expert = -1;
    }
    const unsigned same = __match_any_sync(kFullMask, expert);
    if (expert >= 0) {
      write_list_entry<Remote>(args, tag, expert, __popc(same & ((1u << lane) - 1u)), lane);
      if (lane == __ffs(same) - 1) lengths[expert] = __popc(same);
    }
  }
  __syncthreads();
  stamp_phase(args.phase_stamps, kStampHistogram);
  for (int expert = threadIdx.x; expert < num_experts; expert += kNumThreads)
    store_list_length<Remote>(args, masked, tag, expert, lengths[expert]);
  stamp_phase(args.phase_stamps, kStampCountsStored);
  if constexpr (Remote::kEnabled) put_staged_lists<Remote>(args, lengths);
  stamp_phase(args.phase_stamps, kStampCounted);
}

// For every expert e, the ordered list of this rank's (token, top-k position) entries that chose it (first
// listing only), and its length, written into the rank that owns e. Entry order = ascending token, so a
// token's slot in the list is the number of earlier entries with the same expert. One block computes it:
// every warp histograms a contiguous segment of the T*K entries, a scan over warps gives each warp's base per
// expert, and a second pass assigns slots with __match_any_sync ranks.
template <typename Remote>
__device__ void route_entries(const LowLatencyDispatchArgs& args, int* hist, unsigned long long masked,
                              uint64_t tag, const SendPreload& pre) {
  const LowLatencyBufferMap& map = args.map;
  const int num_experts = map.num_experts;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (args.in.num_tokens * args.in.num_topk <= kFewEntries) {
    route_few_entries<Remote>(args, hist, masked, tag, pre);
    return;
  }

  for (int i = threadIdx.x; i < kNumWarps * num_experts; i += kNumThreads) hist[i] = 0;
  __syncthreads();
  const WordRange segment = routing_segment(args, warp);
  const int seg_begin = segment.begin;
  const int seg_end = segment.end;
  int* warp_hist = hist + warp * num_experts;

  // The first kCachedRounds rounds' experts stay in registers for the second pass (no second round trip).
  constexpr int kCachedRounds = 4;
  int cached[kCachedRounds];
  int round = 0;
  for (int base = seg_begin; base < seg_end; base += 32, ++round) {
    const int entry = base + lane;
    const int expert = entry < seg_end
                           ? routed_expert(args, entry, masked, round == 0 ? pre.id : args.in.topk_idx[entry])
                           : -1;
#pragma unroll
    for (int r = 0; r < kCachedRounds; ++r)
      if (r == round) cached[r] = expert;
    const unsigned same = __match_any_sync(kFullMask, expert);
    if (expert >= 0 && lane == __ffs(same) - 1) warp_hist[expert] += __popc(same);
    __syncwarp();
  }
  __syncthreads();
  stamp_phase(args.phase_stamps, kStampHistogram);

  for (int expert = threadIdx.x; expert < num_experts; expert += kNumThreads) {
    int running = 0;
    for (int w = 0; w < kNumWarps; ++w) {
      const int count = hist[w * num_experts + expert];
      hist[w * num_experts + expert] = running;
      running += count;
    }
    store_list_length<Remote>(args, masked, tag, expert, running);
  }
  __syncthreads();
  stamp_phase(args.phase_stamps, kStampCountsStored);

  round = 0;
  for (int base = seg_begin; base < seg_end; base += 32, ++round) {
    const int entry = base + lane;
    int expert = -1;
    if (round < kCachedRounds) {
#pragma unroll
      for (int r = 0; r < kCachedRounds; ++r)
        if (r == round) expert = cached[r];
    } else if (entry < seg_end) {
      expert = routed_expert(args, entry, masked, args.in.topk_idx[entry]);
    }
    const unsigned same = __match_any_sync(kFullMask, expert);
    if (expert >= 0)
      write_list_entry<Remote>(args, tag, expert, warp_hist[expert] + __popc(same & ((1u << lane) - 1u)),
                               entry);
    __syncwarp();
    if (expert >= 0 && lane == __ffs(same) - 1) warp_hist[expert] += __popc(same);
    __syncwarp();
  }
  if constexpr (Remote::kEnabled) put_staged_lists<Remote>(args, hist + (kNumWarps - 1) * num_experts);
  stamp_phase(args.phase_stamps, kStampCounted);
}

// ---- Send: token data ----

// A cast row is `hidden` one-byte codes, its float scales right after them (RowFormat::msg_scales_offset),
// which the kernel uses as the constant it is rather than asking the format per group.
constexpr bool every_cast_is_one_byte() {
  bool one_byte = true;
  for_each_scale_format([&](ScaleFormat f) {
    one_byte = one_byte && (!row_format(f).casts() || row_format(f).element_bytes() == 1);
  });
  return one_byte;
}
static_assert(every_cast_is_one_byte(), "the cast writes one-byte codes");

// 4 e4m3 codes of v[0..3] * inv_scale, v[0] in the lowest byte. The SATFINITE hardware conversion is
// bit-exact with float_to_e4m3 (see fp8.hpp).
__device__ __forceinline__ uint32_t cast_e4m3x4(const float* v, float inv_scale) {
  const __nv_fp8x2_storage_t lo =
      __nv_cvt_float2_to_fp8x2(make_float2(v[0] * inv_scale, v[1] * inv_scale), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi =
      __nv_cvt_float2_to_fp8x2(make_float2(v[2] * inv_scale, v[3] * inv_scale), __NV_SATFINITE, __NV_E4M3);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// This token's distinct destination ranks (first top-k occurrence order) and its message address in each;
// with top-k weights, also the message's listings (the token's ids and weights) in every destination. Run by
// warp 0.
// `pre`: the kernel's preload, which holds the block's first token's ids.
template <typename Remote, bool kListings>
__device__ void find_destinations(const LowLatencyDispatchArgs& args, int token, DispatchSmallSmem& small,
                                  const SendPreload& pre) {
  const int lane = threadIdx.x;
  const bool preloaded = pre.first_token && token == static_cast<int>(blockIdx.x);
  const int expert =
      lane < args.in.num_topk
          ? expert_of(preloaded ? pre.id : args.in.topk_idx[size_t(token) * args.in.num_topk + lane],
                      args.map.num_experts)
          : -1;
  const float weight = kListings && lane < args.in.num_topk
                           ? args.in.topk_weights[size_t(token) * args.in.num_topk + lane]
                           : 0.0f;
  const int rank = expert >= 0 ? args.map.expert_rank(expert) : -1;
  const int dst = rank >= 0 && !rank_masked(small.masked, rank) ? rank : -1;  // masked ranks get nothing
  const bool first = first_lane_with(dst, args.in.num_topk, lane) && dst >= 0;
  const bool direct = first && is_direct<Remote>(args.peers, dst);
  const unsigned directs = __ballot_sync(kFullMask, direct);
  const unsigned remotes = __ballot_sync(kFullMask, first && !direct);
  const unsigned lower = (1u << lane) - 1u;
  if (direct) {
    small.dst_msgs[__popc(directs & lower)] = LowLatencyBufferMap::at<char>(
        small.peer_bases[dst], args.map.dispatch_recv_msg_offset(args.half, args.peers.rank, token));
    if constexpr (kListings) {
      small.dst_listings[__popc(directs & lower)] = LowLatencyBufferMap::at<int>(
          small.peer_bases[dst], args.map.dispatch_recv_listings_offset(args.half, args.peers.rank, token));
    }
  }
  if (first && !direct) small.remote_dsts[__popc(remotes & lower)] = dst;
  if (lane == 0) {
    small.num_dsts = __popc(directs);
    small.num_remote = __popc(remotes);
    if (remotes != 0) {
      small.dst_listings[small.num_dsts] =
          local_at<int>(args.peers, args.map.dispatch_send_listings_offset(args.half, token));
      small.dst_msgs[small.num_dsts++] =
          local_at<char>(args.peers, args.map.dispatch_send_msg_offset(args.half, token));
    }
  }
  if constexpr (!kListings) return;
  __syncwarp();
  if (lane < args.in.num_topk) {
    for (int d = 0; d < small.num_dsts; ++d) {
      small.dst_listings[d][lane] = expert;
      reinterpret_cast<float*>(small.dst_listings[d] + kListingWeightsWord)[lane] = weight;
    }
  }
}

// One block per token: 8 lanes per group of 128 channels, 16 channels (two 16-byte loads) per lane, so a lane
// writes one 16-byte FP8 chunk (or two BF16 chunks) straight into every destination's receive slot.
template <typename Remote, bool kListings>
__device__ void send_tokens(const LowLatencyDispatchArgs& args, DispatchSmallSmem& small,
                            const SendPreload& pre) {
  const LowLatencyBufferMap& map = args.map;
  const int hidden = map.hidden;
  const int num_groups = map.num_groups();
  const int octet = threadIdx.x / 8;
  const int sub = threadIdx.x % 8;
  const unsigned octet_mask = 0xFFu << (threadIdx.x % 32 / 8 * 8);
  for (int token = blockIdx.x; token < args.in.num_tokens; token += gridDim.x) {
    __syncthreads();  // the previous token's destinations are no longer read
    if (threadIdx.x < 32) find_destinations<Remote, kListings>(args, token, small, pre);
    __syncthreads();
    if (token == static_cast<int>(blockIdx.x)) stamp_phase(args.phase_stamps, kStampIds);
    const int num_dsts = small.num_dsts;
    const int4* row = static_cast<const int4*>(args.in.x) + size_t(token) * hidden / 8;
    for (int group = octet; group < num_groups; group += kNumThreads / 8) {
      const int chunk = group * 16 + sub * 2;  // int4 index of this lane's 16 channels
      const bool preloaded = pre.first_token && token == static_cast<int>(blockIdx.x) && group == octet;
      const int4 v0 = preloaded ? pre.v0 : device::ld_nc_v4(row + chunk);
      const int4 v1 = preloaded ? pre.v1 : device::ld_nc_v4(row + chunk + 1);
      if (!args.format.casts()) {
        for (int d = 0; d < num_dsts; ++d) {
          int4* out = reinterpret_cast<int4*>(small.dst_msgs[d]) + chunk;
          out[0] = v0;
          out[1] = v1;
        }
        continue;
      }
      float values[16];
      unpack_bf16x8(v0, values);
      unpack_bf16x8(v1, values + 8);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(values[i]));
      amax = fmaxf(amax, __shfl_xor_sync(octet_mask, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(octet_mask, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(octet_mask, amax, 4));
      const Fp8GroupScale scale = args.format.group_scale(amax);
      const int4 codes = make_int4(static_cast<int>(cast_e4m3x4(values, scale.inv_scale)),
                                   static_cast<int>(cast_e4m3x4(values + 4, scale.inv_scale)),
                                   static_cast<int>(cast_e4m3x4(values + 8, scale.inv_scale)),
                                   static_cast<int>(cast_e4m3x4(values + 12, scale.inv_scale)));
      for (int d = 0; d < num_dsts; ++d) {
        char* msg = small.dst_msgs[d];
        *reinterpret_cast<int4*>(msg + group * kLowLatencyGroupSize + sub * 16) = codes;  // 1-byte codes
        if (sub == 0) reinterpret_cast<float*>(msg + hidden)[group] = scale.scale;
      }
    }
    if constexpr (Remote::kEnabled) {
      // The staged message is complete; one warp per remote destination puts it (num_remote is
      // block-uniform).
      if (small.num_remote > 0) {
        __syncthreads();
        const int warp = threadIdx.x / 32;
        if (warp < small.num_remote) {
          const size_t bytes = args.format.msg_bytes(hidden);
          Remote::put_warp(
              local_at<char>(args.peers, map.dispatch_recv_msg_offset(args.half, args.peers.rank, token)),
              small.dst_msgs[small.num_dsts - 1], bytes, small.remote_dsts[warp]);
          if constexpr (kListings) {
            Remote::put_warp(
                local_at<char>(args.peers,
                               map.dispatch_recv_listings_offset(args.half, args.peers.rank, token)),
                small.dst_listings[small.num_dsts - 1], kLowLatencyListingsBytes, small.remote_dsts[warp]);
          }
        }
      }
    }
  }
}

// ---- Receive ----

// Piece `piece` of `num_pieces` of one received message into row `row` of local expert `local_expert`'s
// block; piece 0 also writes the FP8 scales, whose loads it issues before the row's so both are in flight
// together.
__device__ void deliver_row(const LowLatencyDispatchArgs& args, const char* msg, int local_expert, int row,
                            int piece, int num_pieces, int lane) {
  const LowLatencyBufferMap& map = args.map;
  const int hidden = map.hidden;
  const int num_rows = map.num_recv_rows();
  const size_t row_idx = size_t(local_expert) * num_rows + row;
  const RowFormat& format = args.format;
  if (!format.has_scales()) {
    warp_copy_piece<true>(static_cast<char*>(args.out.recv_x) + row_idx * hidden * 2, msg, size_t(hidden) * 2,
                          piece, num_pieces, lane);
    return;
  }
  const float* scales = reinterpret_cast<const float*>(msg + hidden);  // after the one-byte codes
  const int num_groups = map.num_groups();
  // The first 128 groups (hidden <= 16384) are loaded ahead: lane l holds groups 4l..4l+3 (its UE8M0 word)
  // or groups l, l + 32, l + 64, l + 96 (float scales). Groups past them take a loop after the row.
  constexpr int kAhead = 4;
  float ahead[kAhead];
  if (piece == 0) {
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      const int group = format.storage == ScaleStorage::kUe8m0x4 ? 4 * lane + i : lane + 32 * i;
      ahead[i] = group < num_groups ? __ldcg(scales + group) : 0.0f;
    }
  }
  warp_copy_piece<true>(static_cast<char*>(args.out.recv_x) + row_idx * hidden, msg, size_t(hidden), piece,
                        num_pieces, lane);
  if (piece != 0) return;
  if (format.storage == ScaleStorage::kUe8m0x4) {
    // ceil(G / 4) words; bytes past the last group stay 0.
    const int num_words = ue8m0_num_words(num_groups);
    for (int word = lane; word < num_words; word += 32) {
      uint8_t bytes[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int group = 4 * word + i;
        if (group < num_groups)
          bytes[i] = ue8m0_from_pow2_scale(word == lane ? ahead[i] : __ldcg(scales + group));
      }
      static_cast<uint32_t*>(
          args.out.recv_x_scales)[ll_scale_index(local_expert, row, word, num_rows, num_words)] =
          pack_ue8m0x4(bytes[0], bytes[1], bytes[2], bytes[3]);
    }
    return;
  }
  float* out = static_cast<float*>(args.out.recv_x_scales);
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    const int group = lane + 32 * i;
    if (group < num_groups) out[ll_scale_index(local_expert, row, group, num_rows, num_groups)] = ahead[i];
  }
  for (int group = 32 * kAhead + lane; group < num_groups; group += 32)
    out[ll_scale_index(local_expert, row, group, num_rows, num_groups)] = __ldcg(scales + group);
}

// The pre-reduced combine's table entries of token `token` of source `src` that row `row_idx` (of local
// expert `local_expert`, first listed at top-k position `topk_pos`) accounts for, from the token's received
// listings: every listing of this expert names the row; the row of the token's first listing on this rank
// also marks the listings of other ranks' experts (and -1 ids) with row -1, so every entry of a token that
// reached this rank is written exactly once.
__device__ void write_listings(const LowLatencyDispatchArgs& args, int src, int token, int local_expert,
                               int row_idx, int topk_pos, int lane) {
  const LowLatencyBufferMap& map = args.map;
  const int num_topk = args.in.num_topk;
  const int* received = local_at<int>(args.peers, map.dispatch_recv_listings_offset(args.half, src, token));
  const int id = lane < num_topk ? __ldcg(received + lane) : -1;
  const float weight =
      lane < num_topk ? __ldcg(reinterpret_cast<const float*>(received + kListingWeightsWord) + lane) : 0.0f;
  const bool here = id >= 0 && map.expert_rank(id) == args.peers.rank;
  const unsigned here_lanes = __ballot_sync(kFullMask, here);
  const bool first_here = topk_pos == __ffs(here_lanes) - 1;
  if (lane >= num_topk) return;
  LowLatencyListing* listings =
      args.out.recv_token_listings + (size_t(src) * map.num_max_tokens + token) * num_topk;
  if (here && map.local_expert_of(id) == local_expert) {
    listings[lane] = LowLatencyListing{row_idx, weight};
  } else if (!here && first_here) {
    listings[lane] = LowLatencyListing{-1, 0.0f};
  }
}

// A word of source `src` under this call's `tag` (a count or a list entry), polled until it carries the tag
// or the source's wait ended (source_state, then read once more). False, with 0, when it never came: the
// source was left out or failed, or stored nothing there.
__device__ __forceinline__ bool take_tagged(const uint64_t* address, uint64_t tag, const int* source_state,
                                            int* value) {
  for (;;) {
    const uint64_t word = device::ld_relaxed_sys_u64(address);
    if (low_latency_word_tag(word) == tag) {
      *value = low_latency_word_value(word);
      return true;
    }
    const int state = device::ld_acquire_cta(source_state);
    if (state != 0) {
      const uint64_t last = device::ld_relaxed_sys_u64(address);
      const bool found = state == 1 && low_latency_word_tag(last) == tag;
      *value = found ? low_latency_word_value(last) : 0;
      return found;
    }
  }
}

// The warp of a block that takes the receive's items in round w: the waiting warps last, so that the first
// items go to warps that took their entries while the flags travelled.
__device__ __forceinline__ int receive_warp_order(int warp, int waiter_warps) {
  return (warp + kNumWarps - waiter_warps) % kNumWarps;
}

// The list entry of the receive's item `item` (a row piece; rows in prefix order), from the index lists.
__device__ __forceinline__ const uint64_t* entry_word(const LowLatencyDispatchArgs& args, const int* prefix,
                                                      int item, int num_pieces, int* pair) {
  const int j = item / num_pieces;
  *pair = find_pair(prefix, args.map.num_experts, j);
  const int local_expert = args.map.pair_local_expert(*pair);
  const int src = args.map.pair_rank(*pair);
  return local_at<uint64_t>(args.peers, args.map.dispatch_recv_index_offset(args.half, local_expert, src)) +
         (j - prefix[*pair]);
}

// A warp's first item's list entry, taken before the flags came (valid: it carried this call's tag).
struct EntryAhead {
  int entry = 0;
  bool valid = false;
};

// The receive's wait, with the counts read and scanned while the rows still travel. The first ceil(R / 32)
// warps wait for the sources' flags (wait_source) and post each outcome in source_state; the other warps poll
// the count words, which carry their call's tag (a source stores them before the rows its flag releases, so
// they are usually all there before the flags), scan them into `prefix` ([E + 1]), then each takes its first
// item's list entry the same way (`ahead`). A count still without this call's tag when its source's wait
// ended is read once more after an arrival, and counts 0 for a source left out. Returns what
// wait_all_sources would; `prefix` holds the scan of the counts of every source not left out, or 0 rows
// everywhere unless every source arrived.
// `aborted`: the group was aborted before this launch: nothing is waited for and every count is 0.
template <typename Remote>
__device__ SourceWait wait_and_scan_counts(const LowLatencyDispatchArgs& args, int* prefix,
                                           DispatchSmallSmem& small, int num_uses, uint64_t tag, bool aborted,
                                           int waiter_warps, int num_pieces, EntryAhead* ahead) {
  const LowLatencyBufferMap& map = args.map;
  const PeerContext& peers = args.peers;
  const int num_ranks = map.num_ranks;
  const int num_pairs = map.num_experts;  // (local expert, source) pairs: L * R == E, stored le * R + src
  const int expected = num_uses + 1;
  const unsigned long long masked = small.left_out;  // the rank mask, until a wait leaves a source out
  const uint64_t* words = local_at<uint64_t>(peers, map.dispatch_recv_count_offset(args.half, 0, 0));
  bool arrived = true;
  if (static_cast<int>(threadIdx.x) < 32 * waiter_warps) {
    const int src = static_cast<int>(threadIdx.x);
    if (src < num_ranks && !rank_masked(masked, src)) {
      const SourceOutcome outcome =
          aborted
              ? SourceOutcome::kFailed
              : wait_source<Remote>(peers, map, args.half, LowLatencyOp::kDispatch, expected,
                                    WaitPhase::kLowLatencyDispatchRecv, args.in.dispatch_wait_recv_cost_stats,
                                    args.shape, args.mask, &small.left_out, src, device::global_timer_ns());
      arrived = outcome != SourceOutcome::kFailed;
      device::st_release_cta(&small.source_state[src], outcome == SourceOutcome::kArrived ? 1 : 2);
    }
  } else {
    const int first_thread = 32 * waiter_warps;
    for (int p = static_cast<int>(threadIdx.x) - first_thread; p < num_pairs;
         p += kNumThreads - first_thread) {
      int length = 0;
      const int src = map.pair_rank(p);
      if (!aborted && !rank_masked(masked, src))
        take_tagged(words + p, tag, &small.source_state[src], &length);
      prefix[p] = length;
    }
    warps_exclusive_scan(prefix, num_pairs, small.warp_sums, waiter_warps);
    const int item = first_item(static_cast<int>(blockIdx.x),
                                receive_warp_order(static_cast<int>(threadIdx.x) / 32, waiter_warps),
                                static_cast<int>(gridDim.x));
    if (item < prefix[num_pairs] * num_pieces) {
      int pair = 0;
      const uint64_t* word = entry_word(args, prefix, item, num_pieces, &pair);
      ahead->valid = take_tagged(word, tag, &small.source_state[map.pair_rank(pair)], &ahead->entry);
    }
  }
  // The waiters' acquires (and left_out) extend to the whole block through the barrier.
  const bool all_arrived = __syncthreads_and(arrived) != 0;
  const unsigned long long left_out = small.left_out;
  if (!all_arrived || left_out != masked) {
    // A wait failed, or left a source out whose counts the pollers may have taken: count again.
    for (int p = threadIdx.x; p < num_pairs; p += kNumThreads) {
      const uint64_t word =
          all_arrived && !rank_masked(left_out, map.pair_rank(p)) ? device::ld_relaxed_sys_u64(words + p) : 0;
      prefix[p] = low_latency_word_tag(word) == tag ? low_latency_word_value(word) : 0;
    }
    __syncthreads();
    block_exclusive_scan(prefix, num_pairs, small.warp_sums);
    ahead->valid = false;
  }
  return SourceWait{all_arrived, left_out};
}

// Sources left out (masked, or timed out with enable_shrink) count 0 rows.
template <typename Remote, bool kListings>
__device__ void receive_tokens(const LowLatencyDispatchArgs& args, int* prefix, DispatchSmallSmem& small,
                               int num_uses, uint64_t tag, bool aborted) {
  const LowLatencyBufferMap& map = args.map;
  const PeerContext& peers = args.peers;
  const int num_ranks = map.num_ranks;
  const int num_pairs = map.num_experts;  // (local expert, source) pairs: L * R == E
  const int waiter_warps = (num_ranks + 31) / 32;
  const int num_pieces = row_pieces(args.format.row_bytes(map.hidden));
  EntryAhead ahead;
  wait_and_scan_counts<Remote>(args, prefix, small, num_uses, tag, aborted, waiter_warps, num_pieces, &ahead);
  stamp_phase(args.phase_stamps, kStampArrived);
  stamp_phase(args.phase_stamps, kStampScanned);

  if (blockIdx.x == 0) {
    for (int p = threadIdx.x; p < num_pairs; p += kNumThreads) {
      const int expert_begin = prefix[map.pair_local_expert(p) * num_ranks];
      args.out.recv_layout_range[p] =
          LowLatencyRange{.count = prefix[p + 1] - prefix[p], .begin = prefix[p] - expert_begin};
    }
    for (int le = threadIdx.x; le < map.num_local_experts(); le += kNumThreads) {
      const int count = prefix[(le + 1) * num_ranks] - prefix[le * num_ranks];
      args.out.recv_count[le] = count;
      if (args.in.cumulative_local_expert_recv_stats != nullptr)
        args.in.cumulative_local_expert_recv_stats[le] += count;
    }
  }

  // Row pieces are spread over every warp of the grid, whatever the routing skew.
  const int lane = threadIdx.x % 32;
  const int total_rows = prefix[num_pairs];
  const int num_items = total_rows * num_pieces;
  const int num_grid_warps = gridDim.x * kNumWarps;
  for (int item = first_item(static_cast<int>(blockIdx.x),
                             receive_warp_order(static_cast<int>(threadIdx.x) / 32, waiter_warps),
                             static_cast<int>(gridDim.x));
       item < num_items; item += num_grid_warps) {
    int pair = 0;
    const uint64_t* word = entry_word(args, prefix, item, num_pieces, &pair);
    const int entry = ahead.valid ? ahead.entry : low_latency_word_value(device::ld_relaxed_sys_u64(word));
    ahead.valid = false;  // the first item's only
    const int local_expert = map.pair_local_expert(pair);
    const int src = map.pair_rank(pair);
    const int row = item / num_pieces - prefix[local_expert * num_ranks];
    const int piece = item % num_pieces;
    const int token = recv_index_entry_token(entry);
    // A dispatch with top-k weights: the token's listings first (loaded alongside the row, their values would
    // stay live across its copy and spill).
    if (kListings && piece == 0)
      write_listings(args, src, token, local_expert, local_expert * map.num_recv_rows() + row,
                     recv_index_entry_topk_pos(entry), lane);
    deliver_row(args, local_at<char>(peers, map.dispatch_recv_msg_offset(args.half, src, token)),
                local_expert, row, piece, num_pieces, lane);
    if (lane == 0 && piece == 0) {
      const size_t row_idx = size_t(local_expert) * map.num_recv_rows() + row;
      args.out.recv_src_info[row_idx] = token;
      args.out.recv_topk_pos[row_idx] = recv_index_entry_topk_pos(entry);
    }
  }
  // Of the block: warp 0, which waited for the flags, takes items last.
  stamp_phase_of_block(args.phase_stamps, kStampDelivered);
  finish_receive(peers, map, args.half, LowLatencyOp::kDispatch, num_uses);
  stamp_phase(args.phase_stamps, kStampExit);
}

// Named dispatch, in a namespace, because profiler tooling written for DeepEP looks for kernel names
// ending in ::dispatch. With a receive hook, the send and the receive launch are both this kernel.
// kListings: the dispatch carries top-k weights (the pre-reduced combine's listings). A template argument, so
// the plain kernel holds none of that code and keeps its registers (with it as a runtime branch it spilled).
template <typename Remote, bool kListings>
__global__ void __launch_bounds__(kNumThreads, 1) dispatch(const LowLatencyDispatchArgs args) {
  extern __shared__ __align__(16) char smem[];
  auto& small = *reinterpret_cast<DispatchSmallSmem*>(smem);
  int* large = reinterpret_cast<int*>(smem + align_up(sizeof(DispatchSmallSmem), 16));
  stamp_phase(args.phase_stamps, kStampEntry);
  const int num_uses = read_num_uses(args.peers, args.map, args.half, LowLatencyOp::kDispatch);
  // The tag of this call's count words and list entries (pack_low_latency_word).
  const uint64_t tag = low_latency_call_tag(num_uses + 1, read_num_cleans(args.peers, args.map));
  const unsigned long long mask = threadIdx.x == 0 ? load_rank_mask(args.mask) : 0ull;
  // No source's wait has ended yet (the prologue's barrier orders this before every use).
  if ((args.phases & kLowLatencyRecv) && threadIdx.x < kMaxLowLatencyRanks)
    small.source_state[threadIdx.x] = 0;
  const SendPreload pre = args.phases & kLowLatencySend ? preload_send(args) : SendPreload{};
  // Every rank's base, loaded with the preload and stored after the barrier (send_tokens' first barrier
  // publishes it), so the load's round trip overlaps the abort check's.
  const bool loads_base =
      (args.phases & kLowLatencySend) && static_cast<int>(threadIdx.x) < args.peers.num_ranks;
  char* const peer_base = loads_base ? static_cast<char*>(args.peers.peer_bases[threadIdx.x]) : nullptr;
  // Once the group is aborted nothing is sent, and the receive reports empty results. The barrier inside also
  // hands the mask to every thread (its load is in flight with the abort word's).
  const bool aborted = device::block_sees_abort(
      wait_context(args.peers),
      args.phases & kLowLatencySend ? WaitPhase::kLowLatencyDispatchSend : WaitPhase::kLowLatencyDispatchRecv,
      [&] { small.masked = small.left_out = mask; });
  const unsigned long long masked = small.masked;
  stamp_phase(args.phase_stamps, kStampPrologue);
  if (loads_base) small.peer_bases[threadIdx.x] = peer_base;
  if ((args.phases & kLowLatencySend) && !aborted) {
    post_shapes<Remote>(args.peers, args.map, args.half, LowLatencyOp::kDispatch, args.shape, masked);
    if (blockIdx.x == gridDim.x - 1) route_entries<Remote>(args, large, masked, tag, pre);
    send_tokens<Remote, kListings>(args, small, pre);
    stamp_phase_of_block(args.phase_stamps, kStampSent);
    publish_sends<Remote>(
        args.peers, args.map, args.half, LowLatencyOp::kDispatch, num_uses + 1, masked,
        dispatch_publishers(args.in.num_tokens, static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x)));
    stamp_phase(args.phase_stamps, kStampPublished);
  }
  if (args.phases & kLowLatencyRecv)
    receive_tokens<Remote, kListings>(args, large, small, num_uses, tag, aborted);
}

template <typename Remote>
void launch_low_latency_dispatch_with(const LowLatencyDispatchArgs& args, cudaStream_t stream) {
  const size_t smem_bytes = dispatch_smem_bytes(args.map);
  // A dispatch with top-k weights (the listings) is a kernel of its own: the plain one keeps its registers.
  const auto kernel =
      args.out.recv_token_listings != nullptr ? dispatch<Remote, true> : dispatch<Remote, false>;
  allow_dynamic_smem(kernel, smem_bytes);
  launch(kernel, {unsigned(args.num_blocks), kNumThreads, smem_bytes, Residency::kCoResident}, stream, args);
}

template <typename Remote>
void preload_low_latency_dispatch_with() {
  preload_kernel(dispatch<Remote, false>);
  preload_kernel(dispatch<Remote, true>);
}

}  // namespace

}  // namespace epx::kernels
