#include "low_latency_phases.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

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

// The first block's entry (global timer, ns) in one call's stamps; UINT64_MAX where no block stamped it.
uint64_t first_entry_ns(const std::vector<uint64_t>& stamps, int num_blocks) {
  uint64_t first = UINT64_MAX;
  for (int b = 0; b < num_blocks; ++b) {
    const uint64_t entry = stamps[size_t(b) * kernels::kNumPhaseStamps + kernels::kStampEntry];
    if (entry != 0) first = std::min(first, entry);
  }
  return first;
}

// Microseconds from the first block's entry to the last stamp of each phase among blocks [0, stamping) in one
// call's stamps ([blocks][kNumPhaseStamps], 0 = not stamped); -1 where no block stamped. The entry phase
// holds the spread of the blocks' entries instead (last entry minus first).
std::vector<double> phase_offsets_us(const std::vector<uint64_t>& stamps, int num_blocks, int stamping) {
  std::vector<double> out(kernels::kNumPhaseStamps, -1.0);
  const uint64_t first_entry = first_entry_ns(stamps, num_blocks);
  if (first_entry == UINT64_MAX) return out;
  for (int p = 0; p < kernels::kNumPhaseStamps; ++p) {
    uint64_t last = 0;
    for (int b = 0; b < stamping; ++b)
      last = std::max(last, stamps[size_t(b) * kernels::kNumPhaseStamps + p]);
    if (last != 0) out[p] = static_cast<double>(last - first_entry) / 1000.0;
  }
  return out;
}

// Microseconds from the first block's entry to stamp `phase` of each block that stamped it, in ascending
// order.
std::vector<double> block_ends_us(const std::vector<uint64_t>& stamps, int num_blocks, int phase) {
  const uint64_t first_entry = first_entry_ns(stamps, num_blocks);
  std::vector<double> ends;
  if (first_entry == UINT64_MAX) return ends;
  for (int b = 0; b < num_blocks; ++b) {
    const uint64_t stamp = stamps[size_t(b) * kernels::kNumPhaseStamps + phase];
    if (stamp != 0) ends.push_back(static_cast<double>(stamp - first_entry) / 1000.0);
  }
  std::sort(ends.begin(), ends.end());
  return ends;
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
  // A dispatch's routing block is the last: the senders' own "sent" says whether the routing holds the flags
  // back.
  std::vector<float> senders_sent;
  // When the first and the median block end their sends (the last is the "sent" phase): a send whose blocks
  // all end late is bound by what they share (the link, memory), one whose median ends early waits for a few.
  std::vector<float> sent_first, sent_median;
  for (int i = 0; i < warmup + iters; ++i) {
    EPX_CUDA_CHECK(cudaMemsetAsync(stamps, 0, sizeof(uint64_t) * count, stream));
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    bootstrap.barrier();
    call();
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    EPX_CUDA_CHECK(cudaMemcpy(host.data(), stamps, sizeof(uint64_t) * count, cudaMemcpyDeviceToHost));
    if (i < warmup) continue;
    const std::vector<double> offsets = phase_offsets_us(host, num_blocks, num_blocks);
    for (int p = 0; p < kernels::kNumPhaseStamps; ++p)
      if (offsets[p] >= 0) per_phase[p].push_back(static_cast<float>(offsets[p]));
    const double sent = phase_offsets_us(host, num_blocks, num_blocks - 1)[kernels::kStampSent];
    if (sent >= 0) senders_sent.push_back(static_cast<float>(sent));
    const std::vector<double> ends = block_ends_us(host, num_blocks, kernels::kStampSent);
    if (!ends.empty()) {
      sent_first.push_back(static_cast<float>(ends.front()));
      sent_median.push_back(static_cast<float>(ends[ends.size() / 2]));
    }
  }
  std::string line = "rank " + std::to_string(buffer.rank()) + " phases of " + name +
                     " (us after the first block's entry, last block; entry: spread):";
  char value[64];
  for (int p = 0; p < kernels::kNumPhaseStamps; ++p) {
    if (per_phase[p].empty()) continue;
    std::snprintf(value, sizeof(value), " %s %.2f", kStampNames[p], median(per_phase[p]));
    line += value;
  }
  if (!senders_sent.empty() && name.find("dispatch") != std::string::npos) {
    std::snprintf(value, sizeof(value), "; sent by all but the last (routing) block %.2f",
                  median(senders_sent));
    line += value;
  }
  if (!sent_first.empty()) {
    std::snprintf(value, sizeof(value), "; blocks' sends end: first %.2f, median %.2f", median(sent_first),
                  median(sent_median));
    line += value;
  }
  // One write(2) per line: the ranks' processes share stderr, and stdio may split a long line.
  line += '\n';
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace epx::bench
