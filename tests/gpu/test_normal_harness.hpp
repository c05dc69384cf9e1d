#pragma once

// Multi-GPU harness of the normal-mode tests, built like the low-latency one: one process per GPU (rank =
// device); every process generates every rank's seeded inputs, runs the CPU reference for all ranks and
// checks its own GPU outputs against its own rank's reference output.
//
// Everything is compared bit-exactly: the layout, the dispatched rows, scales, top-k ids and weights, the
// per-expert counts and the receive order, and the combine as well. The combine needs no integer-valued
// tokens for that: the reduce kernel adds a token's returned copies in ascending rank order, then bias0,
// then bias1, in float32 with one final round to BF16, which is the order reference::normal_combine defines
// (and additions alone leave the compiler nothing to contract into FMAs).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "buffer_map/combine_staging_map.hpp"
#include "buffer_map/internode_buffer_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "epx/normal.hpp"
#include "reference/internode.hpp"
#include "reference/layout.hpp"
#include "reference/normal.hpp"
#include "stream_gate.hpp"
#include "test_low_latency_harness.hpp"  // DeviceArray, fail

namespace epx::test {

enum class NormalRouting {
  kRandom,      // distinct experts per token, plus drop_probability -1 ids
  kUnbalanced,  // reference::make_unbalanced_routing: hot and empty experts, -1 ids, rank 0 receives nothing,
                // the last rank sends nothing
  kOneRank,     // every token goes to rank 0's experts only (every other rank receives nothing)
};

// What the dispatch is told about where tokens go.
enum class NormalRouteBy {
  kTopk,           // topk_idx + weights (+ the layout's maps): recv top-k outputs and per-expert counts
  kRankMapCounts,  // is_token_in_rank and num_tokens_per_expert only: no top-k outputs
  kRankMap,        // is_token_in_rank alone: no top-k outputs, per-expert counts unspecified
};

// With a receive launched by notify: outputs given to dispatch_notify beforehand (DispatchOutputGuess).
enum class NormalGuess {
  kNone,
  kFits,      // room for the rows and 7 more: the rows go there (plan.rows_in_guess)
  kTooSmall,  // one row short (none when no row arrives): the receive waits for dispatch_receive's outputs
};

enum class NormalOrder {
  kSync,           // the caller's stream waits for every operation
  kAsyncFinish,    // every operation returns an event the caller's stream then waits on
  kPreviousEvent,  // every operation starts after the previous one's event, never after the caller's stream
};

struct NormalCase {
  int num_ranks = 2;
  int hidden = 2048;
  int num_experts = 16;
  int num_topk = 4;
  // Tokens of rank r in iteration i: num_tokens[(r + i) % size], so every rank meets every count.
  std::vector<int> num_tokens{64};
  NormalRouting routing = NormalRouting::kRandom;
  double drop_probability = 0.05;  // kRandom: extra -1 ids
  bool duplicates = false;         // every third token lists its first expert again (it still counts once)
  // Per-iteration settings: iteration i uses element i % size of each list.
  std::vector<TokenFormat> formats{TokenFormat::kBf16};
  std::vector<NormalRouteBy> route_by{NormalRouteBy::kTopk};
  std::vector<int> expert_alignments{1};
  std::vector<bool> worst_case{false};  // num_worst_tokens = every rank's tokens + 3, so padding rows exist
  std::vector<bool> cached{false};  // then re-dispatch new x with the handle and combine with the new handle
  // The dispatch's outputs lie in the Buffer's output window (the senders store straight there), and those of
  // the cached re-dispatch after them.
  std::vector<bool> into_window{false};
  std::vector<bool> cached_into_window{false};
  // false: odd ranks keep both dispatches' outputs out of their windows (they receive through their queues
  // while their peers' sources store straight into the others').
  std::vector<bool> odd_ranks_into_window{true};
  std::vector<int> num_sms{20};
  std::vector<int> num_biases{1};
  std::vector<bool> combine_weights{true};  // with top-k: the combine also reduces [rows, K] weights
  std::vector<NormalOrder> orders{NormalOrder::kSync};
  // true: dispatch_notify launches the receive before its host wait (DispatchOverlap::kLaunchReceive).
  std::vector<bool> launch_receive{true, false};
  std::vector<NormalGuess> guesses{NormalGuess::kFits, NormalGuess::kTooSmall, NormalGuess::kNone};
  // In iterations where no call may wait for the device (worst-case rows, or previous-event order), hold the
  // caller's stream at a host callback while the calls are issued: a call that waits makes the gate time out,
  // which is reported, instead of hanging the test.
  bool gate_caller_stream = false;
  reference::TokenValues combine_values = reference::TokenValues::kUniform;
  bool same_inputs = false;  // every iteration uses the same seed and token counts
  int num_iterations = 1;
  int buffer_hidden = 0;  // sizes the NVLink buffer; 0: hidden
  // Queue settings of every call (Config's num_max_nvl_chunked_send_tokens / _recv_tokens).
  int chunk_tokens = Config{}.num_max_nvl_chunked_send_tokens;
  int queue_tokens = Config{}.num_max_nvl_chunked_recv_tokens;
  // Across nodes: nodes of this many ranks (0: one node), and the network queue settings
  // (num_max_rdma_chunked_send_tokens / _recv_tokens).
  int ranks_per_node = 0;
  int rdma_chunk_tokens = Config{}.num_max_rdma_chunked_send_tokens;
  int rdma_queue_tokens = Config{}.num_max_rdma_chunked_recv_tokens;
  // The combine's staging area (BufferOptions::num_nvl_staging_bytes; 0: none): staging_bytes_for sizes it.
  size_t staging_bytes = 0;
  // Combines issued right after the first one with the same handle, without waiting: repeat j reduces the
  // first's x and biases scaled by repeat_scale(j) (no weights), so consecutive combines move different rows
  // and its output must be the first's scaled (power-of-two scaling commutes with the float sum and
  // rounding).
  int combine_repeats = 0;
  uint64_t seed = 1;

