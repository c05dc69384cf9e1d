#include "low_latency_bench.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_bytes.hpp"
#include "bench_data.hpp"
#include "epx/buffer.hpp"
#include "epx/error.hpp"
#include "epx/low_latency.hpp"
#include "formats/bf16.hpp"
#include "launch_floor.hpp"
#include "low_latency_phases.hpp"
#include "nccl_baseline.hpp"
#include "reference/test_data.hpp"
#include "timing.hpp"

namespace epx::bench {

namespace {

constexpr int kInputSets = 4;  // timed calls rotate through these so no two consecutive calls see the same x

struct Shape {
  int num_tokens, hidden, num_topk, num_experts, num_ranks;
  int num_local() const { return num_experts / num_ranks; }
};

struct Outputs {
  DeviceArray<uint8_t> recv_x, recv_scales;
  DeviceArray<int> recv_count, src_info, topk_pos;
  DeviceArray<LowLatencyRange> range;
  DeviceArray<LowLatencyListing> listings;  // for pre-reduced combines
  explicit Outputs(const LowLatencyDispatchSizes& s)
      : recv_x(s.recv_x_bytes),
        recv_scales(std::max<size_t>(s.recv_x_scales_bytes, 16)),
        recv_count(s.recv_count_bytes / sizeof(int)),
        src_info(s.recv_src_info_bytes / sizeof(int)),
        topk_pos(s.recv_src_info_bytes / sizeof(int)),
        range(s.recv_layout_range_bytes / sizeof(LowLatencyRange)),
        listings(std::max<size_t>(s.recv_token_listings_bytes / sizeof(LowLatencyListing), 1)) {}
  // weighted: the dispatch carries top-k weights (the listings a pre-reduced combine reads).
  LowLatencyDispatchOutput view(bool fp8, bool weighted = false) const {
    return {
        recv_x.get(), fp8 ? recv_scales.get() : nullptr,  recv_count.get(), src_info.get(), topk_pos.get(),
        range.get(),  weighted ? listings.get() : nullptr};
  }
};

LowLatencyDispatchInput dispatch_input(const Shape& s, const void* x, const int64_t* topk_idx, bool fp8) {
  LowLatencyDispatchInput in;
  in.x = x;
  in.topk_idx = topk_idx;
  in.num_tokens = s.num_tokens;
  in.num_topk = s.num_topk;
  in.hidden = s.hidden;
  in.num_max_dispatch_tokens_per_rank = s.num_tokens;
  in.num_experts = s.num_experts;
  in.use_fp8 = fp8;
  return in;
}

LowLatencyCombineInput combine_input(const Shape& s, const void* x, const int64_t* topk_idx,
                                     const float* weights, bool logfmt, bool pre_reduce = false) {
  LowLatencyCombineInput in;
  in.x = x;
  in.topk_idx = topk_idx;
  in.topk_weights = weights;
  in.num_tokens = s.num_tokens;
  in.num_topk = s.num_topk;
  // The LogFMT rows code every row, within the node too: what the format costs (use_logfmt alone within one
  // node runs the BF16 combine, the BF16 rows).
  in.use_logfmt = in.logfmt_within_node = logfmt;
  in.pre_reduce = pre_reduce;
  return in;
}

// The rows a pre-reduced combine returns to this rank: one per (its token, rank holding some of its experts).
double pre_reduced_rows(const Shape& s, const std::vector<int64_t>& ids) {
  double rows = 0;
  for (int t = 0; t < s.num_tokens; ++t) {
    for (int k = 0; k < s.num_topk; ++k) {
      const int64_t e = ids[size_t(t) * s.num_topk + k];
      if (e < 0) continue;
      bool counted = false;
      for (int j = 0; j < k; ++j) {
        const int64_t other = ids[size_t(t) * s.num_topk + j];
        counted |= other >= 0 && other / s.num_local() == e / s.num_local();
      }
      rows += counted ? 0 : 1;
    }
  }
  return rows;
}

// BF16 dispatch, identity experts, weighted combine (plain or pre-reduced): each token must come back as
// sum_k w_k * x.
void check_round_trip(Buffer& buffer, const Shape& s, const std::vector<uint16_t>& x_host,
                      const std::vector<int64_t>& ids_host, const std::vector<float>& weights_host,
                      const DeviceArray<uint16_t>& x, const DeviceArray<int64_t>& ids,
                      const DeviceArray<float>& weights, Outputs& outputs, bool pre_reduce,
                      cudaStream_t stream) {
  const StreamOrder order{stream, nullptr, false};
  LowLatencyDispatchInput in = dispatch_input(s, x.get(), ids.get(), false);
  if (pre_reduce) in.topk_weights = weights.get();
  const LowLatencyDispatchResult d = low_latency_dispatch(buffer, in, outputs.view(false, pre_reduce), order);
  DeviceArray<uint16_t> combined(size_t(s.num_tokens) * s.hidden);
  low_latency_combine(buffer, d.handle,
                      combine_input(s, outputs.recv_x.get(), ids.get(), weights.get(), false, pre_reduce),
                      combined.get(), order);
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> got = combined.download(size_t(s.num_tokens) * s.hidden);
  for (int t = 0; t < s.num_tokens; ++t) {
    for (int c = 0; c < s.hidden; ++c) {
      float acc = 0;
      for (int k = 0; k < s.num_topk; ++k) {
        if (ids_host[size_t(t) * s.num_topk + k] < 0) continue;
        const float product =
            weights_host[size_t(t) * s.num_topk + k] * bf16_to_float(x_host[size_t(t) * s.hidden + c]);
        acc = acc + product;
      }
      const float have = bf16_to_float(got[size_t(t) * s.hidden + c]);
      if (std::fabs(have - acc) > 1e-2f * std::fabs(acc) + 1e-6f) {
        EPX_FAIL("rank ", buffer.rank(), ": low-latency round trip of token ", t, " channel ", c, " gave ",
                 have, ", expected ", acc);
      }
    }
  }
}

// Events around a send-only call and, after every rank sent, around its hook: the two phases' medians.
std::pair<double, double> hook_phases_us(Bootstrap& bootstrap, cudaStream_t stream, int warmup, int iters,
                                         const std::function<LowLatencyRecvHook(int)>& send) {
  cudaEvent_t e[4];
  for (auto& ev : e) EPX_CUDA_CHECK(cudaEventCreate(&ev));
  std::vector<float> send_us, recv_us;
  for (int i = 0; i < warmup + iters; ++i) {
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    bootstrap.barrier();
    EPX_CUDA_CHECK(cudaEventRecord(e[0], stream));
    const LowLatencyRecvHook hook = send(i);
    EPX_CUDA_CHECK(cudaEventRecord(e[1], stream));
    EPX_CUDA_CHECK(cudaEventSynchronize(e[1]));
    bootstrap.barrier();  // every rank's data is in flight or landed: the receive phase only waits on it
    EPX_CUDA_CHECK(cudaEventRecord(e[2], stream));
    hook(stream);
    EPX_CUDA_CHECK(cudaEventRecord(e[3], stream));
    EPX_CUDA_CHECK(cudaEventSynchronize(e[3]));
    float a = 0, b = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&a, e[0], e[1]));
    EPX_CUDA_CHECK(cudaEventElapsedTime(&b, e[2], e[3]));
    if (i >= warmup) {
      send_us.push_back(a * 1000);
      recv_us.push_back(b * 1000);
    }
  }
  for (auto& ev : e) cudaEventDestroy(ev);
  return {median(std::move(send_us)), median(std::move(recv_us))};
}

}  // namespace

