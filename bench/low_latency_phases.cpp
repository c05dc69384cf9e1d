#include "low_latency_phases.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "gpu/cuda_check.hpp"
#include "kernels/low_latency_kernels.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/low_latency_state.hpp"
#include "timing.hpp"

namespace epx::bench {

namespace {

constexpr const char* kStampNames[kernels::kNumPhaseStamps] = {
    "entry", "prologue",  "histogram", "counts stored", "counted",   "ids",
    "sent",  "published", "arrived",   "scanned",       "delivered", "exit"};

// Microseconds from the first block's entry to the last block's stamp of each phase in one call's stamps
// ([blocks][kNumPhaseStamps], 0 = not stamped); -1 where no block stamped. The entry phase holds the spread
// of the blocks' entries instead (last entry minus first).
std::vector<double> phase_offsets_us(const std::vector<uint64_t>& stamps, int num_blocks) {
  std::vector<double> out(kernels::kNumPhaseStamps, -1.0);
  uint64_t first_entry = UINT64_MAX;
  for (int b = 0; b < num_blocks; ++b) {
    const uint64_t entry = stamps[size_t(b) * kernels::kNumPhaseStamps + kernels::kStampEntry];
    if (entry != 0) first_entry = std::min(first_entry, entry);
  }
  if (first_entry == UINT64_MAX) return out;
  for (int p = 0; p < kernels::kNumPhaseStamps; ++p) {
    uint64_t last = 0;
    for (int b = 0; b < num_blocks; ++b)
      last = std::max(last, stamps[size_t(b) * kernels::kNumPhaseStamps + p]);
    if (last != 0) out[p] = static_cast<double>(last - first_entry) / 1000.0;
  }
  return out;
}

}  // namespace

void print_low_latency_phases(Buffer& buffer, Bootstrap& bootstrap, cudaStream_t stream, int warmup,
                              int iters, const std::string& name, const std::function<void()>& call) {
  uint64_t* stamps = BufferAccess::low_latency_state(buffer)->phase_stamps.get();
  const int num_blocks = buffer.num_device_sms();
  if (stamps == nullptr || num_blocks > kernels::kMaxPhaseStampBlocks) return;
  const size_t count = size_t(num_blocks) * kernels::kNumPhaseStamps;
  std::vector<uint64_t> host(count);
  std::vector<std::vector<float>> per_phase(kernels::kNumPhaseStamps);
  for (int i = 0; i < warmup + iters; ++i) {
    EPX_CUDA_CHECK(cudaMemsetAsync(stamps, 0, sizeof(uint64_t) * count, stream));
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    bootstrap.barrier();
    call();
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    EPX_CUDA_CHECK(cudaMemcpy(host.data(), stamps, sizeof(uint64_t) * count, cudaMemcpyDeviceToHost));
    if (i < warmup) continue;
    const std::vector<double> offsets = phase_offsets_us(host, num_blocks);
    for (int p = 0; p < kernels::kNumPhaseStamps; ++p)
      if (offsets[p] >= 0) per_phase[p].push_back(static_cast<float>(offsets[p]));
  }
  std::fprintf(stderr, "rank %d phases of %s (us after the first block's entry, last block; entry: spread):",
               buffer.rank(), name.c_str());
  for (int p = 0; p < kernels::kNumPhaseStamps; ++p) {
    if (!per_phase[p].empty()) std::fprintf(stderr, " %s %.2f", kStampNames[p], median(per_phase[p]));
  }
  std::fprintf(stderr, "\n");
}

}  // namespace epx::bench