  bool spans_nodes() const { return ranks_per_node > 0 && ranks_per_node < num_ranks; }
};

// The config of the iterations that use `num_sms` SMs.
// Whether dispatch_notify launches receives (and uses guesses): EPX_LAUNCH_RECEIVE=0 (compute-sanitizer runs)
// turns them off, as DispatchOverlap::kLaunchReceive documents.
inline bool launched_receives_enabled() {
  const char* text = std::getenv("EPX_LAUNCH_RECEIVE");
  return text == nullptr || std::string(text) != "0";
}

inline Config normal_config(const NormalCase& c, int num_sms) {
  Config config;
  config.num_sms = num_sms;
  config.num_max_nvl_chunked_send_tokens = c.chunk_tokens;
  config.num_max_nvl_chunked_recv_tokens = c.queue_tokens;
  config.num_max_rdma_chunked_send_tokens = c.rdma_chunk_tokens;
  config.num_max_rdma_chunked_recv_tokens = c.rdma_queue_tokens;
  return config;
}

// NVLink bytes a Buffer needs for every iteration of `c`: the size hint of its widest config (it does not
// depend on the token counts).
inline size_t normal_buffer_bytes(const NormalCase& c) {
  const int hidden = c.buffer_hidden > 0 ? c.buffer_hidden : c.hidden;
  const int num_sms = *std::max_element(c.num_sms.begin(), c.num_sms.end());
  const Config config = normal_config(c, num_sms);
  const size_t hint = config.get_nvl_buffer_size_hint(size_t(hidden) * 2, c.num_ranks);
  if (!c.spans_nodes()) return hint;
  // Virtual nodes with tiny queues may need more than one node's hint: the forwarding queues' fixed counters.
  const ForwardBufferMap forward = ForwardBufferMap::of(c.ranks_per_node, c.num_ranks / c.ranks_per_node,
                                                        config, InternodeRecord::largest(size_t(hidden) * 2));
  return std::max(hint, forward.total_bytes());
}

// Output-window bytes (BufferOptions::num_nvl_output_bytes) for every iteration of `c`: twice the most rows a
// rank can receive (every token of every rank, plus worst-case padding or a guess's room) with BF16 rows, FP8
// scales and top-k, each output 16-byte aligned (the source indices go through the queues). 0 when no
// iteration dispatches into the window.
inline size_t normal_window_bytes(const NormalCase& c) {
  const auto any = [](const std::vector<bool>& v) { return std::find(v.begin(), v.end(), true) != v.end(); };
  if (!any(c.into_window) && !any(c.cached_into_window)) return 0;
  // Room for 7 rows more (a guess that fits) and both dispatches' outputs.
  const size_t rows = size_t(c.num_ranks) * *std::max_element(c.num_tokens.begin(), c.num_tokens.end()) + 10;
  return 2 * rows * (size_t(c.hidden) * 2 + size_t(c.hidden) / 32 + size_t(c.num_topk) * 12) + 16 * 16 + 128;
}

// The factor of repeated combine j (NormalCase::combine_repeats): 2, 4, 2, 4, ... after the first's 1.
inline float repeat_scale(int j) {
  return j % 2 == 0 ? 2.0f : 4.0f;
}

// BF16 values times `factor` (a power of two: exact for the values the tests use).
inline std::vector<uint16_t> scaled_bf16(const std::vector<uint16_t>& values, float factor) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = float_to_bf16(bf16_to_float(values[i]) * factor);
  return out;
}

// Staging bytes (BufferOptions::num_nvl_staging_bytes) whose slots hold `rows` rows of `c`'s combine (BF16
// rows of hidden, its top-k weights) from each peer.
inline size_t staging_bytes_for(const NormalCase& c, int rows) {
  const size_t row_bytes = size_t(c.hidden) * 2 + sizeof(float) * c.num_topk;
  return CombineStagingMap::kFlagBytes + size_t(c.num_ranks - 1) * (size_t(rows) * row_bytes + kNormalAlign);
}

// Symmetric bytes a Buffer across nodes needs for every iteration of `c` (0 on one node).
inline size_t normal_rdma_buffer_bytes(const NormalCase& c) {
  if (!c.spans_nodes()) return 0;
  const int hidden = c.buffer_hidden > 0 ? c.buffer_hidden : c.hidden;
  const int num_sms = *std::max_element(c.num_sms.begin(), c.num_sms.end());
  return normal_config(c, num_sms)
      .get_rdma_buffer_size_hint(size_t(hidden) * 2, c.num_ranks, c.ranks_per_node);
}

template <typename T>
T cyclic_at(const std::vector<T>& list, int index) {
  if (list.empty()) throw std::runtime_error("NormalCase: a per-iteration list is empty");
  return list[static_cast<size_t>(index) % list.size()];
}

template <typename T>
std::vector<T> download_device(const T* device, size_t count) {
  std::vector<T> host(count);
  if (count > 0) EPX_CUDA_CHECK(cudaMemcpy(host.data(), device, sizeof(T) * count, cudaMemcpyDeviceToHost));
  return host;
}

template <typename T>
std::string show_value(T value) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t bits = 0;
    std::memcpy(&bits, &value, 4);
    char text[64];
    std::snprintf(text, sizeof(text), "%.9g (bits 0x%08x)", static_cast<double>(value), bits);
    return text;
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.9g (bf16 0x%04x)", static_cast<double>(bf16_to_float(value)), value);
    return text;
  } else {
    return std::to_string(static_cast<long long>(value));
  }
}

// One iteration's settings, resolved from the case.
struct NormalStep {
  int iteration = 0;
  uint64_t seed = 0;
  std::vector<int> num_tokens;  // [R]
  TokenFormat format = TokenFormat::kBf16;
  NormalRouteBy route_by = NormalRouteBy::kTopk;
  int expert_alignment = 1;
  int num_worst_tokens = 0;
  bool cached = false;
  bool into_window = false;
  bool cached_into_window = false;
  bool odd_ranks_into_window = true;
  int num_sms = 20;
  int num_biases = 0;
  bool combine_weights = false;  // only with top-k: a dispatch without it has no weights to combine
  NormalOrder order = NormalOrder::kSync;
  bool launch_receive = false;
  NormalGuess guess = NormalGuess::kNone;  // only with launch_receive
  bool gated = false;

  bool fp8() const { return format == TokenFormat::kFp8; }
  bool with_topk() const { return route_by == NormalRouteBy::kTopk; }
};