std::vector<BenchRow> run_low_latency_bench(Bootstrap& bootstrap, const BenchOptions& o) {
  const int rank = bootstrap.rank();
  const Shape s{o.ll_num_tokens, o.hidden, o.num_topk, o.ll_num_experts, bootstrap.num_ranks()};
  BufferOptions buffer_options;
  buffer_options.num_rdma_bytes =
      get_low_latency_rdma_size_hint(s.num_tokens, s.hidden, s.num_ranks, s.num_experts);
  buffer_options.ranks_per_node = o.ll_ranks_per_node;
  Buffer buffer(bootstrap, buffer_options);
  cudaStream_t stream = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::mt19937 rng(o.seed * 7 + rank);
  std::vector<DeviceArray<uint16_t>> xs;
  std::vector<std::vector<uint16_t>> xs_host;
  for (int i = 0; i < kInputSets; ++i) {
    xs_host.push_back(random_bf16(rng, size_t(s.num_tokens) * s.hidden));
    xs.emplace_back(xs_host.back());
  }
  const std::vector<int64_t> ids_host =
      reference::random_topk_idx(o.seed * 7 + rank, s.num_tokens, s.num_topk, s.num_experts);
  std::vector<float> weights_host(ids_host.size());
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (auto& w : weights_host) w = unit(rng);
  const DeviceArray<int64_t> ids(ids_host);
  const DeviceArray<float> weights(weights_host);

  const LowLatencyDispatchSizes sizes =
      low_latency_dispatch_sizes(buffer, dispatch_input(s, xs[0].get(), ids.get(), true));
  const LowLatencyDispatchSizes bf16_sizes =
      low_latency_dispatch_sizes(buffer, dispatch_input(s, xs[0].get(), ids.get(), false));
  Outputs fp8_out(sizes), bf16_out(bf16_sizes);
  DeviceArray<uint16_t> combined(size_t(s.num_tokens) * s.hidden);

  for (const bool pre_reduce : {false, true})
    check_round_trip(buffer, s, xs_host[1], ids_host, weights_host, xs[1], ids, weights, bf16_out, pre_reduce,
                     stream);

  const double selections =
      static_cast<double>(std::count_if(ids_host.begin(), ids_host.end(), [](int64_t e) { return e >= 0; }));
  const double fp8_bytes = selections * low_latency_selection_bytes(s.hidden, WireFormat::kFp8);
  const double bf16_bytes = selections * low_latency_selection_bytes(s.hidden, WireFormat::kBf16);
  const double logfmt_bytes = selections * low_latency_selection_bytes(s.hidden, WireFormat::kLogFmt);
  // Pre-reduced: the rows that cross are one per (token, rank).
  const double pre_reduced_rows_count = pre_reduced_rows(s, ids_host);
  const auto pre_reduced_bytes = [&](bool logfmt) {
    return pre_reduced_rows_count *
           low_latency_selection_bytes(s.hidden, logfmt ? WireFormat::kLogFmt : WireFormat::kBf16);
  };
  const StreamOrder order{stream, nullptr, false};
  std::vector<BenchRow> out;

  for (bool fp8 : {true, false}) {
    Outputs& outputs = fp8 ? fp8_out : bf16_out;
    int call = 0;
    const double us = median_us(bootstrap, stream, o.warmup, o.iters, nullptr, [&] {
      low_latency_dispatch(buffer, dispatch_input(s, xs[call++ % kInputSets].get(), ids.get(), fp8),
                           outputs.view(fp8), order);
    });
    out.push_back({fp8 ? "LL dispatch FP8" : "LL dispatch BF16", 0, us, fp8 ? fp8_bytes : bf16_bytes});
  }
  // Combine the rows of one BF16 dispatch (the handle stays valid for repeated combines of the same shape).
  const LowLatencyDispatchResult d = low_latency_dispatch(
      buffer, dispatch_input(s, xs[0].get(), ids.get(), false), bf16_out.view(false), order);
  for (bool logfmt : {false, true}) {
    const double us = median_us(bootstrap, stream, o.warmup, o.iters, nullptr, [&] {
      low_latency_combine(buffer, d.handle,
                          combine_input(s, bf16_out.recv_x.get(), ids.get(), weights.get(), logfmt),
                          combined.get(), order);
    });
    out.push_back(
        {logfmt ? "LL combine LogFMT" : "LL combine BF16", 0, us, logfmt ? logfmt_bytes : bf16_bytes});
  }
  // The pre-reduced combine needs a dispatch that carried the weights (its handle names the listings).
  LowLatencyDispatchInput weighted_in = dispatch_input(s, xs[0].get(), ids.get(), false);
  weighted_in.topk_weights = weights.get();
  const LowLatencyDispatchResult weighted =
      low_latency_dispatch(buffer, weighted_in, bf16_out.view(false, true), order);
  const auto pre_reduced_combine = [&](bool logfmt) {
    low_latency_combine(buffer, weighted.handle,
                        combine_input(s, bf16_out.recv_x.get(), ids.get(), weights.get(), logfmt, true),
                        combined.get(), order);
  };
  for (bool logfmt : {false, true}) {
    const double us =
        median_us(bootstrap, stream, o.warmup, o.iters, nullptr, [&] { pre_reduced_combine(logfmt); });
    out.push_back({logfmt ? "LL combine LogFMT pre-reduced" : "LL combine BF16 pre-reduced", 0, us,
                   pre_reduced_bytes(logfmt)});
  }

  // The same calls captured in a CUDA graph and replayed back to back: GPU time without the host's issue
  // cost (what a graph-captured decode step pays, and what kernel-time measurements report). Two calls per
  // graph, one in each buffer half: a replay then never sends into a half a peer may still be reading.
  const double dispatch_graph_us = median_graph_us(bootstrap, stream, o.warmup, o.iters, 2, [&] {
    for (int i = 0; i < 2; ++i)
      low_latency_dispatch(buffer, dispatch_input(s, xs[i].get(), ids.get(), true), fp8_out.view(true),
                           order);
  });
  out.push_back({"LL dispatch FP8, graph replay", 0, dispatch_graph_us, fp8_bytes});
  for (bool logfmt : {false, true}) {
    const double combine_graph_us = median_graph_us(bootstrap, stream, o.warmup, o.iters, 2, [&] {
      for (int i = 0; i < 2; ++i) {
        low_latency_combine(buffer, d.handle,
                            combine_input(s, bf16_out.recv_x.get(), ids.get(), weights.get(), logfmt),
                            combined.get(), order);
      }
    });
    out.push_back({logfmt ? "LL combine LogFMT, graph replay" : "LL combine BF16, graph replay", 0,
                   combine_graph_us, logfmt ? logfmt_bytes : bf16_bytes});
  }
  for (bool logfmt : {false, true}) {
    const double pre_reduced_graph_us = median_graph_us(bootstrap, stream, o.warmup, o.iters, 2, [&] {
      for (int i = 0; i < 2; ++i) pre_reduced_combine(logfmt);
    });
    out.push_back(
        {logfmt ? "LL combine LogFMT pre-reduced, graph replay" : "LL combine BF16 pre-reduced, graph replay",
         0, pre_reduced_graph_us, pre_reduced_bytes(logfmt)});
  }
  // The launch floor: an empty kernel of the same grid, as a call and in a graph replay. A call's overhead
  // over its graph replay that this row shows too is the launch's, not the library's. The same for one block
  // launched plainly: what is left of that overhead with nothing of the launch form's.
  const int num_blocks = buffer.num_device_sms();
  struct EmptyLaunch {
    const char* name;
    int num_blocks;
    kernels::Residency residency;
  };
  const EmptyLaunch empty_launches[] = {
      {"empty kernel, same grid", num_blocks, kernels::Residency::kCoResident},
      {"empty kernel, 1 block, plain", 1, kernels::Residency::kIndependent}};
  const auto launch_empty = [&](const EmptyLaunch& e) {
    launch_empty_kernel(e.num_blocks, e.residency, stream);
  };
  for (const EmptyLaunch& e : empty_launches) {
    out.push_back({std::string(e.name) + " (launch floor)", 0,
                   median_us(bootstrap, stream, o.warmup, o.iters, nullptr, [&] { launch_empty(e); }), 0});
    out.push_back({std::string(e.name) + ", graph replay", 0,
                   median_graph_us(bootstrap, stream, o.warmup, o.iters, 2,
                                   [&] {
                                     for (int i = 0; i < 2; ++i) launch_empty(e);
                                   }),
                   0});
  }
  // Of a call, the host's part (steady clock, call to return): the library's checks and the launch API.
  int host_call = 0;
  const double dispatch_host_us = median_host_us(bootstrap, stream, o.warmup, o.iters, nullptr, [&] {
    low_latency_dispatch(buffer, dispatch_input(s, xs[host_call++ % kInputSets].get(), ids.get(), true),
                         fp8_out.view(true), order);
  });
  out.push_back({"LL dispatch FP8, host clock", 0, dispatch_host_us, 0});
  for (const EmptyLaunch& e : empty_launches) {
    out.push_back({std::string(e.name) + ", host clock", 0,
                   median_host_us(bootstrap, stream, o.warmup, o.iters, nullptr, [&] { launch_empty(e); }),
                   0});
  }

  // Hook mode: the send and the receive phase timed apart.
  const auto [dispatch_send, dispatch_recv] =
      hook_phases_us(bootstrap, stream, o.warmup, o.iters, [&](int i) {
        LowLatencyDispatchInput in = dispatch_input(s, xs[i % kInputSets].get(), ids.get(), true);
        in.return_recv_hook = true;
        return low_latency_dispatch(buffer, in, fp8_out.view(true), order).hook;
      });
  out.push_back({"LL dispatch FP8 send (hook)", 0, dispatch_send, fp8_bytes});
  out.push_back({"LL dispatch FP8 recv (hook)", 0, dispatch_recv, fp8_bytes});
  const auto [combine_send, combine_recv] = hook_phases_us(bootstrap, stream, o.warmup, o.iters, [&](int) {
    LowLatencyCombineInput in = combine_input(s, bf16_out.recv_x.get(), ids.get(), weights.get(), false);
    in.return_recv_hook = true;
    return low_latency_combine(buffer, d.handle, in, combined.get(), order).hook;
  });
  out.push_back({"LL combine BF16 send (hook)", 0, combine_send, bf16_bytes});
  out.push_back({"LL combine BF16 recv (hook)", 0, combine_recv, bf16_bytes});

  // Where the time goes inside the kernels (EPX_LL_PHASE_STAMPS=1; nothing otherwise).
  int stamped_call = 0;
  print_low_latency_phases(buffer, bootstrap, stream, o.warmup, o.iters, "LL dispatch FP8", [&] {
    low_latency_dispatch(buffer, dispatch_input(s, xs[stamped_call++ % kInputSets].get(), ids.get(), true),
                         fp8_out.view(true), order);
  });
  for (bool logfmt : {false, true}) {
    print_low_latency_phases(
        buffer, bootstrap, stream, o.warmup, o.iters, logfmt ? "LL combine LogFMT" : "LL combine BF16", [&] {
          low_latency_combine(buffer, d.handle,
                              combine_input(s, bf16_out.recv_x.get(), ids.get(), weights.get(), logfmt),
                              combined.get(), order);
        });
  }
  for (bool logfmt : {false, true}) {
    print_low_latency_phases(buffer, bootstrap, stream, o.warmup, o.iters,
                             logfmt ? "LL combine LogFMT pre-reduced" : "LL combine BF16 pre-reduced",
                             [&] { pre_reduced_combine(logfmt); });
  }

  // NCCL: every (token, expert) selection as one row to the expert's rank, FP8-sized then BF16-sized.
  NcclAllToAll nccl(bootstrap, o.ranks_per_gpu == 1);
  if (nccl.available()) {
    std::vector<int> send_rows(s.num_ranks, 0);
    for (int64_t e : ids_host) {
      if (e >= 0) ++send_rows[e / s.num_local()];
    }
    std::vector<int> all_rows(size_t(s.num_ranks) * s.num_ranks);
    const std::vector<std::byte> gathered = bootstrap.all_gather(send_rows.data(), sizeof(int) * s.num_ranks);
    std::memcpy(all_rows.data(), gathered.data(), gathered.size());
    for (bool fp8 : {true, false}) {
      const size_t row_bytes = fp8 ? size_t(s.hidden) + s.hidden / 32 + 16 : size_t(s.hidden) * 2;
      std::vector<size_t> send_bytes(s.num_ranks), recv_bytes(s.num_ranks);
      size_t total_send = 0, total_recv = 0;
      for (int r = 0; r < s.num_ranks; ++r) {
        send_bytes[r] = row_bytes * send_rows[r];
        recv_bytes[r] = row_bytes * all_rows[size_t(r) * s.num_ranks + rank];
        total_send += send_bytes[r];
        total_recv += recv_bytes[r];
      }
      DeviceArray<uint8_t> send(total_send), recv(total_recv);
      EPX_CUDA_CHECK(cudaMemset(send.get(), 0x3c, std::max<size_t>(total_send, 1)));
      const double us = median_us(bootstrap, stream, o.warmup, o.iters, nullptr,
                                  [&] { nccl.run(send.get(), send_bytes, recv.get(), recv_bytes, stream); });
      out.push_back({fp8 ? "NCCL all-to-all FP8 selections" : "NCCL all-to-all BF16 selections", 0, us,
                     fp8 ? fp8_bytes : bf16_bytes});
    }
  }
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  EPX_CUDA_CHECK(cudaStreamDestroy(stream));
  buffer.destroy();
  return out;
}

}  // namespace epx::bench
