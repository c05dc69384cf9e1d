#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "epx/local_launcher.hpp"
#include "expect_error.hpp"
#include "gpu/device_info.hpp"
#include "run_ranks.hpp"
#include "test_normal_harness.hpp"

namespace {

using epx::TokenFormat;
using epx::test::DeviceArray;
using epx::test::NormalCase;
using epx::test::NormalOrder;
using epx::test::NormalRouteBy;
using epx::test::NormalRouting;

constexpr TokenFormat kBf16 = TokenFormat::kBf16;
constexpr TokenFormat kFp8 = TokenFormat::kFp8;

using epx::test::run_ranks;

void run_case(const NormalCase& c) {
  run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) { epx::test::NormalRunner(c, bootstrap).run(); });
}

// The cases one after the other on one Buffer sized for all of them: operations of different shapes have to
// alternate through the same two halves of the NVLink buffer.
void run_cases_on_one_buffer(const std::vector<NormalCase>& cases) {
  run_ranks(cases.front().num_ranks, [&](epx::Bootstrap& bootstrap) {
    epx::BufferOptions options;
    for (const NormalCase& c : cases)
      options.num_nvl_bytes = std::max(options.num_nvl_bytes, epx::test::normal_buffer_bytes(c));
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);
    for (const NormalCase& c : cases) epx::test::NormalRunner(c, buffer).run();
  });
}

// Options of a Buffer for `c` on the caller's `stream` (as epx.Buffer passes torch's).
epx::BufferOptions borrowed_stream_options(const NormalCase& c, cudaStream_t stream) {
  epx::BufferOptions options;
  options.num_nvl_bytes = epx::test::normal_buffer_bytes(c);
  options.wait_timeout_s = 20.0;
  options.comm_stream = stream;
  return options;
}

// A Buffer on the caller's stream runs its calls there and leaves the stream alive after destroy() (outputs
// recorded on it, as torch records them, can still be freed).
TEST(Normal, BorrowedCommStream) {
  const NormalCase c = [] {
    NormalCase c;
    c.num_tokens = {100, 37};
    c.num_iterations = 2;
    return c;
  }();
  run_ranks(c.num_ranks, [&](epx::Bootstrap& bootstrap) {
    cudaStream_t stream = nullptr;
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      epx::Buffer buffer(bootstrap, borrowed_stream_options(c, stream));
      if (buffer.comm_stream() != stream)
        throw std::runtime_error("the Buffer did not take the given stream");
      epx::test::NormalRunner(c, buffer).run();
      buffer.destroy();
    }
    EPX_CUDA_CHECK(cudaStreamQuery(stream));  // still a valid stream
    EPX_CUDA_CHECK(cudaStreamDestroy(stream));
  });
}

// Handles alive after destroy(), as vLLM's worker holds its last dispatch handle: their arrays keep the
// Buffer's memory pool until they go, and the process's next memory-pool destroy (NCCL's, in
// ncclCommDestroy) still works. Destroying the pool with allocations out crashed that destroy on two GPUs
// (tests/python/gpu/test_inference_call_sites.py::test_vllm_high_throughput, which reproduced it; this test
// follows its order on the C++ API: a borrowed comm stream, as epx.Buffer passes torch's, left running).
void run_handles_outliving_their_buffer(int num_ranks) {
  NormalCase c;
  c.num_ranks = num_ranks;
  c.num_tokens = {100, 37};
  c.num_iterations = 2;
  run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) {
    cudaStream_t comm_stream = nullptr;
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
    auto buffer = std::make_unique<epx::Buffer>(bootstrap, borrowed_stream_options(c, comm_stream));
    auto runner = std::make_unique<epx::test::NormalRunner>(c, *buffer);
    runner->run();
    buffer->destroy();
    runner.reset();  // the handles' arrays are freed after the Buffer, on the still-running stream
    buffer.reset();
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = bootstrap.rank() % epx::visible_gpu_count();
    cudaMemPool_t pool = nullptr;
    EPX_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    void* memory = nullptr;
    EPX_CUDA_CHECK(cudaMallocFromPoolAsync(&memory, 1 << 20, pool, nullptr));
    EPX_CUDA_CHECK(cudaFreeAsync(memory, nullptr));
    EPX_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    EPX_CUDA_CHECK(cudaMemPoolDestroy(pool));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    EPX_CUDA_CHECK(cudaStreamDestroy(comm_stream));
  });
}

TEST(Normal, HandlesOutliveTheirBufferOneRank) {
  run_handles_outliving_their_buffer(1);
}

// 333 tokens: odd, and more than one block's worth of warps in every copy kernel.
NormalCase small_case(int num_ranks) {
  NormalCase c;
  c.num_ranks = num_ranks;
  c.hidden = 2048;
  c.num_experts = 8 * num_ranks;
  c.num_topk = 4;
  c.num_tokens = {333, 64};
  return c;
}

// Cases that run at 2 and 4 ranks (the 4-rank run skips where fewer ranks fit): test names end in /TwoRanks
// or /FourRanks, e.g. Normal/NormalRanks.Bf16/FourRanks. Where the two runs differ on purpose (a seed, a
// token count, unbalanced routing at four ranks), the test body says so.
class NormalRanks : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Normal, NormalRanks, ::testing::Values(2, 4), epx::test::rank_count_name);

TEST_P(NormalRanks, HandlesOutliveTheirBuffer) {
  run_handles_outliving_their_buffer(GetParam());
}

// ---- Formats, routing, token counts ----

