#pragma once

#include <cstddef>

// Performance settings of normal-mode calls, with DeepEP V1's fields and meanings.
namespace epx {

struct Config {
  // SM budget of a normal-mode call: num_sms / 2 channels (at least 1), each one sending and one receiving
  // block. A rank's tokens are split into one contiguous range per channel.
  int num_sms = 20;
  // Most tokens a sender writes into a queue before it publishes them to the receiver (one release per
  // chunk).
  int num_max_nvl_chunked_send_tokens = 6;
  // Tokens one queue holds: every (source, destination, channel) with source != destination has one, in the
  // destination's NVLink buffer. The NVLink buffer grows with it, never with the batch.
  int num_max_nvl_chunked_recv_tokens = 256;
  // Kept for DeepEP callers; used by normal mode across nodes (not implemented: such groups are refused).
  int num_max_rdma_chunked_send_tokens = 6;
  int num_max_rdma_chunked_recv_tokens = 256;

  int num_channels() const { return num_sms / 2 > 1 ? num_sms / 2 : 1; }

  // NVLink bytes per rank that normal-mode calls with this config need for tokens of up to `hidden_bytes`
  // (hidden * 2 for BF16; FP8 rows with their scales are smaller), up to 16 top-k, on `num_ranks` ranks. It
  // does not depend on the number of tokens.
  size_t get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks) const;
  // 0 within one NVLink domain (up to 8 ranks); larger groups are refused (normal mode across nodes is not
  // implemented).
  size_t get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks) const;
};

// Throws epx::Error naming the first field that breaks a rule (>= 1; send chunk <= queue tokens).
void validate_config(const Config& config);

}  // namespace epx
