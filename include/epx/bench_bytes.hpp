#pragma once

// The bytes the benchmarks count, so `epx-bench`, its CPU reference run and `python -m epx.bench` report the
// same GB/s (= bytes / time) for the same run.
namespace epx {

enum class WireFormat { kBf16, kFp8, kLogFmt };

// One row a rank receives in a normal-mode dispatch: 2H for BF16, H + 4H/128 (the float32 scales) for FP8.
// Combine counts the bytes of the BF16 dispatch it returns.
constexpr double normal_row_bytes(int hidden, bool fp8) {
  return fp8 ? hidden + 4.0 * hidden / 128 : 2.0 * hidden;
}

// One valid (token, expert) selection of low-latency mode: FP8 codes, their scales and 16 bytes of metadata;
// a BF16 row; or LogFMT-10 codes (1.25 H) with their per-group metadata (H/32).
constexpr double low_latency_selection_bytes(int hidden, WireFormat format) {
  switch (format) {
    case WireFormat::kFp8:
      return hidden + hidden / 32.0 + 16;
    case WireFormat::kBf16:
      return 2.0 * hidden;
    case WireFormat::kLogFmt:
      return 1.25 * hidden + hidden / 32.0;
  }
  return 0;
}

}  // namespace epx