NormalCase format_case(int num_ranks, TokenFormat format) {
  NormalCase c = small_case(num_ranks);
  c.formats = {format};
  c.hidden = format == kFp8 ? 4096 : 2048;
  c.expert_alignments = {1, 128};
  c.num_iterations = 2;
  c.seed = format == kFp8 ? 11 : 12;
  return c;
}

TEST_P(NormalRanks, Bf16) {
  run_case(format_case(GetParam(), kBf16));
}

TEST_P(NormalRanks, Fp8) {
  run_case(format_case(GetParam(), kFp8));
}

// Dispatch from is_token_in_rank (with and without num_tokens_per_expert): no top-k outputs.
NormalCase without_topk_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.route_by = {NormalRouteBy::kRankMapCounts, NormalRouteBy::kRankMapCounts, NormalRouteBy::kRankMap,
                NormalRouteBy::kRankMap};
  c.formats = {kBf16, kFp8};
  c.expert_alignments = {128};
  c.num_biases = {0, 2};
  c.num_iterations = 4;
  c.seed = 21;
  return c;
}

TEST_P(NormalRanks, WithoutTopk) {
  run_case(without_topk_case(GetParam()));
}

// Hot experts, experts nobody picks, -1 ids, rank 0 receives nothing, the last rank sends nothing, and tokens
// listing one expert twice; an odd alignment too.
NormalCase unbalanced_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.routing = NormalRouting::kUnbalanced;
  c.duplicates = true;
  c.num_tokens = {333, 64, 1, 200};
  c.formats = {kBf16, kFp8};
  c.route_by = {NormalRouteBy::kTopk, NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts,
                NormalRouteBy::kRankMapCounts};
  c.expert_alignments = {1, 128, 7};
  c.num_iterations = 4;
  c.seed = 31;
  return c;
}

TEST_P(NormalRanks, UnbalancedRouting) {
  run_case(unbalanced_case(GetParam()));
}

// Each rank meets 0, 1 and an odd count over the iterations; at four ranks also 5 tokens, aligned to 128.
TEST_P(NormalRanks, TokenCountsZeroOneOdd) {
  NormalCase c = small_case(GetParam());
  c.formats = {kBf16, kFp8};
  if (GetParam() == 2) {
    c.num_tokens = {0, 1, 333};
    c.num_iterations = 3;
    c.seed = 41;
  } else {
    c.num_tokens = {0, 1, 333, 5};
    c.expert_alignments = {128};
    c.num_iterations = 4;
    c.seed = 42;
  }
  run_case(c);
}

TEST(Normal, NoTokensAnywhere) {
  NormalCase c = small_case(2);
  c.num_tokens = {0};
  c.formats = {kBf16, kFp8};
  c.worst_case = {false, false, true, true};
  c.cached = {true};
  c.num_biases = {2};
  c.num_iterations = 4;
  run_case(c);
}

// Hidden sizes (7168 and 2688 = 21 scale groups; 520 is BF16 only: not a multiple of 128) and top-k from 1
// to the maximum, with as few experts as ranks and many, all on one buffer.
std::vector<NormalCase> shape_sweep(int num_ranks) {
  struct Shape {
    int hidden, num_topk, experts_per_rank;
    bool fp8;
  };
  const Shape shapes[] = {
      {2048, 1, 1, true}, {4096, 8, 16, true}, {7168, 16, 32, true}, {2688, 5, 8, true}, {520, 9, 8, false}};
  std::vector<NormalCase> cases;
  uint64_t seed = 51;
  for (const Shape& shape : shapes) {
    NormalCase c;
    c.num_ranks = num_ranks;
    c.hidden = shape.hidden;
    c.num_topk = shape.num_topk;
    c.num_experts = shape.experts_per_rank * num_ranks;
    c.num_tokens = {48, 17};
    c.formats = shape.fp8 ? std::vector<TokenFormat>{kBf16, kFp8} : std::vector<TokenFormat>{kBf16};
    c.num_iterations = static_cast<int>(c.formats.size());
    c.buffer_hidden = 7168;
    c.seed = seed++;
    cases.push_back(c);
  }
  return cases;
}

TEST_P(NormalRanks, HiddenAndTopkSizes) {
  run_cases_on_one_buffer(shape_sweep(GetParam()));
}

// ---- Cached and worst-case modes ----

// Re-dispatch of new x values with the handle, after top-k and rank-map dispatches.
NormalCase cached_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.cached = {true};
  c.formats = {kBf16, kFp8};
  c.route_by = {NormalRouteBy::kTopk, NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts,
                NormalRouteBy::kRankMap};
  c.expert_alignments = {1, 1, 128, 128};
  c.num_iterations = 4;
  c.seed = 61;
  return c;
}

TEST_P(NormalRanks, CachedRedispatch) {
  run_case(cached_case(GetParam()));
}

// The cached re-dispatch into the output window (the senders store straight into the peers' outputs):
// BF16 and FP8, 0, 1 and odd token counts, unbalanced routing (experts and ranks with no tokens), worst-case
// padding rows, two SM budgets, the queue's way in between on the same Buffer, and odd ranks through their
// queues while even ranks take the rows into their windows.
TEST_P(NormalRanks, CachedRedispatchIntoTheOutputWindow) {
  NormalCase c = cached_case(GetParam());
  c.cached_into_window = {true, true, false};
  c.odd_ranks_into_window = {true, true, true, false};
  c.num_tokens = {0, 1, 333, 64};
  c.routing = NormalRouting::kUnbalanced;
  c.worst_case = {false, false, false, false, true};
  c.num_sms = {20, 6};
  c.num_iterations = 6;
  run_case(c);
}

