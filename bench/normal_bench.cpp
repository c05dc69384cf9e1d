#include "normal_bench.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_bytes.hpp"
#include "bench_data.hpp"
#include "buffer_map/combine_staging_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "epx/buffer.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "epx/normal.hpp"
#include "formats/bf16.hpp"
#include "formats/fp8.hpp"
#include "nccl_baseline.hpp"
#include "reference/test_data.hpp"
#include "runtime/normal_host_scratch.hpp"
#include "timing.hpp"

namespace epx::bench {

namespace {

// EPX_NORMAL_PHASES=1: the reports so far are dropped, so the next op's rows count only its own launches.
void start_phase_reports(const Buffer& buffer, cudaStream_t stream) {
  if (!phase_reports_requested()) return;
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  take_phase_reports(buffer);
}

// EPX_NORMAL_PHASES=1: after an op was timed, where the leader of each stream of channel 0 spent its time,
// per launch (kernels/phase_clock.cuh): rows "  phases <stream>: <step>" in µs at the GPU's clock rate (the
// share of the whole matters more than the µs). Nothing otherwise.
void add_phase_rows(const Buffer& buffer, cudaStream_t stream, int sms, std::vector<BenchRow>& out) {
  if (!phase_reports_requested()) return;
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  int khz = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, buffer.device()));
  static constexpr const char* kStreams[kernels::kPhaseStreams] = {
      "dispatch send",        "dispatch receive",  "combine send",        "send across nodes",
      "forward across nodes", "dispatch own rows", "reduce across nodes", "combine across nodes",
      "notify across nodes",  "combine reduce"};
  // nullptr: the stream has no such step (no row).
  static constexpr const char* kSteps[kernels::kPhaseStreams][kernels::PhaseReport::kPhases] = {
      {"room", "write", "publish", nullptr},
      {"wait", "copy", "release", nullptr},
      {"room", "write", "publish", nullptr},
      {"room", "write", "publish", nullptr},
      {"poll", "copy", "give back", nullptr},
      {"scan", "copy", "drain", nullptr},
      {"room", "sum", "publish", nullptr},
      {"wait", "sum", "give back", nullptr},
      {"channel counts", "messages", "host counts", nullptr},
      {"wait", "add and store", "batch end", "loads landing"}};
  const auto reports = take_phase_reports(buffer);
  // The latest launch's streams on the GPU's global timer, from the earliest leader's start (its end less its
  // cycles at the device's clock rate).
  const auto begin_ns = [&](const kernels::PhaseReport& r) {
    return static_cast<double>(r.last_end_ns) - r.last_cycles * 1e6 / khz;
  };
  double first_begin_ns = std::numeric_limits<double>::infinity();
  for (const kernels::PhaseReport& r : reports) {
    if (r.launches > 0) first_begin_ns = std::min(first_begin_ns, begin_ns(r));
  }
  for (int s = 0; s < kernels::kPhaseStreams; ++s) {
    const kernels::PhaseReport& r = reports[s];
    if (r.launches == 0) continue;
    const double us_per_launch = 1e3 / khz / r.launches;
    const std::string stream_name = std::string("  phases ") + kStreams[s];
    out.push_back({stream_name + ": all (" + std::to_string(r.records / r.launches) + " records)", sms,
                   r.total_cycles * us_per_launch, 0});
    for (int p = 0; p < kernels::PhaseReport::kPhases; ++p) {
      if (kSteps[s][p] != nullptr)
        out.push_back({stream_name + ": " + kSteps[s][p], sms, r.cycles[p] * us_per_launch, 0});
    }
    out.push_back({stream_name + ": starts, last launch (from the first leader's start)", sms,
                   (begin_ns(r) - first_begin_ns) / 1e3, 0});
    out.push_back({stream_name + ": ends, last launch (from the first leader's start)", sms,
                   (r.last_end_ns - first_begin_ns) / 1e3, 0});
  }
}

// Token contents any rank can recompute for any (source rank, token, channel): lets every rank verify every
// row it received without holding the other ranks' inputs. Changes with `salt` so each check has fresh data.
uint32_t mix(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}
// BF16 of magnitude in [1/128, 2): normal numbers whose sum of up to 8 copies is exact in float.
uint16_t bf16_value(uint32_t salt, int rank, int token, int channel) {
  const uint32_t h = mix(salt + rank, token, channel);
  return static_cast<uint16_t>(((h & 1) << 15) | ((120 + (h >> 1) % 8) << 7) | ((h >> 4) & 0x7F));
}
// FP8 e4m3 byte that is not NaN (0x7F / 0xFF).
uint8_t fp8_value(uint32_t salt, int rank, int token, int channel) {
  const uint8_t byte = static_cast<uint8_t>(mix(salt + rank, token, channel + 1000003));
  return (byte & 0x7F) == 0x7F ? byte - 1 : byte;
}

struct RankData {
  std::vector<uint16_t> x_bf16;
  std::vector<uint8_t> x_fp8;
  std::vector<float> scales;
  std::vector<int64_t> topk_idx;
  std::vector<float> topk_weights;
};

