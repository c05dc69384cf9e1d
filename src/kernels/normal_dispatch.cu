#include "gpu/cuda_check.hpp"
#include "kernels/dispatch_warp_roles.hpp"
#include "kernels/launch.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/normal_queue.cuh"
#include "kernels/normal_window.cuh"
#include "kernels/notify_steps.cuh"
#include "kernels/phase_clock.cuh"
#include "kernels/preload.hpp"
#include "kernels/tma_copy.cuh"
#include "kernels/warp_copy.cuh"
#include "kernels/window_cut.hpp"

namespace epx::kernels {

namespace {

// Pieces of 3 KiB, four per warp. Two 7 KiB pieces per warp moved FP8 rows (7,168 bytes) ~10 % faster on
// H200 at 24 SMs but BF16 rows (14,336 bytes) up to 10 % slower (epx-bench, 4,096 and 16,384 tokens, 1 rank).
using DispatchStage = TmaWarpStage;
using DispatchCopier = TmaRowCopier<DispatchStage>;

// Where received rows go. Known at launch, or published by the host once it allocated them (a receive
// launched before the host waited for the counts); `cancelled`: nowhere (rows are consumed and dropped).
struct RowOutputs {
  void* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  bool cancelled;
};

// Called by one thread: the outputs of this launch, once the host published them when it had to.
// NOTES: only block 1 reads the host's copy (host memory over PCIe); it mirrors the outputs into this rank's
// device memory for the other blocks, since host-memory reads by every block slowed the whole copy that
// followed ~2.5x (H200, 24 SMs).
__device__ RowOutputs row_outputs(const DispatchArgs& args) {
  const RowOutputs given{args.out.recv_x,          args.out.recv_x_scales,
                         args.out.recv_topk_idx,   args.out.recv_topk_weights,
                         args.handle.recv_src_idx, false};
  const int num_channels = args.map.num_channels;
  const int* offsets = args.handle.recv_channel_offset;
  const int rows = offsets[args.peers.num_ranks * num_channels];
  // Rows the host read off the layout board for each source, against what the source sends: a source whose
  // layout posted another count is named before anything is written.
  for (int src = 0; args.board.active && src < args.peers.num_ranks; ++src) {
    const int sent = offsets[(src + 1) * num_channels] - offsets[src * num_channels];
    if (sent == args.board.rows_from[src]) continue;
    device::raise_abort(wait_context(args.peers), src, WaitPhase::kLayoutCounts, sent,
                        args.board.rows_from[src], 0, 0);
    return {nullptr, nullptr, nullptr, nullptr, nullptr, true};
  }
  if (args.published == nullptr) {
    // Outputs smaller than the rows are never written past (not expected: the host's counts are the
    // exchange's, or were checked per source just above; worst-case outputs were checked by the notify).
    if (rows <= args.num_out_rows) return given;
    device::raise_abort(wait_context(args.peers), -1, WaitPhase::kLayoutCounts, args.num_out_rows, rows, 0);
    return {nullptr, nullptr, nullptr, nullptr, nullptr, true};
  }
  // The count exchange (the notify before this launch, or this launch's own blocks) wrote the row count; the
  // host decides the same from the announced totals (totals that disagreed with it aborted the group, and
  // the blocks that write rows returned before this).
  if (args.guess_rows > 0 && rows <= args.guess_rows) return given;
  const uint32_t sequence = args.published_sequence;
  const device::WaitContext ctx = wait_context(args.peers);
  auto* control = NormalBufferMap::control(args.peers.local_base);
  const auto is_this_call = [sequence](int value) { return static_cast<uint32_t>(value) == sequence; };
  const auto as_seen = [](int value) { return static_cast<int64_t>(value); };
  // A wait abandoned (timeout, abort) counts as cancelled: the pointers are then not this call's.
  if (blockIdx.x == 1) {
    const int* host_sequence = reinterpret_cast<const int*>(&args.published->sequence);
    int value = device::ld_acquire_sys(host_sequence);
    const bool arrived =
        is_this_call(value) || device::spin_until(host_sequence, is_this_call, sequence, ctx, args.peers.rank,
                                                  WaitPhase::kDispatchOutputs, value);
    // The acquire above orders these reads after the sequence; the host wrote the fields before it.
    const volatile PublishedOutputs& p = *args.published;
    control->outputs_mirror[0] = reinterpret_cast<uint64_t>(p.recv_x);
    control->outputs_mirror[1] = reinterpret_cast<uint64_t>(p.recv_x_scales);
    control->outputs_mirror[2] = reinterpret_cast<uint64_t>(p.recv_topk_idx);
    control->outputs_mirror[3] = reinterpret_cast<uint64_t>(p.recv_topk_weights);
    control->outputs_mirror[4] = reinterpret_cast<uint64_t>(p.recv_src_idx);
    // Outputs smaller than the rows are not written past (as above).
    const bool fits = !arrived || p.cancelled || rows <= p.rows;
    if (!fits) device::raise_abort(ctx, -1, WaitPhase::kLayoutCounts, p.rows, rows, 0);
    control->outputs_cancelled = arrived && fits ? p.cancelled : 1;
    device::st_release_gpu(reinterpret_cast<int*>(&control->outputs_sequence), static_cast<int>(sequence));
  } else {
    const int* mirror_sequence = reinterpret_cast<const int*>(&control->outputs_sequence);
    int value = device::ld_acquire_gpu(mirror_sequence);
    const bool arrived =
        is_this_call(value) ||
        device::spin_until_loaded([mirror_sequence] { return device::ld_acquire_gpu(mirror_sequence); },
                                  is_this_call, as_seen, sequence, ctx, args.peers.rank,
                                  WaitPhase::kDispatchOutputs, value);
    if (!arrived) return {nullptr, nullptr, nullptr, nullptr, nullptr, true};
  }
  const volatile uint64_t* m = control->outputs_mirror;
  return {reinterpret_cast<void*>(m[0]),
          reinterpret_cast<float*>(m[1]),
          reinterpret_cast<int64_t*>(m[2]),
          reinterpret_cast<float*>(m[3]),
          reinterpret_cast<int*>(m[4]),
          *reinterpret_cast<const volatile int*>(&control->outputs_cancelled) != 0};
}

// Writes output row `row`: the token row from `x_row` (a bulk copy driven by the copier's lane), then its
// fields, loaded by the caller before (record_fields.cuh). `kFromQueue`: the inputs lie in a queue record
// that peers rewrite while the kernel runs, so they are read coherently; `scales`: the token's scales there.
template <bool kFromQueue>
__device__ __forceinline__ void write_row(const DispatchArgs& args, const RowOutputs& out, int row,
                                          const char* x_row, const RecordFields& fields, const void* scales,
                                          int lane, DispatchCopier& copier) {
  const size_t row_bytes = args.record.x_bytes;
  if (copier.driver()) copier.copy(static_cast<char*>(out.recv_x) + row * row_bytes, x_row, row_bytes);
  const FieldOutputs field_out{out.recv_x_scales, out.recv_topk_idx, out.recv_topk_weights, out.recv_src_idx};
  store_output_fields<kFromQueue>(field_out, args.record, row, fields, scales, args.peers.rank,
                                  args.num_experts / args.peers.num_ranks, lane);
}

// Copies token `token` of this rank into a queue record in a peer's buffer (posted NVLink stores).
__device__ __forceinline__ void write_record(const DispatchArgs& args, char* record, int token, int lane) {
  const NormalRecord& r = args.record;
  if (lane == 0)
    device::bulk_prefetch_l2(static_cast<const char*>(args.in.x) + static_cast<size_t>(token) * r.x_bytes,
                             r.x_bytes);
  write_token_record(record, r, args.in.x, args.in.x_scales, args.in.topk_idx, args.in.topk_weights, token,
                     lane);
}

// row_outputs for a sender block's warp: its lane 0 waits for them, the warp shares what it found. With the
// count exchange in the launch it first waits until block 1 scanned and checked the channel offsets (an
// aborted scan never signals: the wait ends with the abort, and the warp writes nothing). Block 1's own waits
// name the peer that kept it, so this one is bounded four times longer: it reports only if none of them did.
__device__ RowOutputs warp_row_outputs(const DispatchArgs& args, int calls, int lane) {
  RowOutputs found{nullptr, nullptr, nullptr, nullptr, nullptr, true};
  if (lane == 0) {
    device::WaitContext ctx = wait_context(args.peers);
    ctx.timeout_ns = ctx.timeout_ns > UINT64_MAX / 4 ? UINT64_MAX : 4 * ctx.timeout_ns;
    const bool scanned =
        !args.with_notify ||
        device::try_wait_at_least(&NormalBufferMap::control(args.peers.local_base)->offsets_sequence,
                                  calls + 1, ctx, args.peers.rank, WaitPhase::kDispatchNotify);
    if (scanned) found = row_outputs(args);
  }
  // Lane 0's acquire ordered the offsets and outputs after the signals; the barrier orders every lane's reads
  // of them (copy_own_rows reads the channel's offset in every lane) after lane 0's.
  __syncwarp();
  const auto share = [](auto* pointer) {
    return reinterpret_cast<decltype(pointer)>(
        __shfl_sync(~0u, reinterpret_cast<unsigned long long>(pointer), 0));
  };
  return {share(found.recv_x),        share(found.recv_x_scales),
          share(found.recv_topk_idx), share(found.recv_topk_weights),
          share(found.recv_src_idx),  __shfl_sync(~0u, static_cast<int>(found.cancelled), 0) != 0};
}

// ---- Rows this rank keeps: straight from x into recv_x, no queue. Warp `worker` of `num_workers` (possibly
// spread over two blocks) takes every num_workers-th row; all of them scan the whole channel, so they agree
// on every row's position. ----
__device__ void copy_own_rows(const DispatchArgs& args, const RowOutputs& out, int channel, int worker,
                              int num_workers, int lane, DispatchCopier& copier) {
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const TokenRange range = channel_token_range(args.num_tokens, args.map.num_channels, channel);
  const int row0 = args.handle.recv_channel_offset[rank * args.map.num_channels + channel];
  PhaseClock clock(args.phases, PhaseStream::kDispatchOwnRows, channel == 0 && worker == 0 && lane == 0);
  int count = 0;
  const auto flag_at = [&](int t) {
    return t < range.end && args.is_token_in_rank[static_cast<size_t>(t) * num_ranks + rank] != 0;
  };
  bool next_in = flag_at(range.begin + lane);  // one window ahead, so its load overlaps this window's rows
  for (int t0 = range.begin, window = 0; t0 < range.end; t0 += 32, ++window) {
    const int t = t0 + lane;
    const bool in = next_in;
    next_in = flag_at(t + 32);
    const unsigned mask = __ballot_sync(~0u, in);
    if (window % num_workers == worker && t < range.end) {
      args.handle.send_head[static_cast<size_t>(t) * num_ranks + rank] =
          in ? count + __popc(mask & lanes_below(lane)) : -1;
    }
    clock.mark(0);
    for (unsigned todo = worker_tokens(mask, count, worker, num_workers, lane); todo != 0; todo &= todo - 1) {
      const int bit = __ffs(todo) - 1;
      const int entry = count + __popc(mask & lanes_below(bit));
      const int token = t0 + bit;
      const RecordFields fields = load_input_fields(args.record, args.in.x_scales, args.in.topk_idx,
                                                    args.in.topk_weights, token, lane);
      write_row<false>(args, out, row0 + entry,
                       static_cast<const char*>(args.in.x) + static_cast<size_t>(token) * args.record.x_bytes,
                       fields, args.in.x_scales + static_cast<size_t>(token) * args.record.num_scales, lane,
                       copier);
    }
    clock.mark(1);
    count += __popc(mask);
  }
  if (clock.on())
    copier.wait_loads();  // measured: the copies' tail (the kernel's end would wait for it anyway)
  clock.mark(2);
  clock.add_to_report(count, static_cast<int>(args.record.x_bytes));
}

// ---- Send: the channel's tokens for `dst`, in token order, into dst's queue, a chunk at a time. ----
__device__ void send_tokens(const DispatchArgs& args, int channel, int dst, const WarpGroup& group,
                            int* shared, int calls) {
  const int num_ranks = args.peers.num_ranks;
  QueueSender queue(args.peers, args.map, group, shared, dst, channel, args.chunk_tokens,
                    WaitPhase::kDispatchSend);
  PhaseClock clock(args.phases, PhaseStream::kDispatchSend,
                   channel == 0 && group.group == 0 && group.leader());
  queue.wait_until_peer_ready(calls);
  const TokenRange range = channel_token_range(args.num_tokens, args.map.num_channels, channel);
  const int lane = group.lane;
  int window = 0;
  for (int t0 = range.begin; t0 < range.end;) {
    const int granted = queue.reserve(args.chunk_tokens);
    clock.mark(0);
    int taken = 0;
    // Scan 32 tokens at a time; a window that holds more than the chunk has room for is cut before the first
    // token past the room, and the next scan resumes there. Every warp scans identically.
    while (taken < granted && t0 < range.end) {
      const int t = t0 + lane;
      const bool in = t < range.end && args.is_token_in_rank[static_cast<size_t>(t) * num_ranks + dst] != 0;
      unsigned mask = __ballot_sync(~0u, in);
      const int width = tokens_within_room(mask, granted - taken, 32);
      mask &= window_bits(width);
      if (window % group.num_warps == group.warp && lane < width && t < range.end) {
        const bool sent = (mask >> lane) & 1u;
        args.handle.send_head[static_cast<size_t>(t) * num_ranks + dst] =
            sent ? queue.pushed + taken + __popc(mask & lanes_below(lane)) : -1;
      }
      for (unsigned todo = worker_tokens(mask, taken, group.warp, group.num_warps, lane); todo != 0;
           todo &= todo - 1) {
        const int bit = __ffs(todo) - 1;
        write_record(args, queue.record(taken + __popc(mask & lanes_below(bit))), t0 + bit, lane);
      }
      taken += __popc(mask);
      t0 += width;
      ++window;
    }
    clock.mark(1);
    queue.publish(taken);
    clock.mark(2);
  }
  queue.finish();
  clock.add_to_report(queue.pushed, static_cast<int>(args.record.bytes()));
}

// ---- Receive: the channel's rows from `src`, copied out of this rank's queue into their final rows. ----
__device__ void receive_tokens(const DispatchArgs& args, const RowOutputs& out, int channel, int src,
                               const WarpGroup& group, int* shared, DispatchCopier& copier, int calls) {
  const int index = src * args.map.num_channels + channel;
  const int row0 = args.handle.recv_channel_offset[index];
  QueueReceiver queue(args.peers, args.map, group, shared, src, channel,
                      args.handle.recv_channel_offset[index + 1] - row0, WaitPhase::kDispatchReceive);
  // Records of another shape are never read: the group aborts, naming the field.
  if (!queue.done() && !queue.share(group.leader() ? check_launch_shape(args.peers, calls, args.shape, src,
                                                                        WaitPhase::kDispatchReceive)
                                                   : 0)) {
    return;
  }
  const NormalRecord& r = args.record;
  PhaseClock clock(args.phases, PhaseStream::kDispatchReceive,
                   channel == 0 && src == (args.peers.rank + 1) % args.peers.num_ranks && group.leader());
  while (!queue.done()) {
    const int ready = queue.wait_ready();
    clock.mark(0);
    // The records were written by a peer and published to this rank's generic proxy; the bulk copies read
    // through the async proxy.
    if (copier.driver()) device::fence_proxy_async();
    for (int j = group.warp; j < ready && !out.cancelled; j += group.num_warps) {
      const char* record = queue.record(j);
      const RecordFields fields = load_record_fields(r, record, group.lane);
      write_row<true>(args, out, row0 + queue.got + j, record, fields, record + r.scales_offset(), group.lane,
                      copier);
    }
    clock.mark(1);
    if (copier.driver()) copier.wait_loads();  // the rows left the queue before its slots are released
    queue.release(ready);
    clock.mark(2);
  }
  queue.finish();
  clock.add_to_report(queue.count, static_cast<int>(args.record.bytes()));
}

// Padding rows of a worst-case-sized output (after every received row): no source, no experts.
__device__ void mark_padding_rows(const DispatchArgs& args, int channel) {
  const int num_rows = args.handle.recv_channel_offset[args.peers.num_ranks * args.map.num_channels];
  const int num_topk = args.record.num_topk_idx;
  const int stride = args.map.num_channels * kQueueThreads;
  for (int row = num_rows + channel * kQueueThreads + threadIdx.x; row < args.num_out_rows; row += stride) {
    args.handle.recv_src_idx[row] = -1;
    if (args.out.recv_topk_idx == nullptr) continue;
    for (int k = 0; k < num_topk; ++k) {
      args.out.recv_topk_idx[static_cast<size_t>(row) * num_topk + k] = -1;
      args.out.recv_topk_weights[static_cast<size_t>(row) * num_topk + k] = 0.0f;
    }
  }
}

// Block 2c sends channel c's tokens to the peers, block 2c + 1 receives channel c's rows from them and copies
// the rows this rank keeps. With one rank there are no queues and both blocks copy. Only blocks that write
// rows wait for published outputs: senders start as soon as the launch does.
// kWindowPosts: args.window_posts (the Buffer has an output window: every receiver posts how it receives), a
// kernel of its own so that the queue's way keeps its registers.
template <bool kWindowPosts>
__device__ __forceinline__ void dispatch_blocks(const DispatchArgs& args) {
  __shared__ int group_values[kMaxNvlRanks];
  __shared__ RowOutputs outputs;
  extern __shared__ DispatchStage tma_stages[];  // [kQueueWarps]
  const int calls = calls_before(args.peers);
  // After an aborted notify (worst-case mode launches this without the host's look at the counts) the
  // offsets may be anything: write nothing.
  if (device::block_sees_abort(wait_context(args.peers), WaitPhase::kDispatchReceive)) return;
  post_launch_shape(args.peers, calls, args.shape);
  if (kWindowPosts && blockIdx.x == 1 && !args.window_guess) post_window_way(args, calls, args.to_window);
  // The warp split is fixed at launch, as if into the window whenever it may be (its own-row warps agree on
  // it in every block); whether the rows go into the window is known once the offsets are.
  const bool split_window = kWindowPosts && (args.to_window || args.window_guess);
  const int channel = blockIdx.x / 2;
  const bool is_sender = blockIdx.x % 2 == 0;
  const int num_ranks = args.peers.num_ranks;
  const int rank = args.peers.rank;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  DispatchCopier copier(&tma_stages[warp], lane == 0);
  const bool writes_rows = !is_sender || num_ranks == 1;
  if (args.with_notify) {
    // Counts out first (peers' receivers wait for them), then the exchange, then the offsets.
    if (is_sender) count_channel<kQueueThreads>(args.notify, channel);
    if (blockIdx.x == 1) exchange_counts<kQueueThreads>(args.notify);
    if (writes_rows && !scan_and_check_totals<kQueueThreads>(args.notify)) {
      finish_launch(args.peers, calls);  // aborted: nothing is written
      return;
    }
    // The offsets every thread of block 1 wrote (ordered by the scan's barrier), for the senders' own rows.
    if (blockIdx.x == 1 && threadIdx.x == 0) {
      __threadfence();
      device::st_release_gpu(&NormalBufferMap::control(args.peers.local_base)->offsets_sequence, calls + 1);
    }
  }
  // A guess in the window: the offsets (this block's scan, or the notify before the launch) say now whether
  // the rows fit it, before the host's outputs are waited for when they do not.
  const bool own_window = kWindowPosts && writes_rows && receives_into_window(args);
  if (kWindowPosts && args.window_guess && blockIdx.x == 1) post_window_way(args, calls, own_window);
  if (writes_rows) {
    if (threadIdx.x == 0) outputs = row_outputs(args);
    __syncthreads();
  }

  // The own rows' workers: the receiver block's first warps, then the sender block's last warps.
  const SenderWarpRoles roles = sender_warp_roles(
      kQueueWarps, num_ranks,
      args.sender_own_warps >= 0
          ? args.sender_own_warps
          : default_sender_own_warps(kQueueWarps, num_ranks, split_window, args.map.num_channels));
  const ReceiverWarpRoles receiving = receiver_warp_roles(
      kQueueWarps, num_ranks,
      args.receiver_own_warps >= 0
          ? args.receiver_own_warps
          : default_receiver_own_warps(kQueueWarps, num_ranks, args.record.num_scales > 0),
      roles.own);
  // Into the output window the receiver block has no queue to empty: all its warps copy own rows.
  const auto receiver_own_of = [&](bool into_window) { return into_window ? kQueueWarps : receiving.own; };
  const int receiver_own = receiver_own_of(own_window);
  const int own_workers = receiver_own + roles.own;
  if (num_ranks == 1) {
    if (!outputs.cancelled)
      copy_own_rows(args, outputs, channel, warp + (is_sender ? kQueueWarps : 0), 2 * kQueueWarps, lane,
                    copier);
  } else if (is_sender) {
    const int send_warps = roles.send;
    if (warp >= send_warps) {
      // Only these warps wait for outputs published late: the others send from the launch on. After that
      // wait the offsets are known, and with them whether the receiver block takes all own rows' first share.
      const RowOutputs own = warp_row_outputs(args, calls, lane);
      const int receiver_share = receiver_own_of(kWindowPosts && receives_into_window(args));
      if (!own.cancelled)
        copy_own_rows(args, own, channel, receiver_share + warp - send_warps, receiver_share + roles.own,
                      lane, copier);
    } else {
      const int warps_per_peer = send_warps / (num_ranks - 1);
      const int peer_idx = warp / warps_per_peer;
      if (peer_idx < num_ranks - 1) {
        const WarpGroup group{peer_idx, warp % warps_per_peer, warps_per_peer, lane};
        const int dst = peer_rank(peer_idx, rank);
        WindowWay way = WindowWay::kQueue;
        WindowOutputs out{};
        int first_row = 0;
        if constexpr (kWindowPosts)
          way = window_way(args, channel, dst, group, &group_values[peer_idx], calls, out, first_row);
        if (way == WindowWay::kWindow)
          send_tokens_to_window(args, channel, dst, group, out, first_row, calls);
        if (way == WindowWay::kQueue) send_tokens(args, channel, dst, group, &group_values[peer_idx], calls);
      }
    }
  } else if (own_window) {
    post_window_rows(args, channel, calls);
    if (!outputs.cancelled) copy_own_rows(args, outputs, channel, warp, own_workers, lane, copier);
    wait_window_rows(args, channel, calls);
  } else if (warp < receiving.own) {
    if (!outputs.cancelled) copy_own_rows(args, outputs, channel, warp, own_workers, lane, copier);
  } else {
    const int source_idx = (warp - receiving.own) / receiving.per_source;
    if (source_idx < num_ranks - 1) {
      const int src = peer_rank(source_idx, rank);
      const WarpGroup group{src, (warp - receiving.own) % receiving.per_source, receiving.per_source, lane};
      receive_tokens(args, outputs, channel, src, group, &group_values[src], copier, calls);
    }
  }
  if (!is_sender && !outputs.cancelled) mark_padding_rows(args, channel);
  copier.finish();
  finish_launch(args.peers, calls);
}

// Both ways of sending in one kernel take 128 registers unbounded (either alone: 96-120) and read 20-27 %
// slower through the queues than the queue's own kernel; capped at 120 the same; capped at 112 (no spills)
// the queues' way runs as fast as in the queue's own kernel and the window's way keeps its speed (2 x H200,
// docs/BENCHMARKS.md). Below 112 ptxas spills.
__global__ void __launch_bounds__(kQueueThreads, 1) dispatch_kernel(DispatchArgs args) {
  dispatch_blocks<false>(args);
}
__global__ void __maxnreg__(112) dispatch_kernel_with_window(DispatchArgs args) {
  dispatch_blocks<true>(args);
}

}  // namespace

constexpr size_t kDispatchSharedBytes = sizeof(DispatchStage) * kQueueWarps;

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  launch(args.window_posts ? dispatch_kernel_with_window : dispatch_kernel,
         {unsigned(2 * args.map.num_channels), kQueueThreads, kDispatchSharedBytes, Residency::kCoResident},
         stream, args);
}

void preload_normal_dispatch_kernels() {
  for (auto* kernel : {dispatch_kernel, dispatch_kernel_with_window}) {
    preload_kernel(kernel);
    allow_dynamic_smem(kernel, kDispatchSharedBytes);
  }
}

}  // namespace epx::kernels