// Every dispatch into the output window: top-k and rank-map routing, BF16 and FP8, worst-case padding,
// expert alignment, counts off the layout board or the count exchange, the receive launched by notify into a
// guess in the window that the rows fit (the way decided at launch or, before the counts, on the device), one
// too small or none (through the queues, into the same window memory), 0, 1 and odd token counts, skewed
// routing, odd ranks through their queues.
TEST_P(NormalRanks, DispatchIntoTheOutputWindow) {
  NormalCase c = small_case(GetParam());
  c.into_window = {true};
  c.cached = {true, false};
  c.cached_into_window = {true, false, false};
  c.odd_ranks_into_window = {true, true, true, false};
  c.formats = {kBf16, kFp8, kFp8};
  c.route_by = {NormalRouteBy::kTopk, NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts};
  c.expert_alignments = {1, 128};
  c.worst_case = {false, false, false, false, true};
  // Odd iterations launch the receive: a guess that fits off the board (1, and 7 with odd ranks out of
  // their windows) and with the count exchange (5, and 11 with odd ranks out), one too small (3), none (9).
  c.launch_receive = {false, true};
  using enum epx::test::NormalGuess;
  c.guesses = {kNone, kFits, kNone, kTooSmall, kNone, kFits, kNone, kFits, kNone, kNone, kNone, kFits};
  c.num_tokens = {0, 1, 333, 64};
  c.routing = NormalRouting::kUnbalanced;
  c.num_sms = {20, 6};
  c.num_iterations = 12;
  c.seed = 67;
  run_case(c);
}

// Outputs of num_worst_tokens rows with padding; the caller's stream is held while the calls are issued, so a
// host synchronization inside any of them would show.
NormalCase worst_case_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.worst_case = {true};
  c.gate_caller_stream = true;
  c.cached = {false, true};
  c.formats = {kBf16, kBf16, kFp8, kFp8};
  c.route_by = {NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts, NormalRouteBy::kTopk};
  c.num_iterations = 4;
  c.seed = 71;
  return c;
}

TEST_P(NormalRanks, WorstCaseNoHostSync) {
  NormalCase c = worst_case_case(GetParam());
  // Four ranks unbalanced: rank 0 receives nothing, so all its rows are padding.
  if (GetParam() != 2) c.routing = NormalRouting::kUnbalanced;
  run_case(c);
}

// ---- SM budgets, combine variants, stream order ----

// The same inputs under several SM budgets: every budget must give the reference's bits.
NormalCase sm_budget_case(int num_ranks, TokenFormat format) {
  NormalCase c = small_case(num_ranks);
  c.formats = {format};
  c.num_sms = {2, 8, 24, 1};
  c.same_inputs = true;
  c.cached = {true};
  c.num_iterations = 4;
  c.seed = 81;
  return c;
}

// BF16 at two ranks, FP8 at four.
TEST_P(NormalRanks, SmBudgetsGiveIdenticalResults) {
  run_case(sm_budget_case(GetParam(), GetParam() == 2 ? kBf16 : kFp8));
}

// 0, 1 and 2 biases, each with and without top-k weights.
NormalCase combine_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.num_biases = {0, 1, 2};
  c.combine_weights = {true, false};
  c.num_iterations = 6;
  c.seed = 91;
  return c;
}

TEST_P(NormalRanks, CombineBiasesAndWeights) {
  NormalCase c = combine_case(GetParam());
  c.combine_repeats = 2;  // through the queues, back to back
  run_case(c);
}

// ---- The combine's staging area: peers' rows returned by copy engine (combine_staging_map.hpp) ----

// Every pair's rows fit: 0, 1 and odd token counts, unbalanced routing (a rank that receives nothing, one
// that sends nothing), BF16 and FP8 dispatches, cached re-dispatches, biases and weights, the three stream
// orders, and worst-case iterations (which keep to the queues: the host does not know the rows).
NormalCase staged_combine_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.routing = NormalRouting::kUnbalanced;
  c.num_tokens = {333, 0, 64, 1};
  c.formats = {kBf16, kFp8};
  c.cached = {false, true, false};
  c.num_biases = {0, 1, 2};
  c.combine_weights = {true, true, false};
  c.orders = {NormalOrder::kSync, NormalOrder::kAsyncFinish, NormalOrder::kSync, NormalOrder::kPreviousEvent};
  c.worst_case = {false, false, false, false, true};
  c.gate_caller_stream = true;
  c.num_sms = {16, 8, 2};  // the budgets whose combines take the staging area by default (up to 16 SMs)
  c.num_iterations = 12;
  c.staging_bytes = staging_bytes_for(c, 333);
  c.seed = 131;
  return c;
}

TEST_P(NormalRanks, StagedCombine) {
  run_case(staged_combine_case(GetParam()));
}

// Slots of 100 rows: a source of 333 tokens returns through the queues, one of 1 or 64 through the staging
// area, so a combine mixes both ways (per pair, per iteration); random routing, several SM budgets (20 SMs:
// above the default's 16, every pair through the queues).
TEST_P(NormalRanks, StagedCombineSomePairsFit) {
  NormalCase c = small_case(GetParam());
  c.num_tokens = {333, 64, 1};
  c.num_sms = {16, 8, 2, 20};
  c.num_biases = {1, 0};
  c.num_iterations = 6;
  c.staging_bytes = staging_bytes_for(c, 100);
  c.seed = 132;
  run_case(c);
}