// Every rank's inputs and the reference's answers for one iteration.
struct NormalExpected {
  std::vector<std::vector<int64_t>> topk_idx;      // [R][T * K], also feeds the layout without top-k
  std::vector<std::vector<float>> topk_weights;    // [R][T * K]
  std::vector<reference::DispatchLayout> layouts;  // [R]
  std::vector<reference::NormalDispatchRankInput> inputs;
  reference::NormalDispatchResult dispatched;
  std::vector<reference::NormalDispatchRankInput> cached_inputs;  // new payload, same routing
  reference::NormalDispatchResult redispatched;
  std::vector<reference::NormalCombineRankInput> combine_inputs;
  std::vector<reference::NormalCombineRankOutput> combined;
};

// ---- The CPU side of an iteration: settings, inputs, reference answers (no GPU needed) ----

inline NormalStep normal_step(const NormalCase& c, int iteration) {
  const int i = iteration;
  NormalStep s;
  s.iteration = i;
  s.seed = c.seed * 1000003 + (c.same_inputs ? 0 : i);
  const int shift = c.same_inputs ? 0 : i;
  int all_tokens = 0;
  for (int r = 0; r < c.num_ranks; ++r) {
    s.num_tokens.push_back(cyclic_at(c.num_tokens, r + shift));
    all_tokens += s.num_tokens.back();
  }
  s.format = cyclic_at(c.formats, i);
  s.route_by = cyclic_at(c.route_by, i);
  s.expert_alignment = cyclic_at(c.expert_alignments, i);
  s.num_worst_tokens = cyclic_at(c.worst_case, i) ? all_tokens + 3 : 0;
  s.cached = cyclic_at(c.cached, i);
  s.into_window = cyclic_at(c.into_window, i);
  s.cached_into_window = s.cached && cyclic_at(c.cached_into_window, i);
  s.odd_ranks_into_window = cyclic_at(c.odd_ranks_into_window, i);
  s.num_sms = cyclic_at(c.num_sms, i);
  s.num_biases = cyclic_at(c.num_biases, i);
  s.combine_weights = s.with_topk() && cyclic_at(c.combine_weights, i);
  s.order = cyclic_at(c.orders, i);
  s.launch_receive = cyclic_at(c.launch_receive, i);
  s.guess = s.launch_receive ? cyclic_at(c.guesses, i) : NormalGuess::kNone;
  s.gated = c.gate_caller_stream && (s.num_worst_tokens > 0 || s.order == NormalOrder::kPreviousEvent);
  return s;
}

inline std::string describe_step(const NormalCase& c, const NormalStep& s) {
  static const char* const kRouteBy[] = {"top-k", "rank map + expert counts", "rank map"};
  static const char* const kOrders[] = {"sync", "async_finish", "previous_event"};
  std::ostringstream out;
  out << (s.fp8() ? "FP8" : "BF16") << ", hidden " << c.hidden << ", " << c.num_experts << " experts, top-"
      << c.num_topk << ", routed by " << kRouteBy[static_cast<int>(s.route_by)] << ", alignment "
      << s.expert_alignment;
  if (s.num_worst_tokens > 0) out << ", worst-case " << s.num_worst_tokens << " rows";
  if (s.into_window) out << ", into the output window";
  if ((s.into_window || s.cached_into_window) && !s.odd_ranks_into_window) out << " (even ranks only)";
  if (s.cached) out << ", cached re-dispatch" << (s.cached_into_window ? " into the output window" : "");
  if (s.launch_receive) out << ", receive launched by notify";
  if (s.guess == NormalGuess::kFits) out << " into a guess with room";
  if (s.guess == NormalGuess::kTooSmall) out << " with a guess too small";
  out << ", " << s.num_sms << " SMs, " << s.num_biases << " biases" << (s.combine_weights ? ", weights" : "")
      << ", " << kOrders[static_cast<int>(s.order)] << ", tokens [";
  for (size_t r = 0; r < s.num_tokens.size(); ++r) out << (r > 0 ? " " : "") << s.num_tokens[r];
  out << "]";
  return out.str();
}

inline std::vector<std::vector<int64_t>> normal_routing(const NormalCase& c, const NormalStep& s) {
  const int K = c.num_topk;
  std::vector<std::vector<int64_t>> ids;
  if (c.routing == NormalRouting::kUnbalanced) {
    ids = reference::make_unbalanced_routing(s.seed, s.num_tokens, K, c.num_experts, c.num_ranks);
  } else {
    for (int r = 0; r < c.num_ranks; ++r) {
      reference::RoutingSpec spec;
      spec.num_tokens = s.num_tokens[r];
      spec.num_topk = K;
      spec.num_experts = c.num_experts;
      spec.num_ranks = c.num_ranks;
      if (c.routing == NormalRouting::kOneRank) {
        for (int other = 1; other < c.num_ranks; ++other) spec.excluded_ranks.push_back(other);
      }
      spec.drop_probability = c.drop_probability;
      ids.push_back(reference::make_topk_idx(spec, s.seed * 1000 + r));
    }
  }
  if (c.duplicates && K >= 2) {
    for (int r = 0; r < c.num_ranks; ++r) {
      for (int t = 0; t < s.num_tokens[r]; t += 3) {
        int64_t* row = &ids[r][size_t(t) * K];
        if (row[0] >= 0) row[K - 1] = row[0];
      }
    }
  }
  return ids;
}

// Stamped tokens (BF16), or their FP8 quantization, so a misplaced row names where it came from.
inline void normal_payload(const NormalCase& c, const NormalStep& s, uint64_t seed, int rank,
                           reference::NormalDispatchRankInput& in) {
  if (s.fp8()) {
    reference::Fp8Tokens tokens = reference::random_fp8_tokens(seed, in.num_tokens, c.hidden, rank);
    in.x_fp8 = std::move(tokens.x);
    in.x_scales = std::move(tokens.scales);
  } else {
    in.x =
        reference::random_bf16_tokens(seed, in.num_tokens, c.hidden, rank, reference::TokenValues::kUniform);
  }
}

