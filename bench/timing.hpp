#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>
#include <vector>

#include "epx/bootstrap.hpp"
#include "gpu/cuda_check.hpp"

namespace epx::bench {

// Median of `values` (0 when empty).
inline double median(std::vector<float> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// The one timing helper of the benchmark: CUDA events on `stream` around `body`, after `warmup` untimed
// runs; before each run `prepare` (e.g. fresh inputs, an L2 flush) and a host barrier so ranks start
// together. Returns the median in microseconds.
inline double median_us(Bootstrap& bootstrap, cudaStream_t stream, int warmup, int iters,
                        const std::function<void()>& prepare, const std::function<void()>& body) {
  cudaEvent_t start = nullptr, stop = nullptr;
  EPX_CUDA_CHECK(cudaEventCreate(&start));
  EPX_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < warmup + iters; ++i) {
    if (prepare) prepare();
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    bootstrap.barrier();
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
  const double us = median_us(bootstrap, stream, warmup, iters, nullptr, [&] {
    for (int r = 0; r < kReplays; ++r) EPX_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  });
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