// Five combines back to back per dispatch, each with other rows, through one staging slot per source: a
// peer's copies must wait until this rank finished reading the previous combine's rows; 20 iterations.
TEST_P(NormalRanks, StagedCombineManyCalls) {
  NormalCase c = small_case(GetParam());
  c.num_tokens = {333, 64, 200};
  c.orders = {NormalOrder::kAsyncFinish, NormalOrder::kSync};
  c.num_biases = {1, 2, 0};
  c.combine_repeats = 4;
  c.num_sms = {8, 16};
  c.num_iterations = 20;
  c.staging_bytes = staging_bytes_for(c, 333);
  c.seed = 133;
  run_case(c);
}

NormalCase order_case(int num_ranks, NormalOrder order) {
  NormalCase c = small_case(num_ranks);
  c.orders = {order};
  c.formats = {kBf16, kFp8};
  c.cached = {true, false};
  c.worst_case = {false, false, true, true};
  c.num_iterations = 4;
  c.seed = 101;
  return c;
}

TEST_P(NormalRanks, AsyncFinish) {
  run_case(order_case(GetParam(), NormalOrder::kAsyncFinish));
}

// Each call starts after the previous call's event while the caller's stream is held: nothing may wait for
// it.
TEST_P(NormalRanks, PreviousEvent) {
  NormalCase c = order_case(GetParam(), NormalOrder::kPreviousEvent);
  c.gate_caller_stream = true;
  run_case(c);
}

// ---- Many calls, one large shape ----

// Fresh inputs every call, and every setting changing from call to call (list lengths are mostly coprime, so
// the combinations keep shifting) on one buffer.
NormalCase many_calls_case(int num_ranks) {
  NormalCase c;
  c.num_ranks = num_ranks;
  c.hidden = 2688;
  c.num_experts = 8 * num_ranks;
  c.num_topk = 6;
  c.num_tokens = {333, 0, 48, 1, 7};
  c.formats = {kBf16, kFp8};
  c.route_by = {NormalRouteBy::kTopk, NormalRouteBy::kRankMapCounts, NormalRouteBy::kTopk,
                NormalRouteBy::kRankMap, NormalRouteBy::kTopk};
  c.expert_alignments = {1, 128, 1};
  c.worst_case = {false, true, false, false, true, false, false};
  c.cached = {false, false, true, false, false, false, false, true, false};
  c.num_sms = {1, 2, 3, 4, 8, 16, 20, 24, 6, 12, 32};
  c.num_biases = {0, 1, 2, 1};
  c.combine_weights = {true, true, false};
  c.orders = {NormalOrder::kSync,          NormalOrder::kAsyncFinish,  NormalOrder::kSync,
              NormalOrder::kPreviousEvent, NormalOrder::kSync,         NormalOrder::kSync,
              NormalOrder::kAsyncFinish,   NormalOrder::kPreviousEvent};
  c.gate_caller_stream = true;
  c.seed = 111;
  return c;
}

// 100 calls at two ranks; 120 at four, with unbalanced routing.
TEST_P(NormalRanks, ManyCalls) {
  NormalCase c = many_calls_case(GetParam());
  if (GetParam() == 2) {
    c.num_iterations = 100;
  } else {
    c.routing = NormalRouting::kUnbalanced;
    c.num_iterations = 120;
  }
  run_case(c);
}

// DeepSeek-like: 4096 tokens of hidden 7168 per rank, FP8, top-8. Four ranks where there are four GPUs.
TEST(Normal, Large4096x7168Fp8) {
  NormalCase c;
  c.num_ranks = epx::test::test_rank_capacity() >= 4 ? 4 : 2;
  c.hidden = 7168;
  c.num_experts = 64 * c.num_ranks;
  c.num_topk = 8;
  c.num_tokens = {4096};
  c.formats = {kFp8};
  c.expert_alignments = {128};
  c.num_biases = {2};
  c.num_sms = {24};
  // Small integers are quicker to generate for the ~10^9 reference values; the sums stay bit-exact either
  // way.
  c.combine_values = epx::reference::TokenValues::kSmallIntegers;
  c.seed = 121;
  run_case(c);
}

// ---- Any batch size through the size-hint buffer (the queues do not grow with the batch) ----

NormalCase many_tokens_case(int num_ranks, std::vector<int> num_tokens) {
  NormalCase c;
  c.num_ranks = num_ranks;
  c.hidden = 256;
  c.num_experts = 8 * num_ranks;
  c.num_topk = 4;
  c.num_tokens = std::move(num_tokens);
  c.formats = {kBf16, kFp8};
  c.hidden = 512;
  c.num_sms = {8};
  c.num_iterations = 2;
  c.combine_values = epx::reference::TokenValues::kSmallIntegers;
  return c;
}

// Two ranks: 1 token and four iterations; four ranks: 0 tokens and cached re-dispatch.
TEST_P(NormalRanks, TokenCountsAroundAndFarAboveTheOldCap) {
  NormalCase c;
  if (GetParam() == 2) {
    c = many_tokens_case(GetParam(), {4095, 4097, 1, 16384});
    c.num_iterations = 4;
    c.seed = 201;
  } else {
    c = many_tokens_case(GetParam(), {4095, 0, 16384, 4097});
    c.cached = {false, true};
    c.seed = 202;
  }
  run_case(c);
}

