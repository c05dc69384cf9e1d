#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "epx/bootstrap.hpp"
#include "gpu/cuda_check.hpp"
#include "start_gate.hpp"

namespace epx::bench {

// Median of `values` (0 when empty).
inline double median(std::vector<float> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// How an isolated run starts on every rank (docs/BENCHMARKS.md, "Two timings").
enum class StartAlign {
  // The host barrier alone: the start event fires when this rank's host gets past it, so the time also holds
  // the ranks' barrier-exit skew (a peer still on its way holds this rank's kernels) and the host's cost of
  // launching the run on an idle GPU.
  kHostBarrier,
  // The barrier, then a short device delay before the start event (start_gate.hpp): the run is queued while
  // the GPU waits, so the time is the run's GPU time from a common start.
  kDeviceDelay,
};

// Long enough for the host to queue any run here (a call's launches, 20 graph replays) and for the ranks to
// leave the barrier: far above both as measured (docs/BENCHMARKS.md), and outside the timed interval.
inline constexpr unsigned kStartDelayNs = 300'000;

// Steady-clock stamps (one clock for every process of the host) of when this rank left each timed run's
// barrier: gathered over ranks they show how far apart the ranks started (barrier_exit_skew_us).
using BarrierExits = std::vector<int64_t>;

inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Median over runs of (latest - earliest) barrier exit among the ranks, in µs. Collective.
inline double barrier_exit_skew_us(Bootstrap& bootstrap, const BarrierExits& exits) {
  const std::vector<std::byte> gathered = bootstrap.all_gather(exits.data(), sizeof(int64_t) * exits.size());
  const auto* all = reinterpret_cast<const int64_t*>(gathered.data());
  std::vector<float> skews(exits.size());
  for (size_t i = 0; i < exits.size(); ++i) {
    int64_t earliest = all[i], latest = all[i];
    for (int r = 1; r < bootstrap.num_ranks(); ++r) {
      earliest = std::min(earliest, all[r * exits.size() + i]);
      latest = std::max(latest, all[r * exits.size() + i]);
    }
    skews[i] = static_cast<float>(latest - earliest) / 1e3f;
  }
  return median(std::move(skews));
}

// The isolated timing of the benchmark: CUDA events on `stream` around `body`, after `warmup` untimed runs;
// before each run `prepare` (e.g. fresh inputs, an L2 flush), the stream drained and a host barrier, then the
// start as `align` says. `exits`, when given, collects this rank's barrier exits of the timed runs. Returns
// the median in microseconds.
inline double median_us(Bootstrap& bootstrap, cudaStream_t stream, int warmup, int iters,
                        const std::function<void()>& prepare, const std::function<void()>& body,
                        StartAlign align = StartAlign::kHostBarrier, BarrierExits* exits = nullptr) {
  cudaEvent_t start = nullptr, stop = nullptr;
  EPX_CUDA_CHECK(cudaEventCreate(&start));
  EPX_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < warmup + iters; ++i) {
    if (prepare) prepare();
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    bootstrap.barrier();
    if (exits != nullptr && i >= warmup) exits->push_back(steady_now_ns());
    if (align == StartAlign::kDeviceDelay) launch_start_delay(stream, kStartDelayNs);
    EPX_CUDA_CHECK(cudaEventRecord(start, stream));
    body();
    EPX_CUDA_CHECK(cudaEventRecord(stop, stream));
    EPX_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= warmup) times.push_back(ms * 1000.0f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(std::move(times));
}

// The back-to-back timing, as training loops issue calls and as DeepEP-style tests time them: `warmup`
// untimed calls, `prepare` once (the L2 flush), then `iters` calls queued with no sync or barrier between
// them, a pair of events around each. The host runs ahead of the GPU unless a call waits on it, so a call's
// time is its GPU time plus any gap the host leaves before it. Median in microseconds.
inline double median_back_to_back_us(Bootstrap& bootstrap, cudaStream_t stream, int warmup, int iters,
                                     const std::function<void()>& prepare,
                                     const std::function<void()>& body) {
  std::vector<cudaEvent_t> starts(iters), stops(iters);
  for (int i = 0; i < iters; ++i) {
    EPX_CUDA_CHECK(cudaEventCreate(&starts[i]));
    EPX_CUDA_CHECK(cudaEventCreate(&stops[i]));
  }
  for (int i = 0; i < warmup; ++i) body();
  if (prepare) prepare();
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  bootstrap.barrier();
  launch_start_delay(stream, kStartDelayNs);
  for (int i = 0; i < iters; ++i) {
    EPX_CUDA_CHECK(cudaEventRecord(starts[i], stream));
    body();
    EPX_CUDA_CHECK(cudaEventRecord(stops[i], stream));
  }
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> times(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, starts[i], stops[i]));
    times[i] = ms * 1000.0f;
    cudaEventDestroy(starts[i]);
    cudaEventDestroy(stops[i]);
  }
  return median(std::move(times));
}

// Host time of `body` (steady clock, from the call to its return) with the GPU idle when it starts: what a
// call that waits on the host costs the caller's thread. Median in microseconds.
inline double median_host_us(Bootstrap& bootstrap, cudaStream_t stream, int warmup, int iters,
                             const std::function<void()>& prepare, const std::function<void()>& body) {
  std::vector<float> times;
  for (int i = 0; i < warmup + iters; ++i) {
    if (prepare) prepare();
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    bootstrap.barrier();
    const auto start = std::chrono::steady_clock::now();
    body();
    const auto stop = std::chrono::steady_clock::now();
    if (i >= warmup) times.push_back(std::chrono::duration<float, std::micro>(stop - start).count());
  }
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  return median(std::move(times));
}

// GPU time of one of the `calls_per_body` calls `body` makes, with the host's issue cost hidden: `body` is
// captured once into a CUDA graph, and each timed run replays it kReplays times back to back between two
// events (the host enqueues the replays while the GPU runs them, so the interval holds the kernels and the
// gaps between them only, as a CUDA-graph decode step sees them). Returns the median in microseconds.
inline double median_graph_us(Bootstrap& bootstrap, cudaStream_t stream, int warmup, int iters,
                              int calls_per_body, const std::function<void()>& body) {
  constexpr int kReplays = 20;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  body();
  EPX_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = median_us(
      bootstrap, stream, warmup, iters, nullptr,
      [&] {
        for (int r = 0; r < kReplays; ++r) EPX_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      },
      StartAlign::kDeviceDelay);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us / (kReplays * calls_per_body);  // the median scales with its values
}

// Evicts L2 between throughput runs by writing a buffer larger than it.
class L2Flusher {
 public:
  L2Flusher() { EPX_CUDA_CHECK(cudaMalloc(&scratch_, kBytes)); }
  ~L2Flusher() { cudaFree(scratch_); }
  void flush(cudaStream_t stream) { EPX_CUDA_CHECK(cudaMemsetAsync(scratch_, 0x5a, kBytes, stream)); }

 private:
  static constexpr size_t kBytes = 256u << 20;
  void* scratch_ = nullptr;
};

}  // namespace epx::bench