inline NormalExpected expect_normal(const NormalCase& c, const NormalStep& s) {
  const int R = c.num_ranks;
  const int H = c.hidden;
  const int K = c.num_topk;
  NormalExpected e;
  e.topk_idx = normal_routing(c, s);
  for (int r = 0; r < R; ++r) {
    e.topk_weights.push_back(reference::random_topk_weights(s.seed * 104729 + r, s.num_tokens[r], K));
    e.layouts.push_back(
        reference::get_dispatch_layout(e.topk_idx[r].data(), s.num_tokens[r], K, c.num_experts, R));
  }

  reference::NormalDispatchParams params;
  params.num_ranks = R;
  params.num_experts = c.num_experts;
  params.hidden = H;
  params.format = s.fp8() ? reference::PayloadFormat::kFp8 : reference::PayloadFormat::kBf16;
  params.with_topk = s.with_topk();
  params.num_topk = s.with_topk() ? K : 0;
  params.expert_alignment = s.expert_alignment;
  params.num_worst_tokens = s.num_worst_tokens;
  e.inputs.resize(R);
  for (int r = 0; r < R; ++r) {
    reference::NormalDispatchRankInput& in = e.inputs[r];
    in.num_tokens = s.num_tokens[r];
    normal_payload(c, s, s.seed * 7919 + r, r, in);
    if (s.with_topk()) {
      in.topk_idx = e.topk_idx[r];
      in.topk_weights = e.topk_weights[r];
    } else {
      in.is_token_in_rank = e.layouts[r].is_token_in_rank;
      if (s.route_by == NormalRouteBy::kRankMapCounts)
        in.num_tokens_per_expert = e.layouts[r].num_tokens_per_expert;
    }
  }
  e.dispatched = reference::normal_dispatch(params, e.inputs);

  if (s.cached) {
    // A cached re-dispatch repeats the routing from the handle and carries only the payload.
    reference::NormalDispatchParams again = params;
    again.with_topk = false;
    again.num_topk = 0;
    e.cached_inputs.resize(R);
    for (int r = 0; r < R; ++r) {
      e.cached_inputs[r].num_tokens = s.num_tokens[r];
      normal_payload(c, s, s.seed * 15485863 + r, r, e.cached_inputs[r]);
      e.cached_inputs[r].is_token_in_rank = e.layouts[r].is_token_in_rank;
    }
    e.redispatched = reference::normal_dispatch(again, e.cached_inputs);
  }

  // Expert outputs: fresh values in every row, padding rows included (the combine must ignore those).
  e.combine_inputs.resize(R);
  for (int d = 0; d < R; ++d) {
    reference::NormalCombineRankInput& in = e.combine_inputs[d];
    const int rows = e.dispatched.ranks[d].num_rows;
    in.x = reference::random_bf16_tokens(s.seed * 31337 + d, rows, H, d, c.combine_values, false);
    if (s.combine_weights) in.topk_weights = reference::random_topk_weights(s.seed * 611953 + d, rows, K);
    if (s.num_biases >= 1)
      in.bias0 =
          reference::random_bf16_tokens(s.seed * 4111 + d, s.num_tokens[d], H, d, c.combine_values, false);
    if (s.num_biases >= 2)
      in.bias1 =
          reference::random_bf16_tokens(s.seed * 6151 + d, s.num_tokens[d], H, d, c.combine_values, false);
  }
  const reference::NormalCombineParams combine_params{s.combine_weights ? K : 0, s.num_biases};
  e.combined = c.spans_nodes()
                   ? reference::internode_combine(e.dispatched.handle, c.ranks_per_node, combine_params,
                                                  e.combine_inputs)
                   : reference::normal_combine(e.dispatched.handle, combine_params, e.combine_inputs);
  return e;
}

// Device memory of one iteration on this rank; unused arrays stay empty (null), which is what the calls get.
struct NormalSlot {
  DeviceArray x, x_scales, topk_idx, topk_weights;                           // dispatch inputs
  DeviceArray num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank;  // layout outputs
  DeviceArray recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights;       // dispatch outputs
  DeviceArray small_x, small_x_scales, small_topk_idx, small_topk_weights;   // NormalGuess::kTooSmall
  DeviceArray combine_x, combine_weights, bias0, bias1;                      // combine inputs
  DeviceArray combined_x, combined_weights;                                  // combine outputs
  // Repeated combines (NormalCase::combine_repeats): their scaled inputs and their outputs.
  std::vector<DeviceArray> repeat_x, repeat_bias0, repeat_bias1, repeat_combined_x;
  DeviceArray cached_x, cached_x_scales, cached_recv_x, cached_recv_x_scales, cached_combined_x;
  DispatchPlan plan, cached_plan;
};

class NormalRunner {
 public:
  // Runs on `buffer`, which must hold normal_buffer_bytes(c).
  NormalRunner(const NormalCase& c, Buffer& buffer) : c_(c), rank_(buffer.rank()), buffer_(&buffer) {
    init();
  }
  // Runs on a Buffer of its own.
  NormalRunner(const NormalCase& c, Bootstrap& bootstrap) : c_(c), rank_(bootstrap.rank()) {
    BufferOptions options;
    options.num_nvl_output_bytes = normal_window_bytes(c);
    options.num_nvl_staging_bytes = c.staging_bytes;
    options.num_nvl_bytes = normal_buffer_bytes(c) + options.num_nvl_output_bytes + c.staging_bytes;
    options.num_rdma_bytes = normal_rdma_buffer_bytes(c);
    options.ranks_per_node = c.ranks_per_node;
    options.wait_timeout_s = 20.0;
    owned_buffer_ = std::make_unique<Buffer>(bootstrap, options);
    buffer_ = owned_buffer_.get();
    init();
  }
  ~NormalRunner() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  NormalRunner(const NormalRunner&) = delete;
  NormalRunner& operator=(const NormalRunner&) = delete;

  void run() {
    for (int i = 0; i < c_.num_iterations; ++i) run_step(normal_step(c_, i));
    // A host falls back to the count exchange when a peer comes late to the board (time slicing can delay a
    // peer's layout kernel), so not every step reads the board, but some must.
    if (board_steps_ > 0 && board_reads_ == 0)
      fail(rank_, c_.num_iterations,
           "no dispatch_notify read its counts off the layout board (of " + std::to_string(board_steps_) +
               " that could)");
  }