// Two ranks: cached and worst-case calls too; four ranks: one FP8 call.
TEST_P(NormalRanks, SixtyFiveThousandTokens) {
  NormalCase c = many_tokens_case(GetParam(), {65536});
  if (GetParam() == 2) {
    c.cached = {false, true};
    c.worst_case = {false, true};
    c.seed = 203;
  } else {
    c.num_iterations = 1;
    c.formats = {kFp8};
    c.seed = 204;
  }
  run_case(c);
}

// Every token to one rank (the others receive nothing), and a rank sending nothing (unbalanced routing).
NormalCase skewed_case(int num_ranks) {
  NormalCase c = small_case(num_ranks);
  c.routing = NormalRouting::kOneRank;
  c.num_tokens = {2000, 333, 0};
  c.formats = {kBf16, kFp8};
  c.cached = {false, true};
  c.num_iterations = 3;
  c.seed = 211;
  return c;
}

TEST_P(NormalRanks, EveryTokenToOneRank) {
  run_case(skewed_case(GetParam()));
}

// Queue settings at the extremes: one-token queues and chunks (every record waits for the receiver), and
// one queue as large as a channel's whole traffic.
NormalCase queue_case(int num_ranks, int chunk_tokens, int queue_tokens, std::vector<int> num_tokens) {
  NormalCase c = small_case(num_ranks);
  c.chunk_tokens = chunk_tokens;
  c.queue_tokens = queue_tokens;
  c.num_tokens = std::move(num_tokens);
  c.formats = {kBf16, kFp8};
  c.worst_case = {false, true};
  c.cached = {false, false, true};
  c.num_sms = {4, 2};
  c.num_iterations = 3;
  return c;
}

// Four ranks: unbalanced routing and a rank without tokens.
TEST_P(NormalRanks, OneTokenQueues) {
  NormalCase c;
  if (GetParam() == 2) {
    c = queue_case(GetParam(), 1, 1, {150, 77});
    c.seed = 221;
  } else {
    c = queue_case(GetParam(), 1, 1, {100, 33, 0, 64});
    c.routing = NormalRouting::kUnbalanced;
    c.seed = 222;
  }
  run_case(c);
}

TEST(Normal, OddChunksTwoRanks) {
  NormalCase c = queue_case(2, 5, 7, {1000, 333});
  c.seed = 223;
  run_case(c);
}

TEST(Normal, LargestQueuesFourRanks) {
  NormalCase c = queue_case(4, 4096, 4096, {4096, 1000});
  c.hidden = 256;
  c.seed = 224;
  run_case(c);
}

// The largest NVLink group (8 ranks): every queue index and the R x C count exchange at their widest.
TEST(Normal, EightRanks) {
  NormalCase c = small_case(8);
  c.num_tokens = {333, 0, 1, 64, 500};
  c.formats = {kBf16, kFp8};
  c.cached = {false, true};
  c.worst_case = {false, false, true};
  c.num_sms = {6, 4};
  c.num_iterations = 3;
  c.seed = 231;
  run_case(c);
}

// ---- Errors ----

using epx::test::expect_error;

// Two ranks where there are two GPUs, else one: the checks are the same, two ranks also show that a rejected
// call leaves the ranks in step.
int error_test_ranks() {
  return std::min(epx::test::test_rank_capacity(), 2);
}

NormalCase error_follow_up_case(int num_ranks, int hidden, int num_topk) {
  NormalCase c;
  c.num_ranks = num_ranks;
  c.hidden = hidden;
  c.num_experts = 4 * num_ranks;
  c.num_topk = num_topk;
  c.num_tokens = {8, 5};
  c.formats = {kBf16, kFp8};
  c.cached = {false, true};
  c.num_iterations = 2;
  return c;
}

