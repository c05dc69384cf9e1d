// Normal mode through the C++ API alone (no Python, no torch): every rank routes its tokens to top-k experts,
// dispatches them, lets its "experts" return what they received unchanged, and combines. Combine sums,
// without weights, the copies coming back from every rank a token went to, so each combined token must equal
// the token times the number of distinct ranks it was sent to; the example checks that exactly.
//
//   build/examples/epx_example_normal [num_ranks]      (default 2; rank r on GPU r % GPUs)
#include <cstdint>
#include <cstdio>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/normal.hpp"
#include "example_util.hpp"
#include "formats/bf16.hpp"
#include "reference/test_data.hpp"

namespace {

int normal_rank_main(epx::Bootstrap& bootstrap) {
  const int rank = bootstrap.rank();
  const int num_ranks = bootstrap.num_ranks();
  // An uneven token count per rank, DeepSeek-like hidden size, 8 experts per rank, top-4.
  const int num_tokens = 300 + 37 * rank;
  const int hidden = 7168;
  const int num_experts = 8 * num_ranks;
  const int num_topk = 4;

  // Seeded inputs from the reference's generators: tokens of small integers (sums of a few copies are exact
  // in BF16), distinct experts per token with about one pick in ten dropped to -1 (no expert).
  const uint64_t seed = 1234 + rank;
  const std::vector<uint16_t> x = epx::reference::random_bf16_tokens(
      seed, num_tokens, hidden, rank, epx::reference::TokenValues::kSmallIntegers,
      /*stamp=*/false);
  epx::reference::RoutingSpec routing;
  routing.num_tokens = num_tokens;
  routing.num_topk = num_topk;
  routing.num_experts = num_experts;
  routing.drop_probability = 0.1;
  const std::vector<int64_t> topk_idx = epx::reference::make_topk_idx(routing, seed);
  const std::vector<float> topk_weights = epx::reference::random_topk_weights(seed, num_tokens, num_topk);

  // The NVLink buffer holds bounded per-peer queues: its size follows the config, never the batch.
  epx::Config config;
  config.num_sms = 24;
  epx::BufferOptions options;
  options.num_nvl_bytes = config.get_nvl_buffer_size_hint(size_t(hidden) * 2, num_ranks);
  epx::Buffer buffer(bootstrap, options);  // collective: maps every peer's buffer
  buffer.set_config(config);
  cudaStream_t stream;
  example::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const epx::StreamOrder order{stream, nullptr, false};  // on the comm stream; `stream` waits for each call

  example::DeviceMemory memory;
  const uint16_t* d_x = memory.upload(x);
  const int64_t* d_topk_idx = memory.upload(topk_idx);
  const float* d_topk_weights = memory.upload(topk_weights);
  example::check_cuda(cudaDeviceSynchronize(), "uploads");  // they ran on the legacy stream

  // 1. Layout: tokens per rank and per expert, and which ranks each token goes to.
  const epx::DispatchLayoutOutput layout{memory.alloc<int>(num_ranks), memory.alloc<int>(num_experts),
                                         memory.alloc<bool>(size_t(num_tokens) * num_ranks)};
  epx::get_dispatch_layout(buffer, d_topk_idx, num_tokens, num_topk, num_experts, layout, order);

  // 2. Count exchange: the plan says how many rows this rank receives, so the outputs can be allocated.
  epx::DispatchInput in;
  in.x = d_x;
  in.num_tokens = num_tokens;
  in.hidden = hidden;
  in.topk_idx = d_topk_idx;
  in.topk_weights = d_topk_weights;
  in.num_topk = num_topk;
  in.num_experts = num_experts;
  in.is_token_in_rank = layout.is_token_in_rank;
  in.num_tokens_per_expert = layout.num_tokens_per_expert;
  const epx::DispatchPlan plan = epx::dispatch_notify(buffer, in, order);
  const size_t rows = plan.num_recv_rows;

  // 3. Receive the rows, with their top-k ids converted to local experts (-1 elsewhere) and weights.
  epx::DispatchOutput out;
  out.recv_x = memory.alloc<uint16_t>(rows * hidden);
  out.recv_topk_idx = memory.alloc<int64_t>(rows * num_topk);
  out.recv_topk_weights = memory.alloc<float>(rows * num_topk);
  epx::dispatch_receive(buffer, plan, in, out, order);

  // 4. The experts would run on recv_x here; this example returns the rows unchanged.
  uint16_t* d_combined = memory.alloc<uint16_t>(x.size());
  epx::combine(buffer, plan.handle, {out.recv_x, nullptr, 0, nullptr, nullptr}, {d_combined, nullptr}, order);
  buffer.synchronize(stream);

  // Check: combined token = token * number of distinct ranks among its experts.
  const std::vector<uint16_t> combined = example::download(d_combined, x.size());
  const int experts_per_rank = num_experts / num_ranks;
  size_t num_wrong = 0;
  for (int t = 0; t < num_tokens; ++t) {
    std::vector<bool> reached(num_ranks, false);
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = topk_idx[size_t(t) * num_topk + k];
      if (e >= 0) reached[e / experts_per_rank] = true;
    }
    int copies = 0;
    for (bool r : reached) copies += r ? 1 : 0;
    for (int c = 0; c < hidden; ++c) {
      const size_t i = size_t(t) * hidden + c;
      if (epx::bf16_to_float(combined[i]) != epx::bf16_to_float(x[i]) * float(copies)) ++num_wrong;
    }
  }
  std::printf("rank %d: dispatched %d tokens, received %zu rows (per local expert:", rank, num_tokens, rows);
  for (int n : plan.num_recv_tokens_per_expert) std::printf(" %d", n);
  std::printf("); combine %s\n", num_wrong == 0 ? "matches" : "WRONG");

  example::check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  buffer.destroy();  // collective
  return num_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return example::launch(argc, argv, normal_rank_main);
}