RankData make_rank_data(const BenchOptions& o, int rank, uint32_t salt) {
  RankData d;
  const size_t cells = size_t(o.num_tokens) * o.hidden;
  d.x_bf16.resize(cells);
  d.x_fp8.resize(cells);
  for (int t = 0; t < o.num_tokens; ++t) {
    for (int c = 0; c < o.hidden; ++c) {
      d.x_bf16[size_t(t) * o.hidden + c] = bf16_value(salt, rank, t, c);
      d.x_fp8[size_t(t) * o.hidden + c] = fp8_value(salt, rank, t, c);
    }
  }
  std::mt19937 rng(salt * 131 + rank);
  std::uniform_real_distribution<float> unit(0.5f, 2.0f);
  d.scales.resize(size_t(o.num_tokens) * (o.hidden / kFp8GroupSize));
  for (auto& s : d.scales) s = unit(rng);
  d.topk_idx = reference::random_topk_idx(salt * 131 + rank, o.num_tokens, o.num_topk, o.num_experts);
  d.topk_weights.resize(d.topk_idx.size());
  for (auto& w : d.topk_weights) w = unit(rng);
  return d;
}

// Device-side inputs, layout and outputs of one rank, sized for the worst case (every token to every rank).
struct Workspace {
  DeviceArray<uint16_t> x_bf16;
  DeviceArray<uint8_t> x_fp8;
  DeviceArray<float> scales;
  DeviceArray<int64_t> topk_idx;
  DeviceArray<float> topk_weights;
  DeviceArray<int> num_tokens_per_rank, num_tokens_per_expert;
  DeviceArray<int> num_tokens_per_node;  // across nodes: get_dispatch_layout's num_tokens_per_rdma_rank
  DeviceArray<bool> is_token_in_rank;
  DeviceArray<uint16_t> recv_x;  // also holds FP8 rows
  DeviceArray<float> recv_scales, recv_topk_weights;
  DeviceArray<int64_t> recv_topk_idx;
  DeviceArray<uint16_t> combined;
  DeviceArray<float> combined_weights;

  Workspace(const BenchOptions& o, int num_ranks, int num_nodes)
      : x_bf16(size_t(o.num_tokens) * o.hidden),
        x_fp8(size_t(o.num_tokens) * o.hidden),
        scales(size_t(o.num_tokens) * (o.hidden / kFp8GroupSize)),
        topk_idx(size_t(o.num_tokens) * o.num_topk),
        topk_weights(size_t(o.num_tokens) * o.num_topk),
        num_tokens_per_rank(num_ranks),
        num_tokens_per_expert(o.num_experts),
        num_tokens_per_node(num_nodes),
        is_token_in_rank(size_t(o.num_tokens) * num_ranks),
        recv_x(size_t(num_ranks) * o.num_tokens * o.hidden),
        recv_scales(size_t(num_ranks) * o.num_tokens * (o.hidden / kFp8GroupSize)),
        recv_topk_weights(size_t(num_ranks) * o.num_tokens * o.num_topk),
        recv_topk_idx(size_t(num_ranks) * o.num_tokens * o.num_topk),
        combined(size_t(o.num_tokens) * o.hidden),
        combined_weights(size_t(o.num_tokens) * o.num_topk) {}

  void upload(const RankData& d) {
    x_bf16.upload(d.x_bf16);
    x_fp8.upload(d.x_fp8);
    scales.upload(d.scales);
    topk_idx.upload(d.topk_idx);
    topk_weights.upload(d.topk_weights);
  }
  DispatchInput input(const BenchOptions& o, TokenFormat format) const {
    DispatchInput in;
    in.format = format;
    in.x = format == TokenFormat::kBf16 ? static_cast<const void*>(x_bf16.get()) : x_fp8.get();
    in.x_scales = format == TokenFormat::kFp8 ? scales.get() : nullptr;
    in.num_tokens = o.num_tokens;
    in.hidden = o.hidden;
    in.topk_idx = topk_idx.get();
    in.topk_weights = topk_weights.get();
    in.num_topk = o.num_topk;
    in.num_experts = o.num_experts;
    in.is_token_in_rank = is_token_in_rank.get();
    in.num_tokens_per_expert = num_tokens_per_expert.get();
    in.num_tokens_per_rank = num_tokens_per_rank.get();
    return in;
  }
  DispatchOutput output(TokenFormat format) const {
    return DispatchOutput{recv_x.get(), format == TokenFormat::kFp8 ? recv_scales.get() : nullptr,
                          recv_topk_idx.get(), recv_topk_weights.get()};
  }
};

DispatchPlan dispatch(Buffer& buffer, const DispatchInput& in, const DispatchOutput& out, cudaStream_t stream,
                      DispatchOverlap overlap = DispatchOverlap::kNone,
                      const DispatchOutputGuess* guess = nullptr) {
  const StreamOrder order{stream, nullptr, false};
  DispatchPlan plan = dispatch_notify(buffer, in, order, nullptr, overlap, guess);
  dispatch_receive(buffer, plan, in, out, order);
  return plan;
}

// A dispatch with the routing of `handle` (no count exchange, no host sync), as a cached dispatch runs.
void cached_dispatch(Buffer& buffer, const DispatchHandle& handle, const DispatchInput& in,
                     const DispatchOutput& out, cudaStream_t stream) {
  const StreamOrder order{stream, nullptr, false};
  DispatchPlan again = dispatch_notify(buffer, in, order, &handle);
  dispatch_receive(buffer, again, in, out, order);
}