// Every rank makes the same bad calls (a call rejected on one rank only would leave the others waiting in
// the next collective). Argument errors are raised before any kernel runs; errors about outputs come after a
// notify that went through; then a checked dispatch + combine runs on the same buffer.
TEST(NormalErrors, RejectedCallsLeaveTheBufferUsable) {
  const int num_ranks = error_test_ranks();
  if (num_ranks < 1) GTEST_SKIP() << "needs 1 GPU";
  run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) {
    const int R = num_ranks, T = 8, H = 256, K = 2, E = 4 * R;
    const NormalCase follow_up = error_follow_up_case(R, H, K);
    epx::BufferOptions options;
    options.num_nvl_bytes = epx::test::normal_buffer_bytes(follow_up);
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);

    // Every token picks the first and the last expert, so every rank receives every token (rows > 0).
    std::vector<int64_t> ids(T * K);
    for (int t = 0; t < T; ++t) {
      ids[t * K] = 0;
      ids[t * K + 1] = E - 1;
    }
    const size_t rows = size_t(R) * T;
    DeviceArray x(T * H * 2), scales(T * (H / 128) * 4), topk(T * K * 8), weights(T * K * 4), per_rank(R * 4),
        per_expert(E * 4), in_rank(T * R), recv_x(rows * H * 2), recv_idx(rows * K * 8),
        recv_weights(rows * K * 4), expert_x(rows * H * 2), combined(T * H * 2), combined_weights(T * K * 4);
    topk.upload(ids, nullptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    const epx::StreamOrder order{};
    const epx::DispatchLayoutOutput layout{per_rank.get<int>(), per_expert.get<int>(), in_rank.get<bool>()};
    auto get_layout = [&](const int64_t* idx, int num_topk, int num_experts) {
      epx::get_dispatch_layout(buffer, idx, T, num_topk, num_experts, layout, order);
    };

    // get_dispatch_layout and the SM budget.
    expect_error([&] { get_layout(nullptr, K, E); }, "invalid topk_idx = null");
    expect_error([&] { get_layout(topk.get<int64_t>(), 0, E); }, "invalid num_topk = 0: must be >= 1");
    expect_error([&] { get_layout(topk.get<int64_t>(), 17, E); }, "invalid num_topk = 17: must be <= 16");
    expect_error([&] { get_layout(topk.get<int64_t>(), K, 4098); },
                 "invalid num_experts = 4098: must be <= 4096");
    if (R >= 2)
      expect_error([&] { get_layout(topk.get<int64_t>(), K, E + 1); },
                   "must be a multiple of the number of ranks");
    expect_error([&] { buffer.set_num_sms(0); }, "invalid num_sms = 0");
    expect_error([&] { buffer.set_num_sms(buffer.num_device_sms() + 1); }, "must be <= the GPU's SM count");
    // Until a caller sets a config both send chunks are the recommended ones for this GPU kind and SM budget
    // (set_num_sms moves them with the budget); a caller's config is used whole.
    const auto chunk = [&](epx::ConfigFor op, int num_sms) {
      return epx::recommended_config(op, R, num_sms, buffer.gpu_kind()).num_max_nvl_chunked_send_tokens;
    };
    const epx::Config first = buffer.config();
    EXPECT_EQ(first.num_max_nvl_chunked_send_tokens, chunk(epx::ConfigFor::kDispatch, first.num_sms));
    EXPECT_EQ(buffer.combine_send_chunk(), chunk(epx::ConfigFor::kCombine, first.num_sms));
    const int wide = std::min(32, buffer.num_device_sms());
    buffer.set_num_sms(wide);
    EXPECT_EQ(buffer.config().num_max_nvl_chunked_send_tokens, chunk(epx::ConfigFor::kDispatch, wide));
    EXPECT_EQ(buffer.combine_send_chunk(), chunk(epx::ConfigFor::kCombine, wide));
    epx::Config mine = first;
    mine.num_max_nvl_chunked_send_tokens = 5;
    buffer.set_config(mine);
    EXPECT_EQ(buffer.combine_send_chunk(), 5);
    buffer.set_config(first);
    get_layout(topk.get<int64_t>(), K, E);

    epx::DispatchInput in;
    in.x = x.get();
    in.num_tokens = T;
    in.hidden = H;
    in.topk_idx = topk.get<int64_t>();
    in.topk_weights = weights.get<float>();
    in.num_topk = K;
    in.num_experts = E;
    in.is_token_in_rank = in_rank.get<bool>();
    in.num_tokens_per_expert = per_expert.get<int>();
    auto notify = [&](const epx::DispatchInput& i, const epx::DispatchHandle* cached = nullptr) {
      return epx::dispatch_notify(buffer, i, order, cached);
    };

    // dispatch_notify arguments.
    epx::DispatchInput bad = in;
    bad.format = kFp8;
    bad.x_scales = scales.get<float>();
    bad.hidden = 200;
    expect_error([&] { notify(bad); }, "invalid hidden = 200: must be a multiple of 16 for FP8 tokens");
    bad = in;
    bad.hidden = 100;
    expect_error([&] { notify(bad); }, "invalid hidden = 100: must be a multiple of 8");
    bad = in;
    bad.num_topk = 17;
    expect_error([&] { notify(bad); }, "invalid num_topk = 17: must be <= 16");
    bad = in;
    bad.num_experts = 4098;
    expect_error([&] { notify(bad); }, "invalid num_experts = 4098: must be <= 4096");
    if (R >= 2) {
      bad = in;
      bad.num_experts = E + 1;
      expect_error([&] { notify(bad); }, "must be a multiple of the number of ranks");
    }
    bad = in;
    bad.num_tokens = -1;
    expect_error([&] { notify(bad); }, "invalid num_tokens = -1");
    bad = in;
    bad.x = nullptr;
    expect_error([&] { notify(bad); }, "invalid x = null");
    bad = in;
    bad.x = x.get<char>() + 8;
    expect_error([&] { notify(bad); }, "must be 16-byte aligned");
    bad = in;
    bad.format = kFp8;
    expect_error([&] { notify(bad); }, "invalid x_scales = null: are required for FP8 tokens");
    bad = in;
    bad.x_scales = scales.get<float>();
    expect_error([&] { notify(bad); }, "invalid x_scales = non-null: must be null for BF16 tokens");
    bad = in;
    bad.is_token_in_rank = nullptr;
    expect_error([&] { notify(bad); }, "invalid is_token_in_rank = null");
    bad = in;
    bad.topk_idx = nullptr;
    expect_error([&] { notify(bad); }, "invalid topk_weights = non-null: need topk_idx as well");
    bad = in;
    bad.expert_alignment = 0;
    expect_error([&] { notify(bad); }, "invalid expert_alignment = 0");
    bad = in;
    bad.num_worst_tokens = -1;
    expect_error([&] { notify(bad); }, "invalid num_worst_tokens = -1");

    // dispatch_receive outputs, after a notify that went through.
    const epx::DispatchPlan plan = notify(in);
    if (plan.num_recv_rows != static_cast<int>(rows))
      throw std::runtime_error("num_recv_rows " + std::to_string(plan.num_recv_rows) + ", expected " +
                               std::to_string(rows));
    const epx::DispatchOutput out{recv_x.get(), nullptr, recv_idx.get<int64_t>(), recv_weights.get<float>()};
    epx::DispatchOutput bad_out = out;
    bad_out.recv_x = nullptr;
    expect_error([&] { epx::dispatch_receive(buffer, plan, in, bad_out, order); }, "invalid recv_x = null");
    bad_out = out;
    bad_out.recv_x = recv_x.get<char>() + 4;
    expect_error([&] { epx::dispatch_receive(buffer, plan, in, bad_out, order); }, "invalid recv_x = 0x");
    bad_out = out;
    bad_out.recv_topk_weights = nullptr;
    expect_error([&] { epx::dispatch_receive(buffer, plan, in, bad_out, order); },
                 "invalid recv_topk_weights = null");
    epx::dispatch_receive(buffer, plan, in, out, order);

    // A receive launched by dispatch_notify: rejected outputs let it drain (the plan is then spent), a notify
    // cancels an earlier one nobody received, and the calls after both work.
    const auto notify_launching = [&] {
      return epx::dispatch_notify(buffer, in, order, nullptr, epx::DispatchOverlap::kLaunchReceive);
    };
    const epx::DispatchPlan drained = notify_launching();
    bad_out = out;
    bad_out.recv_x = recv_x.get<char>() + 4;
    expect_error([&] { epx::dispatch_receive(buffer, drained, in, bad_out, order); }, "invalid recv_x = 0x");
    expect_error([&] { epx::dispatch_receive(buffer, drained, in, out, order); },
                 "invalid plan = already received");
    notify_launching();                                // never received: the next notify cancels it
    epx::dispatch_cancel(buffer, notify_launching());  // the caller gives up (e.g. no memory for outputs)
    // A spent plan never hands its outputs to a later notify's receive, which still receives its own.
    const epx::DispatchPlan later = notify_launching();
    expect_error([&] { epx::dispatch_receive(buffer, drained, in, out, order); },
                 "invalid plan = already received");
    epx::dispatch_receive(buffer, later, in, out, order);

    // A guess: misaligned outputs are refused before anything launches; rows that went into the guess must
    // be received with the guess's outputs.
    const auto notify_guessing = [&](const epx::DispatchOutputGuess& guess) {
      return epx::dispatch_notify(buffer, in, order, nullptr, epx::DispatchOverlap::kLaunchReceive, &guess);
    };
    bad_out = out;
    bad_out.recv_x = recv_x.get<char>() + 4;
    expect_error([&] { notify_guessing({bad_out, static_cast<int>(rows)}); }, "invalid recv_x = 0x");
    const epx::DispatchPlan guessed = notify_guessing({out, static_cast<int>(rows)});
    if (epx::test::launched_receives_enabled()) {
      if (!guessed.rows_in_guess) throw std::runtime_error("rows_in_guess is false for a guess with room");
      bad_out = out;
      bad_out.recv_topk_weights = recv_weights.get<float>() + K;
      expect_error([&] { epx::dispatch_receive(buffer, guessed, in, bad_out, order); },
                   "invalid out = other outputs: must be the guess's outputs");
    }
    const epx::DispatchPlan guessed_again = notify_guessing({out, static_cast<int>(rows)});
    epx::dispatch_receive(buffer, guessed_again, in, out, order);

    // combine arguments.
    const epx::CombineInput comb{expert_x.get(), recv_weights.get<float>(), K, nullptr, nullptr};
    const epx::CombineOutput comb_out{combined.get(), combined_weights.get<float>()};
    auto combine = [&](const epx::DispatchHandle& handle, const epx::CombineInput& i,
                       const epx::CombineOutput& o) { epx::combine(buffer, handle, i, o, order); };
    epx::CombineInput bad_comb = comb;
    bad_comb.x = nullptr;
    expect_error([&] { combine(plan.handle, bad_comb, comb_out); }, "invalid x = null");
    bad_comb = comb;
    bad_comb.x = expert_x.get<char>() + 2;
    expect_error([&] { combine(plan.handle, bad_comb, comb_out); }, "must be 16-byte aligned");
    bad_comb = comb;
    bad_comb.bias0 = combined.get<char>() + 8;
    expect_error([&] { combine(plan.handle, bad_comb, comb_out); }, "invalid bias0");
    expect_error(
        [&] {
          combine(plan.handle, comb,
                  epx::CombineOutput{combined.get<char>() + 8, combined_weights.get<float>()});
        },
        "invalid combined_x");
    bad_comb = comb;
    bad_comb.num_topk = K - 1;
    expect_error([&] { combine(plan.handle, bad_comb, comb_out); },
                 "invalid num_topk = 1: must be 0 or the dispatch's top-k");
    bad_comb = comb;
    bad_comb.topk_weights = nullptr;
    expect_error([&] { combine(plan.handle, bad_comb, comb_out); }, "invalid topk_weights = null");
    expect_error(
        [&] {
          combine(plan.handle, comb, epx::CombineOutput{nullptr, combined_weights.get<float>()});
        },
        "invalid combined_x = null");
    expect_error([&] { combine(epx::DispatchHandle{}, comb, comb_out); }, "invalid handle = empty");
    combine(plan.handle, comb, comb_out);

    // A cached re-dispatch keeps the token count; top-k outputs need a dispatch with top-k.
    epx::DispatchInput plain = in;
    plain.topk_idx = nullptr;
    plain.topk_weights = nullptr;
    plain.num_topk = 0;
    bad = plain;
    bad.num_tokens = T - 1;
    expect_error([&] { notify(bad, &plan.handle); }, "must equal the cached handle's token count");
    const epx::DispatchPlan plain_plan = notify(plain);
    expect_error([&] { epx::dispatch_receive(buffer, plain_plan, plain, out, order); },
                 "invalid recv_topk_idx = non-null: needs a dispatch with topk_idx");
    epx::dispatch_receive(buffer, plain_plan, plain,
                          epx::DispatchOutput{recv_x.get(), nullptr, nullptr, nullptr}, order);
    buffer.synchronize(nullptr);

    epx::test::NormalRunner(follow_up, buffer).run();
  });
}

