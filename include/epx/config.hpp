#pragma once

#include <cstddef>
#include <string_view>

// Performance settings of normal-mode calls, with DeepEP V1's fields and meanings, and the buffer size hints
// (BufferOptions' byte counts).
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
  // Normal mode across nodes (src/buffer_map/internode_buffer_map.hpp): most tokens a sender puts into a
  // network queue before it publishes them to the receiving node (one put-with-signal per chunk) ...
  int num_max_rdma_chunked_send_tokens = 6;
  // ... and tokens one network queue holds: every (source node, destination node, channel) has one, in the
  // symmetric buffer of the receiving rail peer (plus a send ring of the same size at the sender). The
  // symmetric buffer grows with it, never with the batch.
  int num_max_rdma_chunked_recv_tokens = 256;

  int num_channels() const { return num_sms / 2 > 1 ? num_sms / 2 : 1; }

  // NVLink bytes per rank that normal-mode calls with this config need for tokens of up to `hidden_bytes`
  // (hidden * 2 for BF16; FP8 rows with their scales are smaller), up to 16 top-k, on `num_ranks` ranks. It
  // does not depend on the number of tokens.
  size_t get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks) const;
  // Symmetric (NVSHMEM) bytes per rank that normal-mode calls across nodes with this config need
  // (BufferOptions::num_rdma_bytes; a Buffer that also serves low-latency calls takes the larger of this and
  // get_low_latency_rdma_size_hint). Nodes of `ranks_per_node` ranks; 0 means DeepEP's convention: one node
  // up to 8 ranks, nodes of 8 above. 0 when the group is one node. It does not depend on the number of
  // tokens.
  size_t get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int ranks_per_node = 0) const;
};

// Low-latency buffer bytes per rank (BufferOptions::num_rdma_bytes) for calls of up to
// `num_max_dispatch_tokens_per_rank` tokens of `hidden` on `num_ranks` ranks with `num_experts` experts: the
// low-latency buffer map's total, rounded up to a multiple of 2 MiB. Throws epx::Error for a shape
// low-latency mode does not support.
size_t get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks,
                                      int num_experts);

// Which normal-mode call a recommended config is for.
enum class ConfigFor { kDispatch, kCombine };

// GPU kinds whose normal-mode defaults were measured apart (docs/BENCHMARKS.md); kOther is every other GPU.
enum class GpuKind { kOther, kH100, kH200 };

// The kind of a GPU by its CUDA device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"; kOther for any other).
GpuKind gpu_kind_of(std::string_view device_name);
// "H100", "H200" or "other".
const char* gpu_kind_name(GpuKind kind);

// DeepEP V1's recommended config for `op` in a group of `num_ranks` (what deep_ep callers get from
// Buffer.get_dispatch_config / get_combine_config), with `num_sms`; Config's defaults with `num_sms` for a
// group size DeepEP has no recommendation for. At 2 ranks the send chunks are EPX's measured ones, and on a
// GPU of `kind` they follow the SM budget where that kind was measured so (H200: the combine's 32 below 24
// SMs, 16 up to 27, 8 from 28; the dispatch's 48, 32 from 32 SMs).
Config recommended_config(ConfigFor op, int num_ranks, int num_sms, GpuKind kind = GpuKind::kOther);

// EPX's config of a group that spans nodes, with `num_sms`: Config's queues (which size the symmetric
// buffer), and a network send chunk of 16 records, not Config's 6. Swept on 2 x H100 as 2 nodes of 1 GPU at
// 12 / 24 SMs (chunks 8, 12, 16, 24, 32; docs/BENCHMARKS.md): 16 was the fastest for the FP8 dispatch and the
// combine, and against 32 the FP8 dispatch took 13 % less time, BF16 2-7 %, the combine 2 %.
Config across_nodes_config(int num_sms);

// Throws epx::Error naming the first field that breaks a rule (>= 1; send chunk <= queue tokens, for the
// NVLink and the network queues).
void validate_config(const Config& config);

}  // namespace epx