// Outputs of `rows` rows carved from the start of `buffer`'s output window, each 16-byte aligned: recv_x, FP8
// scales (`fp8`), top-k ids and weights (`topk` > 0).
DispatchOutput window_outputs(const Buffer& buffer, size_t rows, int hidden, bool fp8, int topk) {
  char* next = static_cast<char*>(buffer.nvl_output_window());
  const auto carve = [&](size_t bytes) {
    char* at = next;
    next += (bytes + 15) / 16 * 16;
    return at;
  };
  DispatchOutput out;
  out.recv_x = carve(rows * hidden * (fp8 ? 1 : 2));
  if (fp8) out.recv_x_scales = reinterpret_cast<float*>(carve(rows * (hidden / 128) * sizeof(float)));
  if (topk > 0) {
    out.recv_topk_idx = reinterpret_cast<int64_t*>(carve(rows * topk * sizeof(int64_t)));
    out.recv_topk_weights = reinterpret_cast<float*>(carve(rows * topk * sizeof(float)));
  }
  return out;
}

// The rows `run(outputs)` writes into the output window (`wout`) are byte for byte those it writes through
// the queues into `out`.
void check_window_rows(Buffer& buffer, const std::function<void(const DispatchOutput&)>& run,
                       const DispatchOutput& out, const DispatchOutput& wout, size_t rows, int hidden,
                       int topk, cudaStream_t stream) {
  run(out);
  run(wout);
  buffer.synchronize(stream);
  const auto same = [&](const void* a, const void* b, size_t bytes, const char* what) {
    if (b == nullptr) return;
    std::vector<char> ha(bytes), hb(bytes);
    EPX_CUDA_CHECK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
    EPX_CUDA_CHECK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
    EPX_CHECK(ha == hb, what, "differs", "must equal the queue's rows (dispatch into the output window)");
  };
  const bool fp8 = wout.recv_x_scales != nullptr;
  same(out.recv_x, wout.recv_x, rows * hidden * (fp8 ? 1 : 2), "recv_x");
  same(out.recv_x_scales, wout.recv_x_scales, rows * (hidden / 128) * sizeof(float), "recv_x_scales");
  same(out.recv_topk_idx, wout.recv_topk_idx, rows * topk * sizeof(int64_t), "recv_topk_idx");
  same(out.recv_topk_weights, wout.recv_topk_weights, rows * topk * sizeof(float), "recv_topk_weights");
}

// Every received row holds the source's token, checked from the source rank and index the handle records;
// the identity combine returns each token times the number of ranks it went to (across nodes: the sum over
// the nodes it went to of its copies there, each node's partial rounded to BF16, as
// reference::internode_combine orders it; with one node that is one rounding of token x copies).
void check_round_trip(Buffer& buffer, Workspace& ws, const BenchOptions& o, const RankData& mine,
                      uint32_t salt, TokenFormat format, cudaStream_t stream) {
  const int rank = buffer.rank();
  const DispatchPlan plan = dispatch(buffer, ws.input(o, format), ws.output(format), stream);
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int rows = plan.num_recv_rows;
  const std::vector<int> src_idx = [&] {
    std::vector<int> v(rows);
    if (rows > 0) {
      EPX_CUDA_CHECK(cudaMemcpy(v.data(), plan.handle.recv_src_idx_device(), sizeof(int) * rows,
                                cudaMemcpyDeviceToHost));
    }
    return v;
  }();
  const std::vector<int>& per_rank = plan.handle.num_recv_per_rank();
  const size_t row_elems = format == TokenFormat::kBf16 ? size_t(o.hidden) : size_t(o.hidden) / 2;
  const std::vector<uint16_t> recv = ws.recv_x.download(size_t(rows) * row_elems);
  int row = 0;
  for (int src = 0; src < buffer.num_ranks(); ++src) {
    for (int i = 0; i < per_rank[src]; ++i, ++row) {
      const int token = src_idx[row];
      for (int c = 0; c < o.hidden; ++c) {
        const bool same = format == TokenFormat::kBf16
                              ? recv[size_t(row) * o.hidden + c] == bf16_value(salt, src, token, c)
                              : reinterpret_cast<const uint8_t*>(recv.data())[size_t(row) * o.hidden + c] ==
                                    fp8_value(salt, src, token, c);
        if (!same) {
          EPX_FAIL("rank ", rank, ": received row ", row, " (source rank ", src, ", token ", token,
                   ") differs at channel ", c);
        }
      }
    }
  }
  EPX_CHECK(row == rows, "num_recv_rows", rows, "must equal the sum of rows received per source rank");
  if (format != TokenFormat::kBf16) return;

  combine(buffer, plan.handle, CombineInput{ws.recv_x.get(), nullptr, 0, nullptr, nullptr},
          CombineOutput{ws.combined.get(), nullptr}, StreamOrder{stream, nullptr, false});
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> combined = ws.combined.download(size_t(o.num_tokens) * o.hidden);
  const int num_local = o.num_experts / buffer.num_ranks();
  const int ranks_per_node = buffer.ranks_per_node();
  const int num_nodes = buffer.num_ranks() / ranks_per_node;
  std::vector<int> node_copies(num_nodes);
  for (int t = 0; t < o.num_tokens; ++t) {
    int copies = 0;
    std::fill(node_copies.begin(), node_copies.end(), 0);
    for (int r = 0; r < buffer.num_ranks(); ++r) {
      bool chosen = false;
      for (int k = 0; k < o.num_topk; ++k)
        chosen |= mine.topk_idx[size_t(t) * o.num_topk + k] / num_local == r;
      copies += chosen;
      node_copies[r / ranks_per_node] += chosen;
    }
    for (int c = 0; c < o.hidden; ++c) {
      const float x = bf16_to_float(mine.x_bf16[size_t(t) * o.hidden + c]);
      float sum = 0.0f;
      for (int n = 0; n < num_nodes; ++n) {
        if (node_copies[n] > 0) sum += bf16_to_float(float_to_bf16(x * node_copies[n]));
      }
      const uint16_t want = float_to_bf16(sum);
      if (combined[size_t(t) * o.hidden + c] != want) {
        EPX_FAIL("rank ", rank, ": combined token ", t, " channel ", c, " is ",
                 combined[size_t(t) * o.hidden + c], ", expected ", want, " (", copies, " copies)");
      }
    }
  }
}