// Ids >= num_experts (or `bad_id` in general) on every rank: the layout ignores them, the next
// dispatch_notify reports them, and the buffer still works afterwards.
void check_bad_ids_are_reported(int64_t bad_id) {
  const int num_ranks = error_test_ranks();
  if (num_ranks < 1) GTEST_SKIP() << "needs 1 GPU";
  run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) {
    const int R = num_ranks, T = 16, H = 256, K = 4, E = 4 * R;
    const NormalCase follow_up = error_follow_up_case(R, H, K);
    epx::BufferOptions options;
    options.num_nvl_bytes = epx::normal_nvl_buffer_size_hint(size_t(H) * 2, R);  // also fits follow_up
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);

    std::vector<int64_t> ids = epx::reference::random_topk_idx(7 + bootstrap.rank(), T, K, E);
    std::vector<int64_t> ignored = ids;  // what the layout must see: the bad ids as -1
    ids[3 * K + 1] = bad_id;
    ids[9 * K + 2] = bad_id == -2 ? -5 : bad_id + 5;
    ignored[3 * K + 1] = ignored[9 * K + 2] = -1;
    DeviceArray x(T * H * 2), topk(T * K * 8), weights(T * K * 4), per_rank(R * 4), per_expert(E * 4),
        in_rank(T * R);
    topk.upload(ids, nullptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    const epx::StreamOrder order{};
    epx::get_dispatch_layout(
        buffer, topk.get<int64_t>(), T, K, E,
        epx::DispatchLayoutOutput{per_rank.get<int>(), per_expert.get<int>(), in_rank.get<bool>()}, order);
    buffer.synchronize(nullptr);
    const epx::reference::DispatchLayout want =
        epx::reference::get_dispatch_layout(ignored.data(), T, K, E, R);
    if (per_rank.download<int>(R) != want.num_tokens_per_rank ||
        per_expert.download<int>(E) != want.num_tokens_per_expert ||
        in_rank.download<uint8_t>(size_t(T) * R) != want.is_token_in_rank)
      throw std::runtime_error("the layout did not ignore the out-of-range ids");

    epx::DispatchInput in;
    in.x = x.get();
    in.num_tokens = T;
    in.hidden = H;
    in.topk_idx = topk.get<int64_t>();
    in.topk_weights = weights.get<float>();
    in.num_topk = K;
    in.num_experts = E;
    in.is_token_in_rank = in_rank.get<bool>();
    in.num_tokens_per_expert = per_expert.get<int>();
    expect_error([&] { epx::dispatch_notify(buffer, in, order); }, "must be -1 or in [0, num_experts)");

    epx::test::NormalRunner(follow_up, buffer).run();
  });
}