 private:
  void init() {
    if (buffer_->num_ranks() != c_.num_ranks)
      throw std::runtime_error("NormalCase: num_ranks != the group's");
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }

  [[noreturn]] void fail_at(const NormalStep& s, const std::string& what) const {
    fail(rank_, s.iteration, what + " (" + describe_step(c_, s) + ")");
  }

  // ---- Device memory ----

  NormalSlot make_slot(const NormalStep& s, const NormalExpected& e) const {
    const size_t T = s.num_tokens[rank_];
    const size_t H = c_.hidden;
    const size_t K = c_.num_topk;
    const size_t R = c_.num_ranks;
    const size_t rows = e.dispatched.ranks[rank_].num_rows;
    const size_t row_bytes = s.fp8() ? H : H * 2;
    const size_t scale_bytes = s.fp8() ? H / 128 * sizeof(float) : 0;
    const reference::NormalDispatchRankInput& in = e.inputs[rank_];
    const reference::NormalCombineRankInput& combine_in = e.combine_inputs[rank_];

    NormalSlot slot;
    slot.x = DeviceArray(T * row_bytes);
    slot.topk_idx = DeviceArray(T * K * sizeof(int64_t));
    slot.topk_weights = DeviceArray(T * K * sizeof(float));
    slot.num_tokens_per_rank = DeviceArray(R * sizeof(int));
    slot.num_tokens_per_expert = DeviceArray(size_t(c_.num_experts) * sizeof(int));
    slot.is_token_in_rank = DeviceArray(T * R);
    // A guess that fits is the outputs themselves, with room to spare; one too small is another allocation.
    const size_t room = rows + (s.guess == NormalGuess::kFits ? 7 : 0);
    const size_t small = rows > 0 ? rows - 1 : 0;
    slot.recv_x = DeviceArray(room * row_bytes);
    if (s.guess == NormalGuess::kTooSmall) {
      slot.small_x = DeviceArray(small * row_bytes);
      slot.small_x_scales = DeviceArray(small * scale_bytes);
      slot.small_topk_idx = DeviceArray(small * K * sizeof(int64_t));
      slot.small_topk_weights = DeviceArray(small * K * sizeof(float));
    }
    if (s.fp8()) {
      slot.x_scales = DeviceArray(T * scale_bytes);
      slot.recv_x_scales = DeviceArray(room * scale_bytes);
    }
    if (s.with_topk()) {
      slot.recv_topk_idx = DeviceArray(room * K * sizeof(int64_t));
      slot.recv_topk_weights = DeviceArray(room * K * sizeof(float));
    }
    // Outputs in the output window: carved from its start, each 16-byte aligned.
    size_t window_used = 0;
    const auto carve = [&](size_t bytes) {
      const size_t at = window_used;
      window_used = (at + bytes + 15) / 16 * 16;
      if (window_used > buffer_->num_nvl_output_bytes()) fail_at(s, "the output window is too small");
      return DeviceArray::view(static_cast<char*>(buffer_->nvl_output_window()) + at, bytes);
    };
    const bool window_rank = rank_ % 2 == 0 || s.odd_ranks_into_window;
    if (s.into_window && window_rank) {
      slot.recv_x = carve(room * row_bytes);
      if (s.fp8()) slot.recv_x_scales = carve(room * scale_bytes);
      if (s.with_topk()) {
        slot.recv_topk_idx = carve(room * K * sizeof(int64_t));
        slot.recv_topk_weights = carve(room * K * sizeof(float));
      }
    }
    slot.combine_x = DeviceArray(rows * H * 2);
    slot.combined_x = DeviceArray(T * H * 2);
    if (s.combine_weights) {
      slot.combine_weights = DeviceArray(rows * K * sizeof(float));
      slot.combined_weights = DeviceArray(T * K * sizeof(float));
    }
    if (s.num_biases >= 1) slot.bias0 = DeviceArray(T * H * 2);
    if (s.num_biases >= 2) slot.bias1 = DeviceArray(T * H * 2);
    for (int j = 0; j < c_.combine_repeats; ++j) {
      slot.repeat_x.emplace_back(rows * H * 2);
      slot.repeat_bias0.push_back(s.num_biases >= 1 ? DeviceArray(T * H * 2) : DeviceArray());
      slot.repeat_bias1.push_back(s.num_biases >= 2 ? DeviceArray(T * H * 2) : DeviceArray());
      slot.repeat_combined_x.emplace_back(T * H * 2);
    }
    if (s.cached) {
      slot.cached_x = DeviceArray(T * row_bytes);
      slot.cached_recv_x = DeviceArray(rows * row_bytes);
      slot.cached_combined_x = DeviceArray(T * H * 2);
      if (s.fp8()) {
        slot.cached_x_scales = DeviceArray(T * scale_bytes);
        slot.cached_recv_x_scales = DeviceArray(rows * scale_bytes);
      }
      if (s.cached_into_window && window_rank) {
        slot.cached_recv_x = carve(rows * row_bytes);
        if (s.fp8()) slot.cached_recv_x_scales = carve(rows * scale_bytes);
      }
    }
    // DeviceArray zeroes on the legacy default stream, which does not order against the non-blocking streams
    // the uploads and the library use.
    EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));

    // Uploads happen here, before any gate: a pageable upload may wait for its stream.
    if (s.fp8()) {
      slot.x.upload(in.x_fp8, stream_);
      slot.x_scales.upload(in.x_scales, stream_);
    } else {
      slot.x.upload(in.x, stream_);
    }
    slot.topk_idx.upload(e.topk_idx[rank_], stream_);
    slot.topk_weights.upload(e.topk_weights[rank_], stream_);
    slot.combine_x.upload(combine_in.x, stream_);
    slot.combine_weights.upload(combine_in.topk_weights, stream_);
    slot.bias0.upload(combine_in.bias0, stream_);
    slot.bias1.upload(combine_in.bias1, stream_);
    for (int j = 0; j < c_.combine_repeats; ++j) {
      slot.repeat_x[j].upload(scaled_bf16(combine_in.x, repeat_scale(j)), stream_);
      slot.repeat_bias0[j].upload(scaled_bf16(combine_in.bias0, repeat_scale(j)), stream_);
      slot.repeat_bias1[j].upload(scaled_bf16(combine_in.bias1, repeat_scale(j)), stream_);
      EPX_CUDA_CHECK(
          cudaMemsetAsync(slot.repeat_combined_x[j].get(), 0x7F, slot.repeat_combined_x[j].bytes(), stream_));
    }
    if (s.cached) {
      const reference::NormalDispatchRankInput& again = e.cached_inputs[rank_];
      if (s.fp8()) {
        slot.cached_x.upload(again.x_fp8, stream_);
        slot.cached_x_scales.upload(again.x_scales, stream_);
      } else {
        slot.cached_x.upload(again.x, stream_);
      }
    }
    // Outputs start as 0x7F bytes, a value no output legitimately holds (not 0, not -1), so an element the
    // library forgot to write (or zero) is caught.
    for (const DeviceArray* out :
         {&slot.num_tokens_per_rank, &slot.num_tokens_per_expert, &slot.is_token_in_rank, &slot.recv_x,
          &slot.recv_x_scales, &slot.recv_topk_idx, &slot.recv_topk_weights, &slot.combined_x,
          &slot.combined_weights, &slot.cached_recv_x, &slot.cached_recv_x_scales, &slot.cached_combined_x}) {
      if (out->bytes() > 0) EPX_CUDA_CHECK(cudaMemsetAsync(out->get(), 0x7F, out->bytes(), stream_));
    }
    return slot;
  }

  // ---- The calls ----

  StreamOrder order_for(const NormalStep& s) const {
    switch (s.order) {
      case NormalOrder::kAsyncFinish:
        return StreamOrder{stream_, nullptr, true};
      case NormalOrder::kPreviousEvent:
        return StreamOrder{stream_, last_event_.get(), true};
      case NormalOrder::kSync:
        break;
    }
    return StreamOrder{stream_, nullptr, false};
  }

  void finished(const NormalStep& s, const Event& event, const char* call) {
    const bool async = s.order != NormalOrder::kSync;
    if (event.valid() != async)
      fail_at(s, std::string(call) + (async ? " returned no event with async_finish"
                                            : " returned an event without async_finish"));
    if (s.order == NormalOrder::kAsyncFinish) event.wait_on(stream_);
    if (s.order == NormalOrder::kPreviousEvent) last_event_ = event;
  }

  DispatchInput dispatch_input(const NormalStep& s, const NormalSlot& slot, bool cached) const {
    DispatchInput in;
    in.x = cached ? slot.cached_x.get() : slot.x.get();
    in.format = s.format;
    in.x_scales = cached ? slot.cached_x_scales.get<float>() : slot.x_scales.get<float>();
    in.num_tokens = s.num_tokens[rank_];
    in.hidden = c_.hidden;
    in.num_experts = c_.num_experts;
    in.expert_alignment = s.expert_alignment;
    in.num_worst_tokens = s.num_worst_tokens;
    if (cached) return in;  // routing comes from the handle; is_token_in_rank may be null
    if (s.with_topk()) {
      in.topk_idx = slot.topk_idx.get<int64_t>();
      in.topk_weights = slot.topk_weights.get<float>();
      in.num_topk = c_.num_topk;
      // As DeepEP's callers pass it; the routes without top-k leave it out, so both count paths run.
      in.num_tokens_per_rank = slot.num_tokens_per_rank.get<int>();
    }
    in.is_token_in_rank = slot.is_token_in_rank.get<bool>();
    if (s.route_by != NormalRouteBy::kRankMap)
      in.num_tokens_per_expert = slot.num_tokens_per_expert.get<int>();
    return in;
  }

  // What the host learns from dispatch_notify, checked before the outputs (sized from the reference) are
  // written, so a wrong count can not overrun them.
  void check_plan(const NormalStep& s, const reference::NormalDispatchRankOutput& want,
                  const DispatchPlan& plan, const std::vector<int>& want_per_expert,
                  const std::string& what) const {
    const int L = c_.num_experts / c_.num_ranks;
    if (!plan.handle.valid()) fail_at(s, what + ": empty handle");
    if (plan.num_recv_rows != want.num_rows || plan.handle.num_recv_rows() != want.num_rows)
      fail_at(s, what + ": num_recv_rows " + std::to_string(plan.num_recv_rows) + " (handle " +
                     std::to_string(plan.handle.num_recv_rows()) + "), expected " +
                     std::to_string(want.num_rows));
    if (plan.handle.num_tokens() != s.num_tokens[rank_] || plan.handle.hidden() != c_.hidden)
      fail_at(s, what + ": handle num_tokens " + std::to_string(plan.handle.num_tokens()) + " / hidden " +
                     std::to_string(plan.handle.hidden()));
    if (s.num_worst_tokens > 0) {
      if (!plan.num_recv_tokens_per_expert.empty() || !plan.handle.num_recv_per_rank().empty())
        fail_at(s, what + ": per-expert and per-rank counts must be empty in worst-case mode");
      return;
    }
    if (plan.handle.num_recv_per_rank() != want.num_recv_tokens_per_rank)
      fail_at(s, what + ": the handle's rows per source rank differ from the reference");
    // Without the layout's num_tokens_per_expert there are no per-expert counts (the reference gives none).
    const size_t want_size = want_per_expert.empty() ? 0 : size_t(L);
    if (plan.num_recv_tokens_per_expert.size() != want_size)
      fail_at(s, what + ": num_recv_tokens_per_expert has " +
                     std::to_string(plan.num_recv_tokens_per_expert.size()) + " entries, expected " +
                     std::to_string(want_size));
    if (want_size == 0) return;
    for (int le = 0; le < L; ++le) {
      if (plan.num_recv_tokens_per_expert[le] != want_per_expert[le])
        fail_at(s, what + ": num_recv_tokens_per_expert[" + std::to_string(le) +
                       "] = " + std::to_string(plan.num_recv_tokens_per_expert[le]) + ", expected " +
                       std::to_string(want_per_expert[le]));
    }
  }

  void issue(const NormalStep& s, const NormalExpected& e, NormalSlot& slot) {
    const int T = s.num_tokens[rank_];
    const reference::NormalDispatchRankOutput& want = e.dispatched.ranks[rank_];

    const DispatchLayoutOutput layout{slot.num_tokens_per_rank.get<int>(),
                                      slot.num_tokens_per_expert.get<int>(),
                                      slot.is_token_in_rank.get<bool>()};
    finished(s,
             get_dispatch_layout(*buffer_, slot.topk_idx.get<int64_t>(), T, c_.num_topk, c_.num_experts,
                                 layout, order_for(s)),
             "get_dispatch_layout");

    const DispatchInput in = dispatch_input(s, slot, false);
    const DispatchOutput out{slot.recv_x.get(), slot.recv_x_scales.get<float>(),
                             slot.recv_topk_idx.get<int64_t>(), slot.recv_topk_weights.get<float>()};
    const bool topk = out.recv_topk_idx != nullptr && s.with_topk();
    DispatchOutputGuess guess;
    if (s.guess == NormalGuess::kFits) guess = {out, want.num_rows + 7};
    if (s.guess == NormalGuess::kTooSmall) {
      guess = {{slot.small_x.get(), s.fp8() ? slot.small_x_scales.get<float>() : nullptr,
                topk ? slot.small_topk_idx.get<int64_t>() : nullptr,
                topk ? slot.small_topk_weights.get<float>() : nullptr},
               std::max(want.num_rows - 1, 0)};
    }
    // Without a launched receive, odd steps ask for the handle before the receive (the exchange then runs in
    // dispatch_notify even with counts off the layout board).
    const DispatchOverlap overlap = s.launch_receive       ? DispatchOverlap::kLaunchReceive
                                    : s.iteration % 2 != 0 ? DispatchOverlap::kHandleBeforeReceive
                                                           : DispatchOverlap::kNone;
    slot.plan = dispatch_notify(*buffer_, in, order_for(s), nullptr, overlap, &guess);
    check_plan(s, want, slot.plan, want.num_recv_tokens_per_expert_list, "dispatch_notify");
    const bool one_node =
        buffer_->ranks_per_node() == buffer_->num_ranks();  // across nodes: no launched receive
    // One node, a host wait and the layout's num_tokens_per_rank: the counts may come off the layout board
    // (unless a peer came late to it); never otherwise.
    const bool from_layout = one_node && s.num_worst_tokens == 0 && s.with_topk();
    if (slot.plan.counts_from_layout && !from_layout)
      fail_at(s, "dispatch_notify: counts_from_layout is true");
    board_steps_ += from_layout ? 1 : 0;
    board_reads_ += slot.plan.counts_from_layout ? 1 : 0;
    if (slot.plan.rows_in_guess !=
        (s.guess == NormalGuess::kFits && s.num_worst_tokens == 0 && launched_receives_enabled() && one_node))
      fail_at(s, std::string("dispatch_notify: rows_in_guess is ") +
                     (slot.plan.rows_in_guess ? "true" : "false"));
    finished(s, dispatch_receive(*buffer_, slot.plan, in, out, order_for(s)), "dispatch_receive");

    const CombineInput combine_in{slot.combine_x.get(), slot.combine_weights.get<float>(),
                                  s.combine_weights ? c_.num_topk : 0, slot.bias0.get(), slot.bias1.get()};
    const CombineOutput combine_out{slot.combined_x.get(), slot.combined_weights.get<float>()};
    finished(s, combine(*buffer_, slot.plan.handle, combine_in, combine_out, order_for(s)), "combine");
    for (int j = 0; j < c_.combine_repeats; ++j) {
      const CombineInput repeat{slot.repeat_x[j].get(), nullptr, 0, slot.repeat_bias0[j].get(),
                                slot.repeat_bias1[j].get()};
      finished(s,
               combine(*buffer_, slot.plan.handle, repeat,
                       CombineOutput{slot.repeat_combined_x[j].get(), nullptr}, order_for(s)),
               "repeated combine");
    }
    if (!s.cached) return;

    const DispatchInput again = dispatch_input(s, slot, true);
    slot.cached_plan = dispatch_notify(*buffer_, again, order_for(s), &slot.plan.handle);
    check_plan(s, e.redispatched.ranks[rank_], slot.cached_plan, slot.plan.num_recv_tokens_per_expert,
               "cached dispatch_notify");
    const DispatchOutput again_out{slot.cached_recv_x.get(), slot.cached_recv_x_scales.get<float>(), nullptr,
                                   nullptr};
    finished(s, dispatch_receive(*buffer_, slot.cached_plan, again, again_out, order_for(s)),
             "cached dispatch_receive");
    // The new handle carries no top-k (the re-dispatch had none), so this combine reduces x and biases only;
    // its combined_x must equal the first combine's.
    const CombineInput plain{slot.combine_x.get(), nullptr, 0, slot.bias0.get(), slot.bias1.get()};
    finished(s,
             combine(*buffer_, slot.cached_plan.handle, plain,
                     CombineOutput{slot.cached_combined_x.get(), nullptr}, order_for(s)),
             "combine with the cached handle");
  }

  void run_step(const NormalStep& s) {
    buffer_->set_config(normal_config(c_, s.num_sms));
    const NormalExpected e = expect_normal(c_, s);
    NormalSlot slot = make_slot(s, e);
    // The ranks meet before they issue: computing the reference drifts them apart (past 250 ms at 65,536
    // tokens with ranks sharing a GPU), and a host that waits that long for a peer's layout takes the count
    // exchange instead of the layout board, which the checks below require on some steps.
    buffer_->bootstrap().barrier();
    last_event_ = Event::record(stream_);  // previous-event order: the first call starts after the uploads
    std::optional<StreamGate> gate;
    // The gate's 10 s bound is below the Buffer's 20 s device wait bound, so a call that wrongly waits is
    // reported as that, not as a peer timeout.
    if (s.gated) gate.emplace(stream_);
    issue(s, e, slot);
    // With previous events nothing waits for the caller's stream, so the last event completes while it is
    // held.
    if (s.order == NormalOrder::kPreviousEvent) last_event_.synchronize();
    if (gate) gate->release();
    buffer_->synchronize(stream_);
    if (gate && gate->timed_out())
      fail_at(s,
              "a call waited for the device or for the caller's stream although it must not (worst-case "
              "rows, a cached handle or previous_event order)");
    last_event_ = Event{};
    check(s, e, slot);
  }

  // ---- Checks ----

  template <typename T>
  void check_bits(const NormalStep& s, const std::vector<T>& got, const std::vector<T>& want, size_t count,
                  size_t row_size, const std::string& what) const {
    if (got.size() < count || want.size() < count)
      fail_at(s, what + ": " + std::to_string(std::min(got.size(), want.size())) + " elements, expected " +
                     std::to_string(count));
    for (size_t i = 0; i < count; ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
        fail_at(s, what + "[" + std::to_string(i / row_size) + "][" + std::to_string(i % row_size) +
                       "] = " + show_value(got[i]) + ", expected " + show_value(want[i]));
    }
  }

  void check_layout(const NormalStep& s, const reference::DispatchLayout& want,
                    const NormalSlot& slot) const {
    const size_t T = s.num_tokens[rank_];
    const size_t R = c_.num_ranks;
    check_bits(s, slot.num_tokens_per_rank.download<int>(R), want.num_tokens_per_rank, R, R,
               "layout num_tokens_per_rank");
    check_bits(s, slot.num_tokens_per_expert.download<int>(c_.num_experts), want.num_tokens_per_expert,
               c_.num_experts, c_.num_experts, "layout num_tokens_per_expert");
    check_bits(s, slot.is_token_in_rank.download<uint8_t>(T * R), want.is_token_in_rank, T * R, R,
               "layout is_token_in_rank");
  }

  // Real rows bit-exactly (padding rows' payload is unspecified), naming the row's expected and actual
  // source.
  void check_rows(const NormalStep& s, const reference::NormalDispatchRankOutput& want,
                  const DeviceArray& recv_x, const std::string& what) const {
    const size_t H = c_.hidden;
    const size_t row_bytes = s.fp8() ? H : H * 2;
    const size_t N = want.num_recv_tokens;
    const std::vector<uint8_t> got = recv_x.download<uint8_t>(N * row_bytes);
    const auto* want_bytes =
        s.fp8() ? want.recv_x_fp8.data() : reinterpret_cast<const uint8_t*>(want.recv_x.data());
    for (size_t row = 0; row < N; ++row) {
      if (std::memcmp(&got[row * row_bytes], want_bytes + row * row_bytes, row_bytes) == 0) continue;
      std::string message = what + " row " + std::to_string(row) +
                            " differs from the reference, which holds token " +
                            std::to_string(want.recv_src_token_idx[row]) + " of rank " +
                            std::to_string(want.recv_src_rank[row]);
      if (!s.fp8() && H >= size_t(reference::kStampChannels)) {
        uint16_t stamp[reference::kStampChannels];
        std::memcpy(stamp, &got[row * row_bytes], sizeof(stamp));
        const reference::Stamp from = reference::read_stamp(stamp, reference::kStampChannels);
        if (from.src_rank >= 0)
          message += "; the row is stamped token " + std::to_string(from.token_idx) + " of rank " +
                     std::to_string(from.src_rank);
      }
      fail_at(s, message);
    }
  }

  void check_dispatch(const NormalStep& s, const reference::NormalDispatchRankOutput& want,
                      const DispatchPlan& plan, const DeviceArray& recv_x, const DeviceArray& recv_x_scales,
                      bool with_topk, const NormalSlot& slot, const std::string& what) const {
    const size_t rows = want.num_rows;
    const size_t N = want.num_recv_tokens;
    const size_t K = c_.num_topk;
    check_rows(s, want, recv_x, what + "recv_x");
    if (s.fp8()) {
      const size_t G = c_.hidden / 128;
      check_bits(s, recv_x_scales.download<float>(N * G), want.recv_x_scales, N * G, G,
                 what + "recv_x_scales");
    }
    if (with_topk) {
      check_bits(s, slot.recv_topk_idx.download<int64_t>(rows * K), want.recv_topk_idx, rows * K, K,
                 what + "recv_topk_idx");
      check_bits(s, slot.recv_topk_weights.download<float>(rows * K), want.recv_topk_weights, rows * K, K,
                 what + "recv_topk_weights");
    }
    check_bits(s, download_device(plan.handle.recv_src_idx_device(), rows), want.recv_src_token_idx, rows, 1,
               what + "handle recv_src_idx");
  }

  void check(const NormalStep& s, const NormalExpected& e, const NormalSlot& slot) const {
    const size_t T = s.num_tokens[rank_];
    const size_t H = c_.hidden;
    const size_t K = c_.num_topk;
    check_layout(s, e.layouts[rank_], slot);
    check_dispatch(s, e.dispatched.ranks[rank_], slot.plan, slot.recv_x, slot.recv_x_scales, s.with_topk(),
                   slot, "");
    const reference::NormalCombineRankOutput& want = e.combined[rank_];
    check_bits(s, slot.combined_x.download<uint16_t>(T * H), want.combined_x, T * H, H, "combined_x");
    if (s.combine_weights)
      check_bits(s, slot.combined_weights.download<float>(T * K), want.combined_topk_weights, T * K, K,
                 "combined_topk_weights");
    for (int j = 0; j < c_.combine_repeats; ++j) {
      check_bits(s, slot.repeat_combined_x[j].download<uint16_t>(T * H),
                 scaled_bf16(want.combined_x, repeat_scale(j)), T * H, H,
                 "combined_x of repeated combine " + std::to_string(j));
    }
    if (!s.cached) return;
    check_dispatch(s, e.redispatched.ranks[rank_], slot.cached_plan, slot.cached_recv_x,
                   slot.cached_recv_x_scales, false, slot, "cached ");
    check_bits(s, slot.cached_combined_x.download<uint16_t>(T * H), want.combined_x, T * H, H,
               "combined_x with the cached handle");
  }

  NormalCase c_;
  int rank_;
  std::unique_ptr<Buffer> owned_buffer_;
  Buffer* buffer_ = nullptr;
  cudaStream_t stream_ = nullptr;
  Event last_event_;     // previous-event order: what the next call starts after
  int board_steps_ = 0;  // steps whose counts could come off the layout board
  int board_reads_ = 0;  // ... and did
};

}  // namespace epx::test