// The config of the benchmark's calls with `num_sms`: within one node the recommended one for the rank count
// and the GPU kind (what deep_ep callers run without a config), the NVLink chunk and queue flags overriding
// it; across nodes across_nodes_config (a Buffer's first config there), the network chunk and queue flags
// overriding it. The kind changes send chunks only, never a buffer size.
Config bench_config(const BenchOptions& o, ConfigFor op, int num_ranks, bool across_nodes, int num_sms,
                    GpuKind kind) {
  if (across_nodes) {
    Config config = across_nodes_config(num_sms);
    if (o.rdma_send_chunk > 0) config.num_max_rdma_chunked_send_tokens = o.rdma_send_chunk;
    if (o.rdma_queue_tokens > 0) config.num_max_rdma_chunked_recv_tokens = o.rdma_queue_tokens;
    validate_config(config);
    return config;
  }
  Config config = recommended_config(op, num_ranks, num_sms, kind);
  if (o.nvl_send_chunk > 0) config.num_max_nvl_chunked_send_tokens = o.nvl_send_chunk;
  if (o.nvl_queue_tokens > 0) config.num_max_nvl_chunked_recv_tokens = o.nvl_queue_tokens;
  validate_config(config);
  return config;
}

// --tune's sweep: NVLink send chunks and queue sizes (a chunk larger than its queue is skipped).
constexpr std::array<int, 8> kTuneSendChunks{4, 8, 12, 16, 24, 32, 48, 64};
constexpr std::array<int, 3> kTuneQueueTokens{128, 256, 512};

// For each SM budget and (chunk, queue) of the sweep: the cached dispatch (BF16, FP8) and the combine, back
// to back, each row named by tuned_row_name.
std::vector<BenchRow> tune_sweep(Buffer& buffer, const Workspace& ws, const BenchOptions& o,
                                 cudaStream_t stream,
                                 const std::function<double(const std::function<void()>&)>& back_to_back,
                                 double bf16_bytes, double fp8_bytes) {
  std::vector<BenchRow> rows;
  for (int sms : o.num_sms) {
    for (int queue : kTuneQueueTokens) {
      for (int chunk : kTuneSendChunks) {
        if (chunk > queue) continue;
        Config config;
        config.num_sms = sms;
        config.num_max_nvl_chunked_send_tokens = chunk;
        config.num_max_nvl_chunked_recv_tokens = queue;
        buffer.set_config(config);
        const DispatchPlan plan =
            dispatch(buffer, ws.input(o, TokenFormat::kBf16), ws.output(TokenFormat::kBf16), stream);
        EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (TokenFormat format : {TokenFormat::kBf16, TokenFormat::kFp8}) {
          const DispatchInput in = ws.input(o, format);
          const DispatchOutput out = ws.output(format);
          const double us = back_to_back([&] { cached_dispatch(buffer, plan.handle, in, out, stream); });
          const bool bf16 = format == TokenFormat::kBf16;
          rows.push_back({tuned_row_name(bf16 ? "dispatch BF16 cached" : "dispatch FP8 cached", chunk, queue),
                          sms, us, bf16 ? bf16_bytes : fp8_bytes});
          // The same into the output window (the senders store straight into the outputs), when it has one.
          if (buffer.num_nvl_output_bytes() == 0) continue;
          const DispatchOutput wout =
              window_outputs(buffer, size_t(plan.handle.num_recv_rows()), o.hidden, !bf16, 0);
          const double window_us =
              back_to_back([&] { cached_dispatch(buffer, plan.handle, in, wout, stream); });
          rows.push_back(
              {tuned_row_name(bf16 ? "dispatch BF16 cached into window" : "dispatch FP8 cached into window",
                              chunk, queue),
               sms, window_us, bf16 ? bf16_bytes : fp8_bytes});
        }
        const CombineInput cin{ws.recv_x.get(), ws.recv_topk_weights.get(), o.num_topk, nullptr, nullptr};
        const CombineOutput cout{ws.combined.get(), ws.combined_weights.get()};
        const double us = back_to_back([&] {
          combine(buffer, plan.handle, cin, cout, StreamOrder{stream, nullptr, false});
        });
        rows.push_back({tuned_row_name("combine BF16", chunk, queue), sms, us, bf16_bytes});
      }
    }
  }
  return rows;
}