TEST(NormalErrors, OutOfRangeExpertIdsAreReported) {
  check_bad_ids_are_reported(16);  // >= num_experts for one and two ranks
}

// Ids below -1 are reported like ids >= num_experts (epx/normal.hpp: ids outside [-1, E)).
TEST(NormalErrors, IdsBelowMinusOneAreReported) {
  check_bad_ids_are_reported(-2);
}

// A config whose queues do not fit the buffer is rejected on every rank, naming the bytes it needs; the
// config the buffer was sized for then works on the same buffer.
TEST(NormalErrors, BufferSmallerThanTheConfigNeeds) {
  const int num_ranks = error_test_ranks();
  if (num_ranks < 1) GTEST_SKIP() << "needs 1 GPU";
  run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) {
    const int R = num_ranks, H = 512, K = 4, E = 8 * R;
    NormalCase c;
    c.num_ranks = R;
    c.hidden = H;
    c.num_experts = E;
    c.num_topk = K;
    c.num_tokens = {300};
    c.num_sms = {4};
    epx::BufferOptions options;
    options.num_nvl_bytes = epx::test::normal_buffer_bytes(c);
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);

    // Nothing is read before the check, so small placeholder arrays do.
    DeviceArray placeholder(256);
    epx::DispatchInput in;
    in.x = placeholder.get();
    in.num_tokens = 1;
    in.hidden = H;
    in.topk_idx = placeholder.get<int64_t>();
    in.topk_weights = placeholder.get<float>();
    in.num_topk = K;
    in.num_experts = E;
    in.is_token_in_rank = placeholder.get<bool>();
    epx::Config wide = epx::test::normal_config(c, 4);
    wide.num_sms = 8;
    buffer.set_config(wide);
    if (R > 1) {
      expect_error([&] { epx::dispatch_notify(buffer, in, epx::StreamOrder{}); },
                   "size it with Config::get_nvl_buffer_size_hint");
    }
    epx::Config bad = wide;
    bad.num_max_nvl_chunked_send_tokens = bad.num_max_nvl_chunked_recv_tokens + 1;
    expect_error([&] { buffer.set_config(bad); }, "must be <= num_max_nvl_chunked_recv_tokens");
    epx::test::NormalRunner(c, buffer).run();
  });
}

}  // namespace
