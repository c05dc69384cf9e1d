#pragma once

// Multi-GPU harness of the low-latency tests: one process per GPU (rank = device), every process generates
// every rank's seeded inputs, runs the CPU reference for all ranks and checks its own GPU outputs against its
// own rank's reference output (data movement bit-exactly, the combine too: the kernel multiplies and adds
// with separate IEEE operations in top-k order, as the reference writes it).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/low_latency.hpp"
#include "formats/bf16.hpp"
#include "formats/fp8.hpp"
#include "gpu/cuda_check.hpp"
#include "reference/low_latency.hpp"
#include "reference/test_data.hpp"
#include "run_ranks.hpp"

namespace epx::test {

struct LowLatencyCase {
  int num_ranks = 2;
  int num_max_tokens = 16;  // M
  int hidden = 256;
  int num_experts = 8;
  int num_topk = 4;
  std::vector<int> num_tokens;  // per rank (cycled); empty = M everywhere
  // Each rank's count drawn per iteration in [0, M] instead. Not with `graph`, whose one capture holds the
  // counts (run_call's graph replays capture once per count).
  bool random_num_tokens = false;
  bool use_fp8 = false;
  bool round_scale = false;
  bool use_ue8m0 = false;
  bool use_logfmt = false;
  bool logfmt_within_node = false;  // LowLatencyCombineInput::logfmt_within_node
  // Pre-reduced combine: the dispatch carries the top-k weights, the combine passes none of its own.
  bool pre_reduce = false;
  bool dispatch_hook = false;
  bool combine_hook = false;
  bool zero_copy = false;
  bool async_finish = false;
  bool unbalanced = false;      // make_unbalanced_routing: hot, cold, empty ranks, -1 ids
  double drop_probability = 0;  // extra -1 ids
  bool duplicates = false;      // some tokens list one expert twice
  bool stats = false;           // cumulative / wait-cost statistics
  int num_iterations = 1;       // each with fresh inputs
  int batch = 1;                // iterations issued back to back before the host syncs and checks
  bool pending_pairs = false;   // with hooks: send two calls, then run both hooks
  bool graph = false;           // capture one dispatch + combine, replay it num_iterations times
  int ranks_per_node = 0;       // BufferOptions::ranks_per_node: < num_ranks runs across (virtual) nodes
  uint64_t seed = 1;
  // Rank masks: masks[i % size] are the ranks masked in iteration i (empty list: none). Before the iteration
  // every rank masks them (apply_masks) and they sit it out; the others are checked against the reference
  // with those ranks masked. Iterations run one at a time (batch 1).
  std::vector<std::vector<int>> masks;
  bool enable_shrink = false;  // BufferOptions::enable_shrink (of a Buffer the runner makes)
};

[[noreturn]] inline void fail(int rank, int iteration, const std::string& what) {
  throw std::runtime_error("rank " + std::to_string(rank) + " iteration " + std::to_string(iteration) + ": " +
                           what);
}

// A device allocation freed with its owner.
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t bytes) : bytes_(bytes) {
    void* raw = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&raw, bytes == 0 ? 16 : bytes));
    // Zeroed before any upload, which goes on a non-blocking stream not ordered after the legacy stream; a
    // device-wide sync would also wait for streams the tests deliberately hold.
    EPX_CUDA_CHECK(cudaMemsetAsync(raw, 0, bytes == 0 ? 16 : bytes, cudaStreamLegacy));
    EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    memory_ = std::shared_ptr<void>(raw, [](void* p) { cudaFree(p); });
  }
  // `bytes` at `data`, owned by someone else (e.g. a Buffer's output window).
  static DeviceArray view(void* data, size_t bytes) {
    DeviceArray array;
    array.bytes_ = bytes;
    array.memory_ = std::shared_ptr<void>(data, [](void*) {});
    return array;
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(memory_.get());
  }
  size_t bytes() const { return bytes_; }
  template <typename T>
  void upload(const std::vector<T>& host, cudaStream_t stream) const {
    if (host.empty()) return;
    EPX_CUDA_CHECK(
        cudaMemcpyAsync(get(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice, stream));
  }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    if (count > 0) EPX_CUDA_CHECK(cudaMemcpy(host.data(), get(), sizeof(T) * count, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  size_t bytes_ = 0;
  std::shared_ptr<void> memory_;
};

// Every rank's inputs of one iteration.
struct Inputs {
  std::vector<int> num_tokens;
  std::vector<std::vector<uint16_t>> x;        // [T, H] per rank
  std::vector<std::vector<int64_t>> topk_idx;  // [T, K]
  std::vector<std::vector<float>> weights;     // [T, K]
};

inline Inputs make_inputs(const LowLatencyCase& c, uint64_t seed) {
  Inputs in;
  reference::TestRng counts(seed * 6364136223846793005ull + 1);  // every rank draws the same counts
  for (int r = 0; r < c.num_ranks; ++r) {
    if (c.random_num_tokens) {
      in.num_tokens.push_back(static_cast<int>(counts.uniform_int(c.num_max_tokens + 1)));
    } else {
      in.num_tokens.push_back(c.num_tokens.empty() ? c.num_max_tokens
                                                   : c.num_tokens[r % c.num_tokens.size()]);
    }
  }
  if (c.unbalanced && c.num_ranks >= 2) {
    in.topk_idx =
        reference::make_unbalanced_routing(seed, in.num_tokens, c.num_topk, c.num_experts, c.num_ranks);
  } else {
    for (int r = 0; r < c.num_ranks; ++r) {
      reference::RoutingSpec spec;
      spec.num_tokens = in.num_tokens[r];
      spec.num_topk = c.num_topk;
      spec.num_experts = c.num_experts;
      spec.num_ranks = c.num_ranks;
      spec.drop_probability = c.drop_probability;
      in.topk_idx.push_back(reference::make_topk_idx(spec, seed * 1000 + r));
    }
  }
  for (int r = 0; r < c.num_ranks; ++r) {
    if (c.duplicates && c.num_topk >= 2) {
      // Every third token lists its first expert again in its last slot.
      for (int t = 0; t < in.num_tokens[r]; t += 3) {
        int64_t* ids = &in.topk_idx[r][size_t(t) * c.num_topk];
        if (ids[0] >= 0) ids[c.num_topk - 1] = ids[0];
      }
    }
    in.x.push_back(reference::random_bf16_tokens(seed * 7919 + r, in.num_tokens[r], c.hidden, r,
                                                 reference::TokenValues::kUniform));
    in.weights.push_back(reference::random_topk_weights(seed * 104729 + r, in.num_tokens[r], c.num_topk));
  }
  return in;
}

// Expert outputs [L, R*M, H] of every rank: seeded values in the rows each rank received, zeros elsewhere.
inline std::vector<std::vector<uint16_t>> make_expert_outputs(
    const LowLatencyCase& c, uint64_t seed,
    const std::vector<reference::LowLatencyDispatchRankOutput>& received) {
  const int num_local = c.num_experts / c.num_ranks;
  const size_t rows_per_expert = size_t(c.num_ranks) * c.num_max_tokens;
  std::vector<std::vector<uint16_t>> outputs(c.num_ranks);
  for (int d = 0; d < c.num_ranks; ++d) {
    outputs[d].assign(num_local * rows_per_expert * c.hidden, 0);
    for (int le = 0; le < num_local; ++le) {
      const int count = received[d].recv_count[le];
      if (count == 0) continue;
      // Half of the experts produce values >= 1 in some groups so LogFMT also takes its BF16 fallback.
      const auto values =
          le % 2 == 0 ? reference::TokenValues::kUniform : reference::TokenValues::kSmallIntegers;
      const std::vector<uint16_t> rows =
          reference::random_bf16_tokens(seed * 31337 + d * 4096 + le, count, c.hidden, d, values, false);
      std::memcpy(&outputs[d][le * rows_per_expert * c.hidden], rows.data(), sizeof(uint16_t) * rows.size());
    }
  }
  return outputs;
}

// Device buffers of one in-flight iteration.
struct Slot {
  DeviceArray x, topk_idx, weights;  // dispatch / combine inputs
  DeviceArray recv_x, recv_scales, recv_count, src_info, topk_pos, range, listings;  // dispatch outputs
  DeviceArray expert_x, combined;                                                    // combine input / output
  LowLatencyDispatchResult dispatch;
  LowLatencyCombineResult combine;
};

// How run_call() issues one dispatch + combine.
enum class LowLatencyIssue {
  kEager,  // both calls receive at once
  kHooks,  // both calls return a receive hook, which runs before the next step
  kGraph,  // a replay of a CUDA graph of both calls, captured once per token count of this rank
};

class LowLatencyRunner {
 public:
  // Runs on `buffer` (which must be large enough for the case).
  LowLatencyRunner(const LowLatencyCase& c, Buffer& buffer)
      : c_(c), rank_(buffer.rank()), num_local_(c.num_experts / c.num_ranks), buffer_(&buffer) {
    init();
  }
  // Runs on a Buffer of its own, sized with the size hint.
  LowLatencyRunner(const LowLatencyCase& c, Bootstrap& bootstrap)
      : c_(c), rank_(bootstrap.rank()), num_local_(c.num_experts / c.num_ranks) {
    BufferOptions options;
    options.num_rdma_bytes =
        get_low_latency_rdma_size_hint(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts);
    options.wait_timeout_s = 20.0;
    options.ranks_per_node = c.ranks_per_node;
    options.enable_shrink = c.enable_shrink;
    owned_buffer_ = std::make_unique<Buffer>(bootstrap, options);
    buffer_ = owned_buffer_.get();
    init();
  }
  ~LowLatencyRunner() {
    for (const auto& graph : graphs_) cudaGraphExecDestroy(graph.second);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  void run() {
    if (c_.graph) {
      run_graph();
    } else if (!c_.masks.empty()) {
      for (int i = 0; i < c_.num_iterations; ++i) {
        const std::vector<int>& masked = masks_of(i);
        apply_masks(masked);
        run_iteration(i, masked, !is_in(masked, rank_));
      }
    } else {
      for (int first = 0; first < c_.num_iterations; first += c_.batch) run_batch(first);
    }
    if (c_.stats) check_stats();
  }

  // Makes this rank's mask hold exactly `masked` (collective when a rank leaves the mask): masking is a mask
  // update; unmasking cleans the mask, then clean_low_latency_buffer on every rank (the unmasked rank's
  // signals are behind), then masks the rest again.
  void apply_masks(const std::vector<int>& masked) {
    bool unmasks = false;
    for (const int r : current_masked_) unmasks |= !is_in(masked, r);
    if (unmasks) {
      low_latency_clean_mask_buffer(*buffer_, order());
      clean_low_latency_buffer(*buffer_, c_.num_max_tokens, c_.hidden, c_.num_experts, order());
      current_masked_.clear();
    }
    for (const int r : masked) {
      if (!is_in(current_masked_, r)) low_latency_update_mask_buffer(*buffer_, r, true, order());
    }
    current_masked_ = masked;
    buffer_->synchronize(stream_);
  }

  // One dispatch and combine (seed of `iteration`), checked against the reference with `masked` ranks masked;
  // with take_part = false this rank only computes the reference (it sits the iteration out).
  void run_iteration(int iteration, const std::vector<int>& masked, bool take_part) {
    params_.masked_ranks = masked;
    Expected e = expect(c_.seed * 1000003 + iteration);
    if (!take_part) return;
    Slot s = make_slot();
    round_trip(s, e, iteration, c_.dispatch_hook, c_.combine_hook);
  }

  // One dispatch + combine (seed of `iteration`, every rank must make the same iterations), issued as `issue`
  // says, checked against the reference. Calls share one slot the runner keeps (no allocation per call),
  // whose outputs are poisoned before each call so that a result an earlier call left there can not pass.
  void run_call(int iteration, LowLatencyIssue issue) {
    const Expected e = expect(c_.seed * 1000003 + iteration);
    if (!call_slot_) call_slot_.emplace(make_slot());
    Slot& s = *call_slot_;
    poison_outputs(s);
    if (issue != LowLatencyIssue::kGraph) {
      const bool hooks = issue == LowLatencyIssue::kHooks;
      round_trip(s, e, iteration, hooks, hooks);
      return;
    }
    // A graph's launches hold this rank's token count (the peers' counts arrive with their messages).
    const int num_tokens = e.inputs.num_tokens[rank_];
    auto graph = graphs_.find(num_tokens);
    if (graph == graphs_.end()) graph = graphs_.emplace(num_tokens, capture(s, num_tokens)).first;
    replay(graph->second, s, e, iteration);
  }

  // Graphs run_call() has captured so far.
  int num_graphs() const { return static_cast<int>(graphs_.size()); }

  Buffer& buffer() { return *buffer_; }
  cudaStream_t stream() const { return stream_; }

 private:
  static bool is_in(const std::vector<int>& ranks, int rank) {
    return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
  }
  const std::vector<int>& masks_of(int iteration) const {
    static const std::vector<int> kNone;
    return c_.masks.empty() ? kNone : c_.masks[iteration % c_.masks.size()];
  }

  void init() {
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    params_ = reference::LowLatencyParams{};
    params_.num_ranks = c_.num_ranks;
    params_.num_experts = c_.num_experts;
    params_.hidden = c_.hidden;
    params_.num_topk = c_.num_topk;
    params_.num_max_dispatch_tokens_per_rank = c_.num_max_tokens;
    sizes_ = low_latency_dispatch_sizes(*buffer_, dispatch_input_template());
    cumulative_ = DeviceArray(sizeof(int) * num_local_);
    dispatch_wait_ = DeviceArray(sizeof(int64_t) * c_.num_ranks);
    combine_wait_ = DeviceArray(sizeof(int64_t) * c_.num_ranks);
    ref_cumulative_.assign(c_.num_ranks, std::vector<int>(num_local_, 0));
  }

  LowLatencyDispatchInput dispatch_input_template() const {
    LowLatencyDispatchInput in;
    in.num_topk = c_.num_topk;
    in.hidden = c_.hidden;
    in.num_max_dispatch_tokens_per_rank = c_.num_max_tokens;
    in.num_experts = c_.num_experts;
    in.use_fp8 = c_.use_fp8;
    in.round_scale = c_.round_scale;
    in.use_ue8m0 = c_.use_ue8m0;
    return in;
  }

  StreamOrder order() const { return StreamOrder{stream_, nullptr, c_.async_finish}; }

  Slot make_slot() const {
    Slot s;
    const size_t T = c_.num_max_tokens;
    const size_t H = c_.hidden;
    const size_t K = c_.num_topk;
    s.x = DeviceArray(T * H * 2);
    s.topk_idx = DeviceArray(T * K * sizeof(int64_t));
    s.weights = DeviceArray(T * K * sizeof(float));
    s.recv_x = DeviceArray(sizes_.recv_x_bytes);
    s.recv_scales = DeviceArray(sizes_.recv_x_scales_bytes);
    s.recv_count = DeviceArray(sizes_.recv_count_bytes);
    s.src_info = DeviceArray(sizes_.recv_src_info_bytes);
    s.topk_pos = DeviceArray(sizes_.recv_src_info_bytes);
    s.range = DeviceArray(sizes_.recv_layout_range_bytes);
    s.listings = DeviceArray(sizes_.recv_token_listings_bytes);
    s.expert_x = DeviceArray(size_t(num_local_) * sizes_.num_rows_per_expert * H * 2);
    s.combined = DeviceArray(T * H * 2);
    return s;
  }

  void upload_inputs(const Slot& s, const Inputs& in) const {
    s.x.upload(in.x[rank_], stream_);
    s.topk_idx.upload(in.topk_idx[rank_], stream_);
    s.weights.upload(in.weights[rank_], stream_);
  }

  LowLatencyDispatchResult dispatch(const Slot& s, int num_tokens, bool hook) {
    LowLatencyDispatchInput in = dispatch_input_template();
    in.x = s.x.get();
    in.topk_idx = s.topk_idx.get<int64_t>();
    in.num_tokens = num_tokens;
    in.return_recv_hook = hook;
    // A rank without tokens passes no weights (its peers' messages still carry theirs).
    if (c_.pre_reduce && num_tokens > 0) in.topk_weights = s.weights.get<float>();
    if (c_.stats) {
      in.cumulative_local_expert_recv_stats = cumulative_.get<int>();
      in.dispatch_wait_recv_cost_stats = dispatch_wait_.get<int64_t>();
    }
    LowLatencyDispatchOutput out;
    out.recv_x = s.recv_x.get();
    out.recv_x_scales = c_.use_fp8 ? s.recv_scales.get() : nullptr;
    out.recv_count = s.recv_count.get<int>();
    out.recv_src_info = s.src_info.get<int>();
    out.recv_topk_pos = s.topk_pos.get<int>();
    out.recv_layout_range = s.range.get<LowLatencyRange>();
    out.recv_token_listings = c_.pre_reduce ? s.listings.get<LowLatencyListing>() : nullptr;
    StreamOrder o = order();
    o.async_finish = c_.async_finish && !hook;
    LowLatencyDispatchResult result = low_latency_dispatch(*buffer_, in, out, o);
    if (result.event.valid()) result.event.wait_on(stream_);
    return result;
  }

  // Fills the outputs with 0xFF bytes: counts and ranges read -1, payloads and weights NaN.
  void poison_outputs(const Slot& s) const {
    for (const DeviceArray* out : {&s.recv_x, &s.recv_scales, &s.recv_count, &s.src_info, &s.topk_pos,
                                   &s.range, &s.listings, &s.combined})
      EPX_CUDA_CHECK(cudaMemsetAsync(out->get(), 0xFF, out->bytes(), stream_));
  }

  // Places the expert outputs where the combine reads them (the zero-copy buffer is shared by calls, so it
  // is filled right before its combine, in stream order).
  const void* stage_expert_outputs(const Slot& s, const LowLatencyHandle& handle,
                                   const std::vector<uint16_t>& expert_x) const {
    if (!c_.zero_copy) {
      s.expert_x.upload(expert_x, stream_);
      return s.expert_x.get();
    }
    void* rows = next_low_latency_combine_buffer(*buffer_, handle);
    EPX_CUDA_CHECK(cudaMemcpyAsync(rows, expert_x.data(), sizeof(uint16_t) * expert_x.size(),
                                   cudaMemcpyHostToDevice, stream_));
    return nullptr;
  }

  LowLatencyCombineResult combine(const Slot& s, const LowLatencyHandle& handle, const void* x, bool hook) {
    LowLatencyCombineInput in;
    in.x = x;
    in.topk_idx = s.topk_idx.get<int64_t>();
    in.topk_weights = c_.pre_reduce ? nullptr : s.weights.get<float>();  // the dispatch's are used
    in.num_tokens = handle.num_tokens;
    in.num_topk = c_.num_topk;
    in.use_logfmt = c_.use_logfmt;
    in.logfmt_within_node = c_.logfmt_within_node;
    in.pre_reduce = c_.pre_reduce;
    in.zero_copy = c_.zero_copy;
    in.return_recv_hook = hook;
    if (c_.stats) in.combine_wait_recv_cost_stats = combine_wait_.get<int64_t>();
    StreamOrder o = order();
    o.async_finish = c_.async_finish && !hook;
    LowLatencyCombineResult result = low_latency_combine(*buffer_, handle, in, s.combined.get(), o);
    if (result.event.valid()) result.event.wait_on(stream_);
    return result;
  }

  struct Expected {
    Inputs inputs;
    std::vector<reference::LowLatencyDispatchRankOutput> dispatched;
    std::vector<std::vector<uint16_t>> expert_x;
    std::vector<reference::LowLatencyCombineRankOutput> combined;
  };

  Expected expect(uint64_t seed) {
    Expected e;
    e.inputs = make_inputs(c_, seed);
    std::vector<reference::LowLatencyDispatchRankInput> dispatch_in(c_.num_ranks);
    for (int r = 0; r < c_.num_ranks; ++r)
      dispatch_in[r] = {e.inputs.num_tokens[r], e.inputs.x[r], e.inputs.topk_idx[r]};
    e.dispatched = reference::low_latency_dispatch(params_, {c_.use_fp8, c_.round_scale, c_.use_ue8m0},
                                                   dispatch_in, &ref_cumulative_);
    e.expert_x = make_expert_outputs(c_, seed, e.dispatched);
    std::vector<reference::LowLatencyCombineRankInput> combine_in(c_.num_ranks);
    for (int r = 0; r < c_.num_ranks; ++r)
      combine_in[r] = {e.inputs.num_tokens[r], e.expert_x[r], e.inputs.topk_idx[r], e.inputs.weights[r]};
    e.combined = reference::low_latency_combine(params_,
                                                {.use_logfmt = c_.use_logfmt,
                                                 .logfmt_within_node = c_.logfmt_within_node,
                                                 .ranks_per_node = c_.ranks_per_node,
                                                 .pre_reduce = c_.pre_reduce},
                                                combine_in);
    return e;
  }

  // Dispatch (receive in a hook when `dispatch_hook`), the expert outputs, combine (likewise), then the
  // check.
  void round_trip(Slot& s, const Expected& e, int iteration, bool dispatch_hook, bool combine_hook) {
    upload_inputs(s, e.inputs);
    s.dispatch = dispatch(s, e.inputs.num_tokens[rank_], dispatch_hook);
    if (s.dispatch.hook.valid()) s.dispatch.hook(stream_);
    const void* x = stage_expert_outputs(s, s.dispatch.handle, e.expert_x[rank_]);
    s.combine = combine(s, s.dispatch.handle, x, combine_hook);
    if (s.combine.hook.valid()) s.combine.hook(stream_);
    buffer_->synchronize(stream_);
    check(s, e, iteration);
  }

  // Issues `batch` iterations (dispatch, then combine) before syncing, then checks all of them.
  void run_batch(int first) {
    const int count = std::min(c_.batch, c_.num_iterations - first);
    std::vector<Expected> expected;
    std::vector<Slot> slots;
    for (int i = 0; i < count; ++i) {
      expected.push_back(expect(c_.seed * 1000003 + first + i));
      slots.push_back(make_slot());
      upload_inputs(slots[i], expected[i].inputs);
    }
    for (int i = 0; i < count; i += c_.pending_pairs ? 2 : 1) {
      const int group = c_.pending_pairs ? std::min(2, count - i) : 1;
      // Dispatch sends of the group, then their receives.
      for (int g = 0; g < group; ++g)
        slots[i + g].dispatch =
            dispatch(slots[i + g], expected[i + g].inputs.num_tokens[rank_], c_.dispatch_hook);
      for (int g = 0; g < group; ++g)
        if (slots[i + g].dispatch.hook.valid()) slots[i + g].dispatch.hook(stream_);
      for (int g = 0; g < group; ++g) {
        Slot& s = slots[i + g];
        const void* x = stage_expert_outputs(s, s.dispatch.handle, expected[i + g].expert_x[rank_]);
        // The zero-copy rows are shared by calls, but the next staging copy is stream-ordered after this
        // combine's send phase, which is where they are read.
        s.combine = combine(s, s.dispatch.handle, x, c_.combine_hook);
      }
      for (int g = 0; g < group; ++g)
        if (slots[i + g].combine.hook.valid()) slots[i + g].combine.hook(stream_);
    }
    buffer_->synchronize(stream_);
    for (int i = 0; i < count; ++i) check(slots[i], expected[i], first + i);
  }

  void run_graph() {
    // Token counts are part of the captured launches; make_inputs keeps them fixed across seeds.
    Slot s = make_slot();
    Expected first = expect(c_.seed * 1000003);
    upload_inputs(s, first.inputs);
    const cudaGraphExec_t exec = capture(s, first.inputs.num_tokens[rank_]);
    for (int i = 0; i < c_.num_iterations; ++i) {
      // A mask change between replays: the graph's kernels read the mask when they run.
      const std::vector<int>& masked = masks_of(i);
      if (!c_.masks.empty()) apply_masks(masked);
      params_.masked_ranks = masked;
      Expected e = i == 0 && masked.empty() ? std::move(first) : expect(c_.seed * 1000003 + i);
      if (is_in(masked, rank_)) continue;  // this rank sits the replay out
      replay(exec, s, e, i);
    }
    cudaGraphExecDestroy(exec);
  }

  // Captures one dispatch + combine of `num_tokens` tokens into `s` (hooks and zero copy as the case says).
  cudaGraphExec_t capture(Slot& s, int num_tokens) {
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaGraph_t graph = nullptr;
    EPX_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    s.dispatch = dispatch(s, num_tokens, c_.dispatch_hook);
    if (s.dispatch.hook.valid()) s.dispatch.hook(stream_);
    const void* x = c_.zero_copy ? nullptr : s.expert_x.get();
    s.combine = combine(s, s.dispatch.handle, x, c_.combine_hook);
    if (s.combine.hook.valid()) s.combine.hook(stream_);
    EPX_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    EPX_CUDA_CHECK(cudaGraphDestroy(graph));  // the instantiated graph does not need it
    return exec;
  }

  // Refills the captured slot with `e`'s inputs, replays the graph and checks its results.
  void replay(cudaGraphExec_t exec, const Slot& s, const Expected& e, int iteration) {
    upload_inputs(s, e.inputs);
    // The expert outputs are staged before the replay: the test knows which rows the graph's dispatch
    // will deliver (the reference), so the graph can run dispatch and combine back to back.
    if (c_.zero_copy) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(next_low_latency_combine_buffer(*buffer_, s.dispatch.handle),
                                     e.expert_x[rank_].data(), sizeof(uint16_t) * e.expert_x[rank_].size(),
                                     cudaMemcpyHostToDevice, stream_));
    } else {
      s.expert_x.upload(e.expert_x[rank_], stream_);
    }
    EPX_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    buffer_->synchronize(stream_);
    check(s, e, iteration);
  }

  void check(const Slot& s, const Expected& e, int iteration) const {
    check_dispatch(s, e, iteration);
    const int num_tokens = e.inputs.num_tokens[rank_];
    const auto combined = s.combined.download<uint16_t>(size_t(num_tokens) * c_.hidden);
    const auto& want = e.combined[rank_].combined_x;
    for (size_t i = 0; i < want.size(); ++i) {
      if (combined[i] != want[i]) {
        fail(rank_, iteration,
             "combined_x[token " + std::to_string(i / c_.hidden) + "][" + std::to_string(i % c_.hidden) +
                 "] = " + std::to_string(bf16_to_float(combined[i])) + ", expected " +
                 std::to_string(bf16_to_float(want[i])));
      }
    }
  }

  void check_dispatch(const Slot& s, const Expected& e, int iteration) const {
    const reference::LowLatencyDispatchRankOutput& want = e.dispatched[rank_];
    const int R = c_.num_ranks;
    const int H = c_.hidden;
    const size_t rows_per_expert = sizes_.num_rows_per_expert;
    const auto count = s.recv_count.download<int>(num_local_);
    const auto range = s.range.download<LowLatencyRange>(size_t(num_local_) * R);
    const auto src_info = s.src_info.download<int>(num_local_ * rows_per_expert);
    const auto topk_pos = s.topk_pos.download<int>(num_local_ * rows_per_expert);
    const auto recv_bytes = s.recv_x.download<uint8_t>(sizes_.recv_x_bytes);
    const auto scales = s.recv_scales.download<uint32_t>(sizes_.recv_x_scales_bytes / 4);
    const size_t row_bytes = size_t(H) * (c_.use_fp8 ? 1 : 2);
    for (int le = 0; le < num_local_; ++le) {
      const std::string where = "local expert " + std::to_string(le);
      if (count[le] != want.recv_count[le])
        fail(rank_, iteration,
             where + ": recv_count " + std::to_string(count[le]) + ", expected " +
                 std::to_string(want.recv_count[le]));
      for (int src = 0; src < R; ++src) {
        const LowLatencyRange& got = range[size_t(le) * R + src];
        const size_t p = size_t(le) * R + src;
        if (got.begin != want.recv_src_begin[p] || got.count != want.recv_src_count[p])
          fail(rank_, iteration,
               where + " source " + std::to_string(src) + ": range (" + std::to_string(got.begin) + ", " +
                   std::to_string(got.count) + "), expected (" + std::to_string(want.recv_src_begin[p]) +
                   ", " + std::to_string(want.recv_src_count[p]) + ")");
        for (int row = got.begin; row < got.begin + got.count; ++row) {
          const size_t flat = le * rows_per_expert + row;
          const std::string at = where + " row " + std::to_string(row);
          if (want.recv_src_rank[flat] != src || src_info[flat] != want.recv_src_token_idx[flat])
            fail(rank_, iteration,
                 at + ": source token " + std::to_string(src_info[flat]) + " from rank " +
                     std::to_string(src) + ", expected " + std::to_string(want.recv_src_token_idx[flat]) +
                     " from rank " + std::to_string(want.recv_src_rank[flat]));
          check_topk_pos(e, src, src_info[flat], topk_pos[flat], le, iteration, at);
          const void* want_row = c_.use_fp8 ? static_cast<const void*>(&want.recv_x_fp8[flat * H])
                                            : static_cast<const void*>(&want.recv_x[flat * H]);
          if (std::memcmp(&recv_bytes[flat * row_bytes], want_row, row_bytes) != 0)
            fail(rank_, iteration, at + ": payload differs from the reference");
          if (c_.use_fp8) check_scales(scales, want, le, row, iteration, at);
        }
      }
    }
  }

  void check_topk_pos(const Expected& e, int src, int token, int pos, int le, int iteration,
                      const std::string& at) const {
    const int64_t expert = int64_t(rank_) * num_local_ + le;
    const int64_t* ids = &e.inputs.topk_idx[src][size_t(token) * c_.num_topk];
    int first = -1;
    for (int k = 0; k < c_.num_topk && first < 0; ++k)
      if (ids[k] == expert) first = k;
    if (pos != first)
      fail(rank_, iteration,
           at + ": topk position " + std::to_string(pos) + ", expected " + std::to_string(first));
  }

  void check_scales(const std::vector<uint32_t>& scales, const reference::LowLatencyDispatchRankOutput& want,
                    int le, int row, int iteration, const std::string& at) const {
    const int num_rows = sizes_.num_rows_per_expert;
    const int num_columns = sizes_.num_scale_columns;
    for (int col = 0; col < num_columns; ++col) {
      const size_t i = ll_scale_index(le, row, col, num_rows, num_columns);
      uint32_t expected = 0;
      if (c_.use_ue8m0) {
        expected = want.recv_x_scales_ue8m0[i];
      } else {
        std::memcpy(&expected, &want.recv_x_scales[i], 4);
      }
      if (scales[i] != expected)
        fail(rank_, iteration,
             at + ": scale column " + std::to_string(col) + " bits " + std::to_string(scales[i]) +
                 ", expected " + std::to_string(expected));
    }
  }

  void check_stats() const {
    const auto cumulative = cumulative_.download<int>(num_local_);
    for (int le = 0; le < num_local_; ++le) {
      if (cumulative[le] != ref_cumulative_[rank_][le])
        fail(rank_, -1,
             "cumulative_local_expert_recv_stats[" + std::to_string(le) + "] = " +
                 std::to_string(cumulative[le]) + ", expected " + std::to_string(ref_cumulative_[rank_][le]));
    }
    for (const DeviceArray* waits : {&dispatch_wait_, &combine_wait_}) {
      const auto ns = waits->download<int64_t>(c_.num_ranks);
      for (int r = 0; r < c_.num_ranks; ++r)
        if (ns[r] < 0) fail(rank_, -1, "negative wait cost for source " + std::to_string(r));
    }
  }

  LowLatencyCase c_;
  int rank_;
  int num_local_;
  std::unique_ptr<Buffer> owned_buffer_;
  Buffer* buffer_ = nullptr;
  cudaStream_t stream_ = nullptr;
  reference::LowLatencyParams params_;
  LowLatencyDispatchSizes sizes_;
  DeviceArray cumulative_, dispatch_wait_, combine_wait_;
  std::vector<std::vector<int>> ref_cumulative_;
  std::vector<int> current_masked_;        // what apply_masks last left in this rank's mask
  std::optional<Slot> call_slot_;          // run_call's
  std::map<int, cudaGraphExec_t> graphs_;  // run_call's, by this rank's token count
};

// A small case of `num_ranks` ranks (24 tokens, hidden 512, 8 experts per rank, top-4) for tests to adjust.
inline LowLatencyCase small_low_latency_case(int num_ranks) {
  LowLatencyCase c;
  c.num_ranks = num_ranks;
  c.num_max_tokens = 24;
  c.hidden = 512;
  c.num_experts = 8 * num_ranks;
  c.num_topk = 4;
  return c;
}

// Runs `c` with one process per GPU (ranks may share one: EPX_TEST_RANKS_PER_GPU); skips without enough.
inline void run_low_latency_case(const LowLatencyCase& c) {
  run_ranks(c.num_ranks, [&](Bootstrap& bootstrap) { LowLatencyRunner(c, bootstrap).run(); });
}

// `run(c)` with the default combine, then with the pre-reduced one.
template <typename Run>
void run_with_both_combine_orders(LowLatencyCase c, Run run) {
  for (const bool pre_reduce : {false, true}) {
    c.pre_reduce = pre_reduce;
    SCOPED_TRACE(pre_reduce ? "pre-reduced combine" : "default combine");
    run(c);
  }
}

}  // namespace epx::test
