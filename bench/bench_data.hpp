#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gpu/cuda_check.hpp"

namespace epx::bench {

// A device array freed on scope exit.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : count_(count) {
    EPX_CUDA_CHECK(cudaMalloc(&data_, sizeof(T) * (count > 0 ? count : 1)));
  }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& other) noexcept : data_(other.data_), count_(other.count_) {
    other.data_ = nullptr;
  }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  T* get() const { return data_; }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    EPX_CUDA_CHECK(cudaMemcpy(data_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    if (count > 0) EPX_CUDA_CHECK(cudaMemcpy(host.data(), data_, sizeof(T) * count, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

// Random BF16 bit patterns of normal numbers with 2^-14 <= |x| < 1, never all zeros. Below 1, as expert
// outputs mostly are, so that the low-latency combine's LogFMT-10 groups are encoded (a group holding some
// |x| >= 1 travels as BF16, and its bytes and time would be BF16's).
inline std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t count) {
  std::vector<uint16_t> values(count);
  std::uniform_int_distribution<int> mantissa(0, 127), exponent(113, 126), sign(0, 1);
  for (auto& v : values) v = static_cast<uint16_t>((sign(rng) << 15) | (exponent(rng) << 7) | mantissa(rng));
  return values;
}

}  // namespace epx::bench
