// Low-latency (decode) mode through the C++ API: each rank dispatches up to M tokens into the fixed
// per-expert layout [L, R*M, H] with a receive hook (the call only sends; the receive runs when the hook is
// called, and no EPX kernel holds SMs in between), the "experts" return their rows unchanged, and the
// weighted combine brings them back. Combined token = sum over its experts, in top-k order, of weight * token
// (float sums, then BF16), which the example checks exactly. Dispatch is BF16 here so the rows arrive
// unchanged; set use_fp8 for the FP8 cast in the kernel.
//
//   build/examples/epx_example_low_latency [num_ranks]      (default 2; rank r on GPU r % GPUs)
#include <cstdint>
#include <cstdio>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/low_latency.hpp"
#include "example_util.hpp"
#include "formats/bf16.hpp"
#include "reference/test_data.hpp"

namespace {

int low_latency_rank_main(epx::Bootstrap& bootstrap) {
  const int rank = bootstrap.rank();
  const int num_ranks = bootstrap.num_ranks();
  const int num_max_tokens = 128;                // M: the decode batch bound, the same on every rank
  const int num_tokens = 100 + (7 * rank) % 29;  // T <= M
  const int hidden = 7168;
  const int num_experts = 36 * num_ranks;  // 288 at 8 ranks
  const int num_topk = 8;

  // Seeded inputs from the reference's generators: tokens uniform in [-1, 1) scaled per 128 channels,
  // distinct experts per token with about one pick in sixteen dropped to -1 (no expert).
  const uint64_t seed = 4321 + rank;
  const std::vector<uint16_t> x = epx::reference::random_bf16_tokens(
      seed, num_tokens, hidden, rank, epx::reference::TokenValues::kUniform, /*stamp=*/false);
  epx::reference::RoutingSpec routing;
  routing.num_tokens = num_tokens;
  routing.num_topk = num_topk;
  routing.num_experts = num_experts;
  routing.drop_probability = 1.0 / 16;
  const std::vector<int64_t> topk_idx = epx::reference::make_topk_idx(routing, seed);
  const std::vector<float> topk_weights = epx::reference::random_topk_weights(seed, num_tokens, num_topk);

  epx::BufferOptions options;
  options.num_rdma_bytes =
      epx::get_low_latency_rdma_size_hint(num_max_tokens, hidden, num_ranks, num_experts);
  epx::Buffer buffer(bootstrap, options);
  cudaStream_t stream;
  example::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const epx::StreamOrder order{stream, nullptr, false};

  example::DeviceMemory memory;
  epx::LowLatencyDispatchInput in;
  in.x = memory.upload(x);
  in.topk_idx = memory.upload(topk_idx);
  const float* d_topk_weights = memory.upload(topk_weights);
  example::check_cuda(cudaDeviceSynchronize(), "uploads");  // they ran on the legacy stream
  in.num_tokens = num_tokens;
  in.num_topk = num_topk;
  in.hidden = hidden;
  in.num_max_dispatch_tokens_per_rank = num_max_tokens;
  in.num_experts = num_experts;
  in.use_fp8 = false;
  in.return_recv_hook = true;

  // Outputs are fixed-size: they depend on M, not on what arrives, so no count exchange is needed.
  const epx::LowLatencyDispatchSizes sizes = epx::low_latency_dispatch_sizes(buffer, in);
  epx::LowLatencyDispatchOutput out;
  out.recv_x = memory.alloc<char>(sizes.recv_x_bytes);
  out.recv_count = memory.alloc<int>(sizes.num_local_experts);
  out.recv_src_info = memory.alloc<int>(sizes.recv_src_info_bytes / sizeof(int));
  out.recv_topk_pos = memory.alloc<int>(sizes.recv_src_info_bytes / sizeof(int));
  out.recv_layout_range =
      memory.alloc<epx::LowLatencyRange>(sizes.recv_layout_range_bytes / sizeof(epx::LowLatencyRange));

  // Send now; attention or other work could run here while the tokens fly; then receive.
  const epx::LowLatencyDispatchResult dispatched = epx::low_latency_dispatch(buffer, in, out, order);
  dispatched.hook(stream);

  // The experts would read recv_x[le][0 .. recv_count[le]) here; this example returns the rows unchanged.
  epx::LowLatencyCombineInput combine_in;
  combine_in.x = out.recv_x;
  combine_in.topk_idx = in.topk_idx;
  combine_in.topk_weights = d_topk_weights;
  combine_in.num_tokens = num_tokens;
  combine_in.num_topk = num_topk;
  uint16_t* d_combined = memory.alloc<uint16_t>(x.size());
  epx::low_latency_combine(buffer, dispatched.handle, combine_in, d_combined, order);
  buffer.synchronize(stream);

  // Check: acc = 0; acc += weight * value over the token's experts in top-k order (float), then BF16.
  const std::vector<uint16_t> combined = example::download(d_combined, x.size());
  const std::vector<int> recv_count = example::download(out.recv_count, sizes.num_local_experts);
  size_t num_wrong = 0;
  for (int t = 0; t < num_tokens; ++t) {
    for (int c = 0; c < hidden; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < num_topk; ++k) {
        if (topk_idx[size_t(t) * num_topk + k] < 0) continue;
        const float product =
            topk_weights[size_t(t) * num_topk + k] * epx::bf16_to_float(x[size_t(t) * hidden + c]);
        acc += product;
      }
      if (combined[size_t(t) * hidden + c] != epx::float_to_bf16(acc)) ++num_wrong;
    }
  }
  int received = 0;
  for (int n : recv_count) received += n;
  std::printf("rank %d: sent %d tokens, its %d experts received %d rows; combine %s\n", rank, num_tokens,
              sizes.num_local_experts, received, num_wrong == 0 ? "matches" : "WRONG");

  example::check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  buffer.destroy();
  return num_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return example::launch(argc, argv, low_latency_rank_main);
}
