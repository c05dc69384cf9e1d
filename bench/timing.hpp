#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "common/cuda_check.hpp"
#include "epx/bootstrap.hpp"

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