// Why the earlier isolated timing (host barrier alone) read far above back to back: the same call timed that
// way, the ranks' barrier-exit skew it held, and the host's cost of the call on an idle GPU (the start event
// fires before the host has launched anything).
void add_timing_study(Bootstrap& bootstrap, cudaStream_t stream, const BenchOptions& o,
                      const std::function<void()>& flush, const std::function<void()>& call, int sms,
                      double bytes, std::vector<BenchRow>& out) {
  BarrierExits exits;
  const double barrier_only_us =
      median_us(bootstrap, stream, o.warmup, o.iters, flush, call, StartAlign::kHostBarrier, &exits);
  out.push_back({"dispatch BF16 cached, host barrier alone", sms, barrier_only_us, bytes});
  out.push_back(
      {"  of which ranks' barrier-exit skew (host)", sms, barrier_exit_skew_us(bootstrap, exits), 0});
  out.push_back({"  host time of the call (GPU idle)", sms,
                 median_host_us(bootstrap, stream, o.warmup, o.iters, flush, call), 0});
}

}  // namespace

std::vector<BenchRow> run_normal_bench(Bootstrap& bootstrap, const BenchOptions& o) {
  const int rank = bootstrap.rank(), num_ranks = bootstrap.num_ranks();
  EPX_CHECK(o.hidden % kFp8GroupSize == 0, "hidden", o.hidden,
            "must be a multiple of 128 (FP8 dispatch is benchmarked)");
  BufferOptions buffer_options;
  const int ranks_per_node = normal_ranks_per_node(o, num_ranks);
  const int num_nodes = num_ranks / ranks_per_node;
  const bool across_nodes = num_nodes > 1;
  // Sized for the widest SM budget of the sweep or of the checks (the default queue sizes); the size does not
  // depend on tokens. Across nodes: the network queues in the symmetric buffer; the NVLink hint of up to 8
  // ranks also covers the forwarding queues of any split into virtual nodes.
  const int widest_sms =
      std::max(buffer_options.num_sms, *std::max_element(o.num_sms.begin(), o.num_sms.end()));
  EPX_CHECK(!o.tune || !across_nodes, "--tune", "with --ranks-per-node",
            "tunes the NVLink queues of one node");
  Config widest = bench_config(o, ConfigFor::kDispatch, num_ranks, across_nodes, widest_sms, GpuKind::kOther);
  if (o.tune) widest.num_max_nvl_chunked_recv_tokens = kTuneQueueTokens.back();
  const size_t hidden_bytes = size_t(o.hidden) * 2;
  buffer_options.num_nvl_bytes =
      std::max(widest.get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
               bench_config(o, ConfigFor::kCombine, num_ranks, across_nodes, widest_sms, GpuKind::kOther)
                   .get_nvl_buffer_size_hint(hidden_bytes, num_ranks));
  // Within one node an output window for every row a rank can receive: the cached dispatch is also timed
  // with its outputs there (the senders store straight into them, no queue).
  // A row's outputs: BF16 row, FP8 scales, top-k ids and weights (its source index goes through the queues).
  const size_t window_row_bytes = size_t(o.hidden) * 2 + size_t(o.hidden) / 32 + size_t(o.num_topk) * 12;
  if (!across_nodes) {
    buffer_options.num_nvl_output_bytes = size_t(num_ranks) * o.num_tokens * window_row_bytes + 1024;
    buffer_options.num_nvl_bytes += buffer_options.num_nvl_output_bytes;
    if (o.staging && num_ranks > 1) {
      // A slot per peer for all of its rows: a BF16 row and its top-k weights each.
      const size_t slot = size_t(o.num_tokens) * (hidden_bytes + sizeof(float) * o.num_topk) + kNormalAlign;
      buffer_options.num_nvl_staging_bytes = CombineStagingMap::kFlagBytes + size_t(num_ranks - 1) * slot;
      buffer_options.num_nvl_bytes += buffer_options.num_nvl_staging_bytes;
    }
  }
  if (across_nodes) {
    buffer_options.ranks_per_node = ranks_per_node;
    buffer_options.num_rdma_bytes = widest.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node);
  }
  Buffer buffer(bootstrap, buffer_options);
  // The checks below run with the first budget's config: the Buffer's own first config has Config's queue
  // sizes, which a smaller --rdma-queue / --nvl-queue would have sized the buffer too small for.
  buffer.set_config(
      bench_config(o, ConfigFor::kDispatch, num_ranks, across_nodes, o.num_sms.front(), buffer.gpu_kind()));
  cudaStream_t stream = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Workspace ws(o, num_ranks, num_nodes);

  // The layout of the workspace's tokens, as every dispatch below needs it.
  const auto run_layout = [&] {
    get_dispatch_layout(buffer, ws.topk_idx.get(), o.num_tokens, o.num_topk, o.num_experts,
                        DispatchLayoutOutput{ws.num_tokens_per_rank.get(), ws.num_tokens_per_expert.get(),
                                             ws.is_token_in_rank.get(),
                                             across_nodes ? ws.num_tokens_per_node.get() : nullptr},
                        StreamOrder{stream, nullptr, false});
  };
  // Correctness first, on two fresh input sets, then keep the last one for timing.
  RankData mine;
  for (uint32_t salt : {o.seed * 2 + 1, o.seed * 2 + 2}) {
    mine = make_rank_data(o, rank, salt);
    ws.upload(mine);
    run_layout();
    check_round_trip(buffer, ws, o, mine, salt, TokenFormat::kBf16, stream);
    check_round_trip(buffer, ws, o, mine, salt, TokenFormat::kFp8, stream);
  }

  const DispatchPlan plan =
      dispatch(buffer, ws.input(o, TokenFormat::kBf16), ws.output(TokenFormat::kBf16), stream);
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double rows = plan.num_recv_rows;
  const double bf16_bytes = rows * normal_row_bytes(o.hidden, false);
  const double fp8_bytes = rows * normal_row_bytes(o.hidden, true);
  // Across nodes: what crosses between nodes (sent in dispatch, received back in combine).
  double network_rows = 0;
  if (across_nodes) {
    const std::vector<int> per_node = ws.num_tokens_per_node.download(num_nodes);
    network_rows = internode_network_rows(per_node.data(), num_nodes, rank / ranks_per_node);
  }
  const double bf16_network_bytes = network_rows * normal_row_bytes(o.hidden, false);
  const double fp8_network_bytes = network_rows * normal_row_bytes(o.hidden, true);

  L2Flusher flusher;
  auto flush = [&] { flusher.flush(stream); };
  // Two timings of each headline op (docs/BENCHMARKS.md, "Two timings"): back to back, the L2 flushed once
  // before calls queued as a training loop queues them (the headline rows); and isolated, the L2 flushed and
  // the ranks aligned on the device before each call (the "(isolated)" rows and the breakdown rows).
  const auto back_to_back = [&](const std::function<void()>& body) {
    return median_back_to_back_us(bootstrap, stream, o.warmup, o.iters, flush, body);
  };
  const auto isolated = [&](const std::function<void()>& prepare, const std::function<void()>& body) {
    return median_us(bootstrap, stream, o.warmup, o.iters, prepare, body, StartAlign::kDeviceDelay);
  };
  if (o.tune) {
    std::vector<BenchRow> tuned = tune_sweep(buffer, ws, o, stream, back_to_back, bf16_bytes, fp8_bytes);
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    EPX_CUDA_CHECK(cudaStreamDestroy(stream));
    buffer.destroy();
    return tuned;
  }
  std::vector<BenchRow> out;
  bool studied = false;
  for (int sms : o.num_sms) {
    const Config dispatch_config =
        bench_config(o, ConfigFor::kDispatch, num_ranks, across_nodes, sms, buffer.gpu_kind());
    const Config combine_config =
        bench_config(o, ConfigFor::kCombine, num_ranks, across_nodes, sms, buffer.gpu_kind());
    buffer.set_config(dispatch_config);
    // The handle splits tokens into the channels of the SM budget it was made with: one per budget, so the
    // cached dispatch and the combine below run on `sms` SMs too.
    const DispatchPlan sms_plan =
        dispatch(buffer, ws.input(o, TokenFormat::kBf16), ws.output(TokenFormat::kBf16), stream);
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (TokenFormat format : {TokenFormat::kBf16, TokenFormat::kFp8}) {
      const DispatchInput in = ws.input(o, format);
      const DispatchOutput dout = ws.output(format);
      const auto full_dispatch = [&] { dispatch(buffer, in, dout, stream); };
      const bool bf16 = format == TokenFormat::kBf16;
      const double nvl_bytes = bf16 ? bf16_bytes : fp8_bytes;
      const double network_bytes = bf16 ? bf16_network_bytes : fp8_network_bytes;
      out.push_back({bf16 ? "dispatch BF16" : "dispatch FP8", sms, back_to_back(full_dispatch), nvl_bytes,
                     network_bytes});
      out.push_back({bf16 ? "dispatch BF16 (isolated)" : "dispatch FP8 (isolated)", sms,
                     isolated(flush, full_dispatch), nvl_bytes, network_bytes});
      // The first step alone (count exchange and host sync): the rest of the time moves the rows.
      const auto notify_alone = [&] { dispatch_notify(buffer, in, StreamOrder{stream, nullptr, false}); };
      start_phase_reports(buffer, stream);
      const double notify_us = isolated(flush, notify_alone);
      out.push_back({bf16 ? "  of which notify (BF16)" : "  of which notify (FP8)", sms, notify_us, 0});
      add_phase_rows(buffer, stream, sms, out);
      // The receive launched with the count exchange, its outputs handed over through host-mapped memory
      // (within one node: across nodes the receive always follows the host's wait).
      if (!across_nodes) {
        // As callers run it: each dispatch right after its get_dispatch_layout (run untimed, before the L2
        // flush), so the host reads its counts off the layout board instead of waiting for the notify kernel.
        const auto layout_then_flush = [&] {
          run_layout();
          flush();
        };
        const double after_layout_us = isolated(layout_then_flush, full_dispatch);
        out.push_back({bf16 ? "dispatch BF16 after its layout" : "dispatch FP8 after its layout", sms,
                       after_layout_us, nvl_bytes});
        const double notify_after_layout_us = isolated(layout_then_flush, notify_alone);
        out.push_back(
            {bf16 ? "  of which notify after its layout (BF16)" : "  of which notify after its layout (FP8)",
             sms, notify_after_layout_us, 0});
        // The same on the host's clock: the call's return, with its counts (the notify kernel may still run).
        const double notify_host_us =
            median_host_us(bootstrap, stream, o.warmup, o.iters, layout_then_flush, notify_alone);
        out.push_back(
            {bf16 ? "  host has counts after its layout (BF16)" : "  host has counts after its layout (FP8)",
             sms, notify_host_us, 0});
        const double notify_host_old_us =
            median_host_us(bootstrap, stream, o.warmup, o.iters, flush, notify_alone);
        out.push_back({bf16 ? "  host has counts, no layout before (BF16)"
                            : "  host has counts, no layout before (FP8)",
                       sms, notify_host_old_us, 0});
        const double launched_us =
            isolated(flush, [&] { dispatch(buffer, in, dout, stream, DispatchOverlap::kLaunchReceive); });
        out.push_back({bf16 ? "dispatch BF16 receive with notify" : "dispatch FP8 receive with notify", sms,
                       launched_us, nvl_bytes});
        // Launched likewise into outputs allocated beforehand (the workspace's, room for every rank's
        // tokens), as epx.Buffer.dispatch does with the last call's rows plus a margin: no host hand-over.
        const DispatchOutputGuess guess{dout, num_ranks * o.num_tokens};
        const double guessed_us = isolated(
            flush, [&] { dispatch(buffer, in, dout, stream, DispatchOverlap::kLaunchReceive, &guess); });
        out.push_back({bf16 ? "dispatch BF16 receive into guess" : "dispatch FP8 receive into guess", sms,
                       guessed_us, nvl_bytes});
        // As epx.Buffer.dispatch runs it: after its layout, into a guess the rows fit.
        const double guessed_after_layout_us = isolated(layout_then_flush, [&] {
          dispatch(buffer, in, dout, stream, DispatchOverlap::kLaunchReceive, &guess);
        });
        out.push_back(
            {bf16 ? "dispatch BF16 into guess after its layout" : "dispatch FP8 into guess after its layout",
             sms, guessed_after_layout_us, nvl_bytes});
        // Of that, the step up to the host having the counts (the count exchange runs inside the receive's
        // launch): dispatch_notify alone, the receive completed before the next run.
        const StreamOrder order{stream, nullptr, false};
        std::optional<DispatchPlan> pending;
        const auto complete = [&] {
          if (pending) dispatch_receive(buffer, *pending, in, dout, order);  // orders the stream after it
          pending.reset();
        };
        const double counts_us = isolated(
            [&] {
              complete();
              flush();
            },
            [&] {
              pending = dispatch_notify(buffer, in, order, nullptr, DispatchOverlap::kLaunchReceive, &guess);
            });
        complete();
        out.push_back({bf16 ? "  of which counts, into guess (BF16)" : "  of which counts, into guess (FP8)",
                       sms, counts_us, 0});
      }
      // Cached: the layout of a previous call, no count exchange and no host sync.
      const auto cached = [&] { cached_dispatch(buffer, sms_plan.handle, in, dout, stream); };
      start_phase_reports(buffer, stream);
      out.push_back({bf16 ? "dispatch BF16 cached" : "dispatch FP8 cached", sms, back_to_back(cached),
                     nvl_bytes, network_bytes});
      add_phase_rows(buffer, stream, sms, out);
      out.push_back({bf16 ? "dispatch BF16 cached (isolated)" : "dispatch FP8 cached (isolated)", sms,
                     isolated(flush, cached), nvl_bytes, network_bytes});
      if (!across_nodes && num_ranks > 1) {
        // Both dispatches again into the output window (the senders store straight into the outputs there).
        const DispatchOutput full_wout = window_outputs(buffer, size_t(rows), o.hidden, !bf16, o.num_topk);
        const auto full_into_window = [&](const DispatchOutput& to) { dispatch(buffer, in, to, stream); };
        check_window_rows(buffer, full_into_window, dout, full_wout, size_t(rows), o.hidden, o.num_topk,
                          stream);
        out.push_back({bf16 ? "dispatch BF16 into window" : "dispatch FP8 into window", sms,
                       back_to_back([&] { full_into_window(full_wout); }), nvl_bytes, network_bytes});
        // The receive launched with the count exchange, into a guess in the window that the rows fit: the
        // launch learns from the counts that it takes the window's way.
        const auto guessed_into_window = [&](const DispatchOutput& to) {
          const DispatchOutputGuess guess{to, static_cast<int>(rows)};
          dispatch(buffer, in, to, stream, DispatchOverlap::kLaunchReceive, &guess);
        };
        check_window_rows(buffer, guessed_into_window, dout, full_wout, size_t(rows), o.hidden, o.num_topk,
                          stream);
        out.push_back({bf16 ? "dispatch BF16 into window, launched into a guess"
                            : "dispatch FP8 into window, launched into a guess",
                       sms, back_to_back([&] { guessed_into_window(full_wout); }), nvl_bytes, network_bytes});
        const DispatchOutput wout = window_outputs(buffer, size_t(rows), o.hidden, !bf16, 0);
        const auto cached_to = [&](const DispatchOutput& to) {
          cached_dispatch(buffer, sms_plan.handle, in, to, stream);
        };
        const auto into_window = [&] { cached_to(wout); };
        check_window_rows(buffer, cached_to, dout, wout, size_t(rows), o.hidden, 0, stream);
        start_phase_reports(buffer, stream);
        out.push_back({bf16 ? "dispatch BF16 cached into window" : "dispatch FP8 cached into window", sms,
                       back_to_back(into_window), nvl_bytes, network_bytes});
        add_phase_rows(buffer, stream, sms, out);
        out.push_back({bf16 ? "dispatch BF16 cached into window (isolated)"
                            : "dispatch FP8 cached into window (isolated)",
                       sms, isolated(flush, into_window), nvl_bytes, network_bytes});
      }
      // Once per run: what the isolated timing of the earlier benchmark (host barrier alone) also held.
      if (bf16 && !studied) {
        studied = true;
        add_timing_study(bootstrap, stream, o, flush, cached, sms, nvl_bytes, out);
      }
    }
    buffer.set_config(combine_config);
    const CombineInput cin{ws.recv_x.get(), ws.recv_topk_weights.get(), o.num_topk, nullptr, nullptr};
    const CombineOutput cout{ws.combined.get(), ws.combined_weights.get()};
    const auto run_combine = [&] {
      combine(buffer, sms_plan.handle, cin, cout, StreamOrder{stream, nullptr, false});
    };
    start_phase_reports(buffer, stream);
    out.push_back({"combine BF16", sms, back_to_back(run_combine), bf16_bytes, bf16_network_bytes});
    add_phase_rows(buffer, stream, sms, out);
    out.push_back(
        {"combine BF16 (isolated)", sms, isolated(flush, run_combine), bf16_bytes, bf16_network_bytes});
  }

  // The link ceiling: a copy-engine read of the next rank's NVLink buffer (no SMs), 32 MiB or the buffer. The
  // next rank of the own node: across nodes the NVLink buffer is mapped among a node's ranks only. Ranks that
  // share a GPU have no link to measure (and the copy engine refuses the mapping).
  if (ranks_per_node > 1 && o.ranks_per_gpu == 1) {
    std::vector<void*> peer_bases(num_ranks);
    EPX_CUDA_CHECK(cudaMemcpy(peer_bases.data(), buffer.nvl_peer_bases_device(), sizeof(void*) * num_ranks,
                              cudaMemcpyDeviceToHost));
    const size_t bytes = std::min<size_t>(size_t(32) << 20, buffer.num_nvl_bytes());
    const int node_start = rank / ranks_per_node * ranks_per_node;
    const void* peer = peer_bases[node_start + (rank - node_start + 1) % ranks_per_node];
    const double us = isolated(flush, [&] {
      EPX_CUDA_CHECK(cudaMemcpyAsync(ws.recv_x.get(), peer, bytes, cudaMemcpyDeviceToDevice, stream));
    });
    out.push_back({"copy engine: read next rank", 0, us, static_cast<double>(bytes)});
  }

  // NCCL moving the same rows, already permuted per destination (send counts from the layout). Across nodes
  // it sends a row once per destination rank, not once per node; its network GB/s counts EPX's network bytes
  // (the work both do) over its time, so the two rates compare as the times do.
  NcclAllToAll nccl(bootstrap, o.ranks_per_gpu == 1);
  if (nccl.available()) {
    const std::vector<int> send_rows = ws.num_tokens_per_rank.download(num_ranks);
    const std::vector<int>& recv_rows = plan.handle.num_recv_per_rank();
    for (bool bf16 : {true, false}) {
      const size_t row_bytes =
          bf16 ? size_t(o.hidden) * 2 : size_t(o.hidden) + 4 * (o.hidden / kFp8GroupSize);
      std::vector<size_t> send_bytes(num_ranks), recv_bytes(num_ranks);
      size_t total_send = 0;
      for (int r = 0; r < num_ranks; ++r) {
        send_bytes[r] = row_bytes * send_rows[r];
        recv_bytes[r] = row_bytes * recv_rows[r];
        total_send += send_bytes[r];
      }
      DeviceArray<uint8_t> send(total_send);
      EPX_CUDA_CHECK(cudaMemset(send.get(), 0x3c, total_send));
      const auto all_to_all = [&] { nccl.run(send.get(), send_bytes, ws.recv_x.get(), recv_bytes, stream); };
      const double bytes = bf16 ? bf16_bytes : fp8_bytes;
      const double network_bytes = bf16 ? bf16_network_bytes : fp8_network_bytes;
      out.push_back({bf16 ? "NCCL all-to-all BF16 rows" : "NCCL all-to-all FP8 rows", 0,
                     back_to_back(all_to_all), bytes, network_bytes});
      out.push_back({bf16 ? "NCCL all-to-all BF16 rows (isolated)" : "NCCL all-to-all FP8 rows (isolated)", 0,
                     isolated(flush, all_to_all), bytes, network_bytes});
    }
  }
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  EPX_CUDA_CHECK(cudaStreamDestroy(stream));
  buffer.destroy();
  return out;
}

}  // namespace epx::bench
