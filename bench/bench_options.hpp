#pragma once

#include <string>
#include <vector>

#include "buffer_map/normal_buffer_map.hpp"
#include "epx/error.hpp"
#include "formats/fp8.hpp"

namespace epx::bench {

struct BenchOptions {
  std::string mode = "all";  // normal | low-latency | all
  int num_ranks = 0;         // 0: every visible GPU
  int num_tokens = 4096;
  int hidden = 7168;
  int num_topk = 8;
  int num_experts = 256;
  std::vector<int> num_sms = {24};
  // Normal mode: 0 = one node; fewer than the ranks: virtual nodes of this many ranks, so dispatch and
  // combine take the path across nodes (NVSHMEM between the nodes, NVLink forwarding inside them).
  int ranks_per_node = 0;
  // Normal mode within one node: the send chunk and queue tokens of the NVLink queues (0: DeepEP's
  // recommended config for the rank count, dispatch and combine each their own, as deep_ep callers get by
  // default).
  int nvl_send_chunk = 0;
  int nvl_queue_tokens = 0;
  // Normal mode within one node: the Buffer has a combine staging area with room for every row (each peer's
  // copy engine returns the combine's rows; BufferOptions::num_nvl_staging_bytes).
  bool staging = false;
  // Normal mode across nodes: the send chunk and queue tokens of the network queues (0:
  // across_nodes_config's).
  int rdma_send_chunk = 0;
  int rdma_queue_tokens = 0;
  // --tune: instead of the table, time the cached dispatch (BF16, FP8) and the combine at every NVLink send
  // chunk and queue size of the sweep (normal_bench.cpp) for each SM budget, and print the fastest of each.
  bool tune = false;
  int ll_num_tokens = 128;
  int ll_num_experts = 288;
  int ll_ranks_per_node = 0;  // 0: one node; fewer than the ranks: virtual nodes joined by NVSHMEM
  // Ranks sharing each GPU (rank r on device r % GPUs): a logic check of larger groups, e.g. virtual nodes on
  // one GPU. The GPU then runs the ranks' kernels by time slicing, so the times are not speeds, and the NCCL
  // baseline is skipped (NCCL refuses two ranks on one GPU).
  int ranks_per_gpu = 1;
  int warmup = 5;
  int iters = 30;
  bool json = false;
  unsigned seed = 1;
};

// Nodes are equal blocks of ranks: a ranks-per-node `flag` of `value` (0: one node) must divide `num_ranks`
// (`ranks_from` says where that count came from, for the message: "--ranks" or "the visible GPUs").
inline void check_ranks_per_node(const char* flag, int value, int num_ranks, const char* ranks_from) {
  if (value <= 0 || num_ranks <= 0) return;
  EPX_CHECK(num_ranks % value == 0, flag, value,
            detail::concat("must divide ", ranks_from, " (", num_ranks, "): nodes are equal blocks of ranks")
                .c_str());
}

// The rules every run shares (GPU or CPU reference), so a bad value fails the same way everywhere. Without
// --ranks, run_gpus checks the ranks-per-node flags against the number of visible GPUs.
inline void validate_options(const BenchOptions& o) {
  EPX_CHECK(o.num_ranks >= 0, "--ranks", o.num_ranks, "must be >= 1");
  EPX_CHECK(o.num_ranks <= kMaxNvlRanks, "--ranks", o.num_ranks, "must be <= 8 (one NVLink domain)");
  EPX_CHECK(o.num_tokens >= 0, "--tokens", o.num_tokens, "must be >= 0");
  EPX_CHECK(o.hidden > 0, "--hidden", o.hidden, "must be > 0");
  EPX_CHECK(o.hidden % kFp8GroupSize == 0, "--hidden", o.hidden,
            "must be a multiple of 128 (FP8 is benchmarked)");
  EPX_CHECK(o.num_topk >= 1, "--topk", o.num_topk, "must be >= 1");
  EPX_CHECK(o.num_topk <= kMaxTopk, "--topk", o.num_topk, "must be <= 16");
  EPX_CHECK(o.num_experts >= o.num_topk, "--experts", o.num_experts, "must be >= --topk");
  for (int sms : o.num_sms) EPX_CHECK(sms >= 1, "--num-sms", sms, "must be >= 1");
  EPX_CHECK(o.ranks_per_node >= 0, "--ranks-per-node", o.ranks_per_node, "must be >= 0 (0: one node)");
  check_ranks_per_node("--ranks-per-node", o.ranks_per_node, o.num_ranks, "--ranks");
  EPX_CHECK(o.nvl_send_chunk >= 0, "--nvl-chunk", o.nvl_send_chunk, "must be >= 0 (0: recommended)");
  EPX_CHECK(o.nvl_queue_tokens >= 0, "--nvl-queue", o.nvl_queue_tokens, "must be >= 0 (0: recommended)");
  EPX_CHECK(o.rdma_send_chunk >= 0, "--rdma-chunk", o.rdma_send_chunk, "must be >= 0 (0: the default)");
  EPX_CHECK(o.rdma_queue_tokens >= 0, "--rdma-queue", o.rdma_queue_tokens, "must be >= 0 (0: the default)");
  EPX_CHECK(o.ll_num_tokens >= 1, "--ll-tokens", o.ll_num_tokens, "must be >= 1");
  EPX_CHECK(o.ll_num_experts >= o.num_topk, "--ll-experts", o.ll_num_experts, "must be >= --topk");
  EPX_CHECK(o.ll_ranks_per_node >= 0, "--ll-ranks-per-node", o.ll_ranks_per_node,
            "must be >= 0 (0: one node)");
  check_ranks_per_node("--ll-ranks-per-node", o.ll_ranks_per_node, o.num_ranks, "--ranks");
  EPX_CHECK(o.ranks_per_gpu >= 1, "--ranks-per-gpu", o.ranks_per_gpu, "must be >= 1");
  EPX_CHECK(o.warmup >= 0, "--warmup", o.warmup, "must be >= 0");
  EPX_CHECK(o.iters >= 1, "--iters", o.iters, "must be >= 1");
}

// The flags set away from their defaults that only a GPU run honours (the CPU reference run, without a GPU,
// ignores them and says so rather than passing over them in silence).
inline std::vector<std::string> gpu_only_flags_set(const BenchOptions& o) {
  const BenchOptions defaults;
  std::vector<std::string> flags;
  auto note = [&](bool is_set, const char* flag) {
    if (is_set) flags.emplace_back(flag);
  };
  note(o.num_sms != defaults.num_sms, "--num-sms");
  note(o.ranks_per_node != defaults.ranks_per_node, "--ranks-per-node");
  note(o.nvl_send_chunk != defaults.nvl_send_chunk, "--nvl-chunk");
  note(o.nvl_queue_tokens != defaults.nvl_queue_tokens, "--nvl-queue");
  note(o.staging, "--staging");
  note(o.rdma_send_chunk != defaults.rdma_send_chunk, "--rdma-chunk");
  note(o.rdma_queue_tokens != defaults.rdma_queue_tokens, "--rdma-queue");
  note(o.tune, "--tune");
  note(o.ll_ranks_per_node != defaults.ll_ranks_per_node, "--ll-ranks-per-node");
  note(o.ranks_per_gpu != defaults.ranks_per_gpu, "--ranks-per-gpu");
  note(o.warmup != defaults.warmup, "--warmup");
  note(o.iters != defaults.iters, "--iters");
  note(o.seed != defaults.seed, "--seed");
  return flags;
}

// Normal mode's nodes: ranks_per_node when it splits `num_ranks` into several nodes, else num_ranks (one
// node).
inline int normal_ranks_per_node(const BenchOptions& o, int num_ranks) {
  return o.ranks_per_node > 0 && o.ranks_per_node < num_ranks ? o.ranks_per_node : num_ranks;
}

// "1 rank", "2 ranks": `count` with the noun in the number it takes (`many` is the plural).
inline std::string count_of(int count, const char* one, const char* many) {
  return std::to_string(count) + " " + (count == 1 ? one : many);
}

// " (2 nodes of 4, NVSHMEM between them)" when `ranks_per_node` splits `num_ranks` into nodes, else "".
inline std::string nodes_note(int ranks_per_node, int num_ranks) {
  if (ranks_per_node <= 0 || ranks_per_node >= num_ranks) return "";
  return " (" + count_of(num_ranks / ranks_per_node, "node", "nodes") + " of " +
         std::to_string(ranks_per_node) + ", NVSHMEM between them)";
}

// The table headers of each mode, each with its own mode's shape (epx_tools.bench prints the same ones).
inline std::string normal_header(const BenchOptions& o, int num_ranks) {
  const int ranks_per_node = normal_ranks_per_node(o, num_ranks);
  std::string header =
      "normal mode: " + count_of(num_ranks, "rank", "ranks") + nodes_note(ranks_per_node, num_ranks) + ", " +
      count_of(o.num_tokens, "token/rank", "tokens/rank") + ", hidden " + std::to_string(o.hidden) +
      ", top-" + std::to_string(o.num_topk) + " of " + count_of(o.num_experts, "expert", "experts") +
      " (GB/s = rows received x row bytes / time";
  if (ranks_per_node < num_ranks)
    header += "; net GB/s = rows crossing to other nodes, once per node, x row bytes / time";
  return header + "; verified before timing)";
}

inline std::string low_latency_header(const BenchOptions& o, int num_ranks) {
  return "low-latency mode: " + count_of(num_ranks, "rank", "ranks") +
         nodes_note(o.ll_ranks_per_node, num_ranks) + ", " +
         count_of(o.ll_num_tokens, "token/rank", "tokens/rank") + ", hidden " + std::to_string(o.hidden) +
         ", top-" + std::to_string(o.num_topk) + " of " + count_of(o.ll_num_experts, "expert", "experts") +
         " (GB/s = selections x bytes per selection / time; verified before timing)";
}

}  // namespace epx::bench
