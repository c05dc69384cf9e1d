// The fault matrix (docs/RELIABILITY.md, section 4): with a short wait bound, one rank skips one call; every
// other rank must get an epx::Error naming the missing peer and the phase within the bound + 1 s, nobody
// hangs, every CUDA context survives, and after a collective reset() (or destroy() and a new Buffer) a
// correct dispatch and combine, checked against the CPU reference, run in both modes.
//
// A rank may also exit (its process ends without destroy()) before a phase, or leave destroy() to the others.
//
// Runs with any number of ranks the machine can start; on one GPU: EPX_TEST_RANKS_PER_GPU=2 (or 4).

#include <gtest/gtest.h>

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/shm_bootstrap.hpp"
#include "bootstrap/shm_segment.hpp"
#include "epx/error.hpp"
#include "epx/local_launcher.hpp"
#include "epx/low_latency.hpp"
#include "epx/normal.hpp"
#include "expect_error.hpp"
#include "run_ranks.hpp"
#include "test_low_latency_harness.hpp"
#include "test_normal_harness.hpp"

namespace {

using epx::test::DeviceArray;
using epx::test::expect_error;

constexpr double kWaitTimeoutS = 1.0;

// Ranks of a fault test: up to 4, at least 2 (run_ranks skips where the machine cannot start them).
int fault_test_ranks() {
  return std::min(4, std::max(2, epx::test::test_rank_capacity()));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

enum class Fault { kNotify, kDispatchReceive, kCombine, kLowLatencyDispatch, kLowLatencyCombine, kClean };

const char* fault_name(Fault fault) {
  switch (fault) {
    case Fault::kNotify:
      return "notify";
    case Fault::kDispatchReceive:
      return "dispatch receive";
    case Fault::kCombine:
      return "combine";
    case Fault::kLowLatencyDispatch:
      return "low-latency dispatch";
    case Fault::kLowLatencyCombine:
      return "low-latency combine";
    case Fault::kClean:
      return "clean";
  }
  return "?";
}

// The phase the waiting ranks report: the kernel phase they wait in when `fault` skips a call.
std::vector<std::string> expected_phases(Fault fault) {
  switch (fault) {
    case Fault::kNotify:
      return {"in dispatch notify"};
    case Fault::kClean:
      return {"in barrier"};
    case Fault::kDispatchReceive:
      // Within one node the count exchange runs in the receive's launch when the counts came off the layout
      // board: the others then wait for the skipped rank's counts.
      return {"in dispatch receive", "in dispatch send", "in dispatch notify"};
    case Fault::kCombine:
      return {"in combine reduce", "in combine send"};
    case Fault::kLowLatencyDispatch:
      return {"in low-latency dispatch receive"};
    case Fault::kLowLatencyCombine:
      return {"in low-latency combine receive"};
  }
  return {};
}

// `ranks_per_node`: 0 for one node, else normal mode runs across (virtual) nodes of that many ranks.
epx::test::NormalCase normal_case(int num_ranks, int ranks_per_node = 0) {
  epx::test::NormalCase c;
  c.num_ranks = num_ranks;
  c.ranks_per_node = ranks_per_node;
  c.hidden = 256;
  c.num_experts = 4 * num_ranks;
  c.num_topk = 2;
  c.num_tokens = {48};
  return c;
}

epx::test::LowLatencyCase low_latency_case(int num_ranks, int ranks_per_node = 0) {
  epx::test::LowLatencyCase c;
  c.num_ranks = num_ranks;
  c.ranks_per_node = ranks_per_node;
  c.num_max_tokens = 16;
  c.hidden = 256;
  c.num_experts = 4 * num_ranks;
  c.num_topk = 2;
  return c;
}

// Buffer options with the short bound. EPX_WAIT_TIMEOUT_S overrides BufferOptions::wait_timeout_s (and the
// GPU scripts set it): each rank process (forked by the launcher) sets it to the test's bound.
epx::BufferOptions fault_buffer_options(int num_ranks, int ranks_per_node = 0) {
  setenv("EPX_WAIT_TIMEOUT_S", std::to_string(kWaitTimeoutS).c_str(), 1);
  const epx::test::LowLatencyCase ll = low_latency_case(num_ranks);
  const epx::test::NormalCase normal = normal_case(num_ranks, ranks_per_node);
  epx::BufferOptions options;
  options.num_nvl_bytes = epx::test::normal_buffer_bytes(normal);
  options.num_rdma_bytes =
      std::max(epx::test::normal_rdma_buffer_bytes(normal),
               epx::get_low_latency_rdma_size_hint(ll.num_max_tokens, ll.hidden, num_ranks, ll.num_experts));
  options.ranks_per_node = ranks_per_node;
  options.wait_timeout_s = kWaitTimeoutS;
  return options;
}

// The node split of `buffer` as the cases take it: 0 when it is one node.
int ranks_per_node_of(const epx::Buffer& buffer) {
  return buffer.ranks_per_node() < buffer.num_ranks() ? buffer.ranks_per_node() : 0;
}

// Correct calls of both modes on `buffer`, checked bit-exactly against the reference.
void run_checked_calls(const epx::test::NormalCase& normal, const epx::test::LowLatencyCase& low_latency,
                       epx::Buffer& buffer) {
  epx::test::NormalRunner(normal, buffer).run();
  // Across nodes the two modes share the symmetric buffer: low latency after normal mode needs a clean.
  if (normal.spans_nodes()) {
    epx::clean_low_latency_buffer(buffer, low_latency.num_max_tokens, low_latency.hidden,
                                  low_latency.num_experts, epx::StreamOrder{});
  }
  epx::test::LowLatencyRunner(low_latency, buffer).run();
}

// Inputs of the raw calls a fault interrupts: T tokens, token t to experts t % E and (t + 1) % E, so every
// rank receives rows from every rank.
class FaultCalls {
 public:
  FaultCalls(epx::Buffer& buffer, int num_ranks)
      : buffer_(buffer),
        normal_(normal_case(num_ranks, ranks_per_node_of(buffer))),
        ll_(low_latency_case(num_ranks, ranks_per_node_of(buffer))) {
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    const int T = normal_.num_tokens[0];
    const int K = normal_.num_topk;
    std::vector<int64_t> ids(size_t(T) * K);
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) ids[size_t(t) * K + k] = (t + k) % normal_.num_experts;
    x_ = DeviceArray(size_t(T) * normal_.hidden * 2);
    topk_idx_ = DeviceArray(ids.size() * sizeof(int64_t));
    topk_idx_.upload(ids, stream_);
    weights_ = DeviceArray(ids.size() * sizeof(float));
    weights_.upload(std::vector<float>(ids.size(), 0.5f), stream_);
    per_rank_ = DeviceArray(num_ranks * sizeof(int));
    per_expert_ = DeviceArray(normal_.num_experts * sizeof(int));
    in_rank_ = DeviceArray(size_t(T) * num_ranks);
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  ~FaultCalls() { cudaStreamDestroy(stream_); }
  FaultCalls(const FaultCalls&) = delete;
  FaultCalls& operator=(const FaultCalls&) = delete;

  // Hidden size of this rank's normal-mode tokens (the shape check's tests change it on one rank).
  void set_hidden(int hidden) { normal_.hidden = hidden; }
  void set_low_latency_hidden(int hidden) { ll_.hidden = hidden; }
  // Channels of this rank's normal-mode combine (0: the dispatch's), e.g. another value on one rank.
  void set_combine_hidden(int hidden) { combine_hidden_ = hidden; }
  // > 0: after the combine, a cached re-dispatch with the handle, of rows this wide (x's stride).
  void set_cached_hidden(int hidden) { cached_hidden_ = hidden; }
  // > 0: normal-mode dispatch in worst-case mode (no host wait) with outputs of this many rows.
  void set_num_worst_tokens(int rows) { num_worst_tokens_ = rows; }
  // Non-zero: the num_tokens_per_rank this rank passes says `delta` tokens more for the last rank than the
  // layout counted (is_token_in_rank keeps the truth).
  void set_last_rank_count_error(int delta) { last_rank_count_error_ = delta; }
  // false: this rank's dispatch leaves num_tokens_per_rank out.
  void set_pass_rank_totals(bool pass) { pass_rank_totals_ = pass; }
  // After the layout its dispatch uses, this rank runs another one into other arrays, so the layout board
  // holds counts its dispatch does not send: of its tokens routed nowhere, or to the first local expert of
  // each rank they go to (the same rows per rank, other rows per expert).
  enum class LayoutAfter { kNone, kNowhere, kFirstExpertOfEachRank };
  void set_layout_after(LayoutAfter layout_after) { layout_after_ = layout_after; }
  // true: after its layout this rank takes one token off the last rank in both is_token_in_rank and
  // num_tokens_per_rank (in place: they agree, but not with what the layout posted to the layout board).
  void set_drop_last_rank_token(bool drop) { drop_last_rank_token_ = drop; }
  // Whether the last dispatch_notify read its counts off the layout board.
  bool counts_from_layout() const { return counts_from_layout_; }
  // true: the receive is launched with the count exchange, into outputs with room for every row (a guess),
  // so the exchange runs inside the receive's launch.
  void set_receive_into_guess(bool guess) { receive_into_guess_ = guess; }

  // The normal-mode calls up to `fault`; this rank skips the call of `fault` when `skip`.
  void normal(Fault fault, bool skip) {
    const epx::StreamOrder order{stream_, nullptr, false};
    epx::get_dispatch_layout(buffer_, topk_idx_.get<int64_t>(), normal_.num_tokens[0], normal_.num_topk,
                             normal_.num_experts,
                             {per_rank_.get<int>(), per_expert_.get<int>(), in_rank_.get<bool>()}, order);
    if (layout_after_ != LayoutAfter::kNone) {
      const size_t cells = size_t(normal_.num_tokens[0]) * normal_.num_topk;
      DeviceArray other(cells * sizeof(int64_t)), per_rank(buffer_.num_ranks() * sizeof(int)),
          per_expert(normal_.num_experts * sizeof(int)),
          in_rank(size_t(normal_.num_tokens[0]) * buffer_.num_ranks());
      std::vector<int64_t> ids = topk_idx_.download<int64_t>(cells);
      const int experts_per_rank = normal_.num_experts / buffer_.num_ranks();
      for (int64_t& id : ids)
        id = layout_after_ == LayoutAfter::kNowhere ? -1 : id / experts_per_rank * experts_per_rank;
      other.upload(ids, stream_);
      epx::get_dispatch_layout(buffer_, other.get<int64_t>(), normal_.num_tokens[0], normal_.num_topk,
                               normal_.num_experts,
                               {per_rank.get<int>(), per_expert.get<int>(), in_rank.get<bool>()}, order);
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    if (last_rank_count_error_ != 0) {
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::vector<int> per_rank = per_rank_.download<int>(buffer_.num_ranks());
      per_rank.back() += last_rank_count_error_;
      per_rank_.upload(per_rank, stream_);
    }
    if (drop_last_rank_token_) {
      const int R = buffer_.num_ranks();
      const size_t cells = size_t(normal_.num_tokens[0]) * R;
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::vector<uint8_t> in_rank = in_rank_.download<uint8_t>(cells);
      std::vector<int> per_rank = per_rank_.download<int>(R);
      for (size_t cell = R - 1; cell < cells; cell += R) {
        if (in_rank[cell] == 0) continue;
        in_rank[cell] = 0;
        per_rank[R - 1] -= 1;
        break;
      }
      in_rank_.upload(in_rank, stream_);
      per_rank_.upload(per_rank, stream_);
    }
    if (skip && fault == Fault::kNotify) return;
    epx::DispatchInput in;
    in.x = x_.get();
    in.num_tokens = normal_.num_tokens[0];
    in.hidden = normal_.hidden;
    in.topk_idx = topk_idx_.get<int64_t>();
    in.topk_weights = weights_.get<float>();
    in.num_topk = normal_.num_topk;
    in.num_experts = normal_.num_experts;
    in.is_token_in_rank = in_rank_.get<bool>();
    in.num_tokens_per_expert = per_expert_.get<int>();
    in.num_tokens_per_rank = pass_rank_totals_ ? per_rank_.get<int>() : nullptr;
    in.num_worst_tokens = num_worst_tokens_;
    const auto allocate_outputs = [&](size_t rows) {
      recv_x_ = DeviceArray(rows * normal_.hidden * 2);
      recv_idx_ = DeviceArray(rows * normal_.num_topk * sizeof(int64_t));
      recv_weights_ = DeviceArray(rows * normal_.num_topk * sizeof(float));
    };
    epx::DispatchOutputGuess guess;
    if (receive_into_guess_) {
      const int room = in.num_tokens * buffer_.num_ranks();
      allocate_outputs(room);
      guess = {{recv_x_.get(), nullptr, recv_idx_.get<int64_t>(), recv_weights_.get<float>()}, room};
    }
    const epx::DispatchPlan plan = epx::dispatch_notify(
        buffer_, in, order, nullptr,
        receive_into_guess_ ? epx::DispatchOverlap::kLaunchReceive : epx::DispatchOverlap::kNone, &guess);
    counts_from_layout_ = plan.counts_from_layout;
    if (!plan.rows_in_guess) allocate_outputs(plan.num_recv_rows);
    if (skip && fault == Fault::kDispatchReceive) return;
    epx::dispatch_receive(buffer_, plan, in,
                          {recv_x_.get(), nullptr, recv_idx_.get<int64_t>(), recv_weights_.get<float>()},
                          order);
    buffer_.synchronize(stream_);
    if (skip && fault == Fault::kCombine) return;
    combined_ = DeviceArray(size_t(in.num_tokens) * normal_.hidden * 2);
    epx::CombineInput combine_in;
    combine_in.x = recv_x_.get();
    combine_in.hidden = combine_hidden_;  // <= the dispatch's: x's rows are recv_x's, read with this stride
    epx::combine(buffer_, plan.handle, combine_in, {combined_.get(), nullptr}, order);
    buffer_.synchronize(stream_);
    if (cached_hidden_ == 0) return;
    epx::DispatchInput cached_in = in;
    cached_in.hidden = cached_hidden_;  // <= the dispatch's: x and recv_x have room
    const epx::DispatchPlan cached = epx::dispatch_notify(buffer_, cached_in, order, &plan.handle);
    epx::dispatch_receive(buffer_, cached, cached_in,
                          {recv_x_.get(), nullptr, recv_idx_.get<int64_t>(), recv_weights_.get<float>()},
                          order);
    buffer_.synchronize(stream_);
  }

  // The low-latency calls up to `fault` (with a clean first); this rank skips the call of `fault` when
  // `skip`.
  void low_latency(Fault fault, bool skip) {
    const epx::StreamOrder order{stream_, nullptr, false};
    if (!(skip && fault == Fault::kClean))
      epx::clean_low_latency_buffer(buffer_, ll_.num_max_tokens, ll_.hidden, ll_.num_experts, order);
    buffer_.synchronize(stream_);
    if (fault == Fault::kClean) return;
    if (skip && fault == Fault::kLowLatencyDispatch) return;
    const epx::LowLatencyDispatchResult dispatched = low_latency_dispatch(false);
    buffer_.synchronize(stream_);
    if (skip && fault == Fault::kLowLatencyCombine) return;
    ll_out_ = DeviceArray(size_t(ll_.num_max_tokens) * ll_.hidden * 2);
    epx::LowLatencyCombineInput combine_in;
    combine_in.x = ll_recv_x_.get();
    combine_in.topk_idx = topk_idx_.get<int64_t>();
    combine_in.topk_weights = weights_.get<float>();
    combine_in.num_tokens = ll_.num_max_tokens;
    combine_in.num_topk = ll_.num_topk;
    epx::low_latency_combine(buffer_, dispatched.handle, combine_in, ll_out_.get(), order);
    buffer_.synchronize(stream_);
  }

  // A low-latency dispatch of this rank's tokens (the receive deferred to the returned hook when
  // `return_recv_hook`; with `async_finish`, an event to wait on), into outputs every call shares.
  epx::LowLatencyDispatchResult low_latency_dispatch(bool return_recv_hook, bool async_finish = false) {
    epx::LowLatencyDispatchInput in;
    in.x = x_.get();
    in.topk_idx = topk_idx_.get<int64_t>();
    in.num_tokens = ll_.num_max_tokens;
    in.num_topk = ll_.num_topk;
    in.hidden = ll_.hidden;
    in.num_max_dispatch_tokens_per_rank = ll_.num_max_tokens;
    in.num_experts = ll_.num_experts;
    in.use_fp8 = false;
    in.return_recv_hook = return_recv_hook;
    if (ll_recv_x_.bytes() == 0) {
      const epx::LowLatencyDispatchSizes sizes = epx::low_latency_dispatch_sizes(buffer_, in);
      ll_recv_x_ = DeviceArray(sizes.recv_x_bytes);
      ll_count_ = DeviceArray(sizes.recv_count_bytes);
      ll_info_ = DeviceArray(sizes.recv_src_info_bytes);
      ll_pos_ = DeviceArray(sizes.recv_src_info_bytes);
      ll_range_ = DeviceArray(sizes.recv_layout_range_bytes);
    }
    return epx::low_latency_dispatch(buffer_, in,
                                     {ll_recv_x_.get(), nullptr, ll_count_.get<int>(), ll_info_.get<int>(),
                                      ll_pos_.get<int>(), ll_range_.get<epx::LowLatencyRange>()},
                                     {stream_, nullptr, async_finish});
  }

  cudaStream_t stream() const { return stream_; }

  void run(Fault fault, bool skip) {
    const bool is_normal =
        fault == Fault::kNotify || fault == Fault::kDispatchReceive || fault == Fault::kCombine;
    if (is_normal) {
      normal(fault, skip);
    } else {
      low_latency(fault, skip);
    }
  }

 private:
  epx::Buffer& buffer_;
  epx::test::NormalCase normal_;
  epx::test::LowLatencyCase ll_;
  cudaStream_t stream_ = nullptr;
  int num_worst_tokens_ = 0;
  int last_rank_count_error_ = 0;
  int combine_hidden_ = 0;
  int cached_hidden_ = 0;
  bool pass_rank_totals_ = true;
  bool receive_into_guess_ = false;
  LayoutAfter layout_after_ = LayoutAfter::kNone;
  bool drop_last_rank_token_ = false;
  bool counts_from_layout_ = false;
  DeviceArray x_, topk_idx_, weights_, per_rank_, per_expert_, in_rank_;
  DeviceArray recv_x_, recv_idx_, recv_weights_, combined_;
  DeviceArray ll_recv_x_, ll_count_, ll_info_, ll_pos_, ll_range_, ll_out_;
};

// The CUDA context still works: allocate, write, synchronize.
void expect_context_alive(int rank) {
  void* memory = nullptr;
  const cudaError_t status = cudaMalloc(&memory, 1 << 20);
  if (status != cudaSuccess)
    throw std::runtime_error("rank " + std::to_string(rank) + ": cudaMalloc after the fault failed");
  EPX_CUDA_CHECK(cudaMemset(memory, 1, 1 << 20));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  EPX_CUDA_CHECK(cudaFree(memory));
}

bool contains_any(const std::string& text, const std::vector<std::string>& needles) {
  for (const std::string& needle : needles)
    if (text.find(needle) != std::string::npos) return true;
  return false;
}

// What a rank that waited for the victim must see after `fault`: an error naming the victim and the phase
// within the bound + 1 s, the same error again from check_timeout() and check(), and an aborted Buffer.
void expect_victim_named(const std::string& where, const std::string& error, double seconds, int victim,
                         Fault fault, const epx::Buffer& buffer) {
  if (error.empty())
    throw std::runtime_error(where + ": no error although peer " + std::to_string(victim) +
                             " did not make the call");
  if (error.find("peer " + std::to_string(victim)) == std::string::npos ||
      !contains_any(error, expected_phases(fault)))
    throw std::runtime_error(where + ": the error names neither the peer nor the phase: " + error);
  if (seconds > kWaitTimeoutS + 1.0)
    throw std::runtime_error(where + ": the error took " + std::to_string(seconds) + " s: " + error);
  expect_error([&] { buffer.check_timeout(); }, error);
  expect_error([&] { buffer.check(); }, error);
  if (!buffer.is_aborted()) throw std::runtime_error(where + ": the Buffer is not aborted");
}

// Across nodes the abort word reaches only a node's ranks, and a rank on another node may wait for the
// victim through a rank of its own node or a rail peer, which it then names: every rank must report within
// the bound + 1 s, naming some peer and the phase, and the victim's own node and its rail peers name it.
void expect_error_across_nodes(const std::string& where, const std::string& error, double seconds, int rank,
                               int victim, int ranks_per_node, Fault fault, const epx::Buffer& buffer) {
  const bool near_victim =
      rank / ranks_per_node == victim / ranks_per_node || rank % ranks_per_node == victim % ranks_per_node;
  if (near_victim) return expect_victim_named(where, error, seconds, victim, fault, buffer);
  if (error.find("peer ") == std::string::npos || !contains_any(error, expected_phases(fault)))
    throw std::runtime_error(where + ": the error names neither a peer nor the phase: " + error);
  if (seconds > kWaitTimeoutS + 1.0)
    throw std::runtime_error(where + ": the error took " + std::to_string(seconds) + " s: " + error);
  if (!buffer.is_aborted()) throw std::runtime_error(where + ": the Buffer is not aborted");
}

// One rank (the last) skips the call of `fault`; the others must see the error, then everybody recovers.
// `ranks_per_node` > 0: normal mode across (virtual) nodes of that many ranks.
void run_fault(epx::Bootstrap& bootstrap, Fault fault, bool rebuild, int ranks_per_node = 0) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  const int victim = num_ranks - 1;
  const bool skip = rank == victim;
  const epx::test::NormalCase normal = normal_case(num_ranks, ranks_per_node);
  const epx::test::LowLatencyCase low_latency = low_latency_case(num_ranks, ranks_per_node);
  auto buffer = std::make_unique<epx::Buffer>(bootstrap, fault_buffer_options(num_ranks, ranks_per_node));
  // A good round trip in both modes first: the fault hits a Buffer in use.
  run_checked_calls(normal, low_latency, *buffer);

  std::string error;
  const auto start = std::chrono::steady_clock::now();
  {
    FaultCalls calls(*buffer, num_ranks);
    try {
      calls.run(fault, skip);
    } catch (const epx::Error& caught) {
      error = caught.message();
    }
  }
  const double seconds = seconds_since(start);
  const std::string where = std::string("rank ") + std::to_string(rank) + ", fault " + fault_name(fault);
  if (skip) {
    if (!error.empty()) throw std::runtime_error(where + ": the skipping rank got an error: " + error);
  } else if (normal.spans_nodes()) {
    expect_error_across_nodes(where, error, seconds, rank, victim, ranks_per_node, fault, *buffer);
  } else {
    expect_victim_named(where, error, seconds, victim, fault, *buffer);
  }
  bootstrap.barrier();  // every waiting rank saw its error: the victim's abort word is set
  // (Across nodes only by the ranks of its node: a victim alone on its node is not told.)
  const bool victim_told = !normal.spans_nodes() || ranks_per_node > 1;
  if (skip && victim_told) expect_error([&] { buffer->check(); }, "the group was aborted");
  expect_context_alive(rank);
  // Every call on an aborted Buffer is refused.
  if (!skip || victim_told)
    expect_error([&] { FaultCalls(*buffer, num_ranks).run(fault, false); }, skip ? "aborted" : error);

  if (rebuild) {
    buffer->destroy();
    buffer = std::make_unique<epx::Buffer>(bootstrap, fault_buffer_options(num_ranks, ranks_per_node));
  } else {
    buffer->reset();
    if (buffer->is_aborted()) throw std::runtime_error(where + ": still aborted after reset()");
  }
  run_checked_calls(normal, low_latency, *buffer);
  // The interrupted sequence itself runs again, with every rank.
  FaultCalls(*buffer, num_ranks).run(fault, false);
  buffer->destroy();
}

// One rank dispatches tokens of another hidden size (normal mode, or low latency): every rank's dispatch
// must raise the shape check's error (no timeout: the fingerprints travel with the counts and the flags),
// then reset() and checked calls.
// Where the last rank's shapes differ from the others'.
enum class MismatchAt {
  kNormalNotify,
  kNormalCombine,
  kNormalCachedDispatch,
  kNormalWindowOnSomeRanks,  // every rank's Buffer but the last has an output window
  kRankTotalsLeftOut,
  kLowLatency
};

// `ranks_per_node` > 0: normal mode across (virtual) nodes of that many ranks.
void run_shape_mismatch(epx::Bootstrap& bootstrap, MismatchAt at, int ranks_per_node = 0) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  const epx::test::NormalCase normal = normal_case(num_ranks, ranks_per_node);
  const epx::test::LowLatencyCase low_latency = low_latency_case(num_ranks, ranks_per_node);
  const bool window_on_some = at == MismatchAt::kNormalWindowOnSomeRanks;
  epx::BufferOptions options = fault_buffer_options(num_ranks, ranks_per_node);
  // Every rank's NVLink buffer has the same size (checked when the Buffer is made); the last one's tail is
  // not a window.
  if (window_on_some) options.num_nvl_bytes += 1 << 20;
  if (window_on_some && rank != num_ranks - 1) options.num_nvl_output_bytes = 1 << 20;
  epx::Buffer buffer(bootstrap, options);
  // Buffers that differ that way fail every dispatch: no checked calls before or after.
  if (!window_on_some) run_checked_calls(normal, low_latency, buffer);
  const auto start = std::chrono::steady_clock::now();
  {
    FaultCalls calls(buffer, num_ranks);
    // Every rank re-dispatches; the last one with rows of another width.
    if (at == MismatchAt::kNormalCachedDispatch) calls.set_cached_hidden(256);
    if (rank == num_ranks - 1) {
      if (at == MismatchAt::kNormalNotify) calls.set_hidden(128);
      if (at == MismatchAt::kNormalCombine) calls.set_combine_hidden(128);  // the dispatch agrees
      if (at == MismatchAt::kNormalCachedDispatch) calls.set_cached_hidden(128);
      if (at == MismatchAt::kRankTotalsLeftOut) calls.set_pass_rank_totals(false);
      if (at == MismatchAt::kLowLatency) calls.set_low_latency_hidden(128);
    }
    std::string error;
    try {
      calls.run(at == MismatchAt::kLowLatency ? Fault::kLowLatencyCombine : Fault::kCombine, false);
    } catch (const epx::Error& caught) {
      error = caught.message();
    }
    // Each rank finds the mismatch itself, or (with more ranks) is released by one that did first.
    if (!contains_any(error, {"called with hidden = ", "called with format", "called with other shapes"}))
      throw std::runtime_error("rank " + std::to_string(rank) + ": no shape error, got: '" + error + "'");
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (seconds > kWaitTimeoutS)
    throw std::runtime_error("rank " + std::to_string(rank) + ": the shape check took " +
                             std::to_string(seconds) + " s (it must not wait for a timeout)");
  expect_context_alive(rank);
  if (window_on_some) return;
  buffer.reset();
  run_checked_calls(normal, low_latency, buffer);
}

// Every rank runs the normal calls with `configure(calls, rank, num_ranks)` applied; each must fail with an
// error containing want(rank, num_ranks), its CUDA context must work, and after reset() checked calls pass.
template <typename Configure, typename Want>
void run_expecting_group_error(epx::Bootstrap& bootstrap, Configure configure, Want want_of) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  epx::Buffer buffer(bootstrap, fault_buffer_options(num_ranks));
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), buffer);
  std::string error;
  {
    FaultCalls calls(buffer, num_ranks);
    configure(calls, rank, num_ranks);
    try {
      calls.run(Fault::kCombine, false);
    } catch (const epx::Error& caught) {
      error = caught.message();
    }
  }
  const std::string want = want_of(rank, num_ranks);
  if (error.find(want) == std::string::npos)
    throw std::runtime_error("rank " + std::to_string(rank) + ": expected '" + want + "', got: '" + error +
                             "'");
  expect_context_alive(rank);
  buffer.reset();
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), buffer);
}

// Worst-case mode: rank 0's outputs are too small for what it receives. Its notify reports the capacity
// error and aborts the group (no trap); its dispatch writes nothing; every other rank's dispatch stops and
// names rank 0's cause.
void run_capacity_exceeded(epx::Bootstrap& bootstrap) {
  run_expecting_group_error(
      bootstrap,
      [](FaultCalls& calls, int rank, int num_ranks) {
        calls.set_num_worst_tokens(rank == 0 ? 1 : 48 * num_ranks);
      },
      [](int rank, int) {
        return std::string(rank == 0 ? "capacity exceeded" : "rank 0 exceeded its capacity");
      });
}

// Rank 0's num_tokens_per_rank undercounts what its is_token_in_rank sends the last rank, whose outputs it
// would size too small: the last rank's notify finds the disagreement and aborts the group before any
// receive writes; every rank names it.
void run_rank_counts_disagree(epx::Bootstrap& bootstrap, bool into_guess) {
  run_expecting_group_error(
      bootstrap,
      [into_guess](FaultCalls& calls, int rank, int) {
        calls.set_receive_into_guess(into_guess);
        if (rank == 0) calls.set_last_rank_count_error(-1);
      },
      [](int rank, int num_ranks) {
        return std::string(rank == num_ranks - 1
                               ? "num_tokens_per_rank of peer 0 gives"
                               : "num_tokens_per_rank of peer 0 disagrees with its is_token_in_rank");
      });
}

// Rank 0 changes its layout's outputs in place (one token less for the last rank, in is_token_in_rank and
// num_tokens_per_rank alike), so the counts its layout posted to the layout board are not what it sends. The
// last rank read them off the board; its receive, which runs the count exchange, finds the difference before
// it writes anything, and every rank names rank 0's layout.
void run_layout_counts_disagree(epx::Bootstrap& bootstrap) {
  run_expecting_group_error(
      bootstrap, [](FaultCalls& calls, int rank, int) { calls.set_drop_last_rank_token(rank == 0); },
      [](int, int) { return std::string("peer 0's get_dispatch_layout posted"); });
}

// Rank 0 runs a second get_dispatch_layout after the one its dispatch uses: its host marks on the layout
// board that the posted counts do not hold, so every rank takes its counts from the count exchange instead,
// and the calls succeed.
void run_layout_not_used(epx::Bootstrap& bootstrap, FaultCalls::LayoutAfter layout_after) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  epx::Buffer buffer(bootstrap, fault_buffer_options(num_ranks));
  {
    FaultCalls calls(buffer, num_ranks);
    calls.set_layout_after(rank == 0 ? layout_after : FaultCalls::LayoutAfter::kNone);
    calls.run(Fault::kCombine, false);
    if (calls.counts_from_layout())
      throw std::runtime_error("rank " + std::to_string(rank) + ": counts read off the layout board");
  }
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), buffer);
}

// Receive hooks and events: the event of a call that gave up raises the failure from synchronize(); after
// the abort a pending hook refuses with its message; after reset() the hook is stale; after destroy() it
// refuses to launch on freed memory.
void run_hooks_after_abort(epx::Bootstrap& bootstrap) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  const int victim = num_ranks - 1;
  epx::Buffer buffer(bootstrap, fault_buffer_options(num_ranks));
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), buffer);
  FaultCalls calls(buffer, num_ranks);
  calls.low_latency(Fault::kClean, false);
  const epx::LowLatencyDispatchResult pending = calls.low_latency_dispatch(true);  // every rank: sent
  if (rank != victim) {
    // The victim never sends this second call: its receive gives up, and the call's event says so.
    std::string error;
    try {
      calls.low_latency_dispatch(false, true).event.synchronize();
    } catch (const epx::Error& caught) {
      error = caught.message();
    }
    if (error.find("peer " + std::to_string(victim) + " in low-latency dispatch receive") ==
        std::string::npos)
      throw std::runtime_error("rank " + std::to_string(rank) + ": unexpected error: '" + error + "'");
    expect_error([&] { pending.hook(calls.stream()); }, error);
  }
  bootstrap.barrier();
  if (rank == victim) {
    expect_error([&] { buffer.check(); }, "the group was aborted");
    expect_error([&] { pending.hook(calls.stream()); }, "the group was aborted");
  }
  buffer.reset();
  expect_error([&] { pending.hook(calls.stream()); }, "is stale");
  const epx::LowLatencyDispatchResult orphan = calls.low_latency_dispatch(true);
  buffer.destroy();
  expect_error([&] { orphan.hook(calls.stream()); }, "after its Buffer was destroyed");
}

void run_fault_group(Fault fault, bool rebuild) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) { run_fault(bootstrap, fault, rebuild); });
}

// The virtual-node splits of the fault tests across nodes: 2 nodes of 1 rank (run_ranks skips the test where
// 2 ranks cannot start), then, where 4 ranks can start, 2 nodes of 2. `run(num_ranks, ranks_per_node)` runs
// one split (through run_ranks_across_nodes).
template <typename Run>
void for_each_node_split(Run run) {
  run(2, 1);
  if (epx::test::test_rank_capacity() >= 4) run(4, 2);
}

void run_node_fault_groups(Fault fault) {
  for_each_node_split([&](int num_ranks, int ranks_per_node) {
    epx::test::run_ranks_across_nodes(
        num_ranks, [&](epx::Bootstrap& bootstrap) { run_fault(bootstrap, fault, false, ranks_per_node); });
  });
}

// release() (what a collected Python Buffer runs) meets no peer: the last rank releases while the others
// still wait in a bootstrap barrier it never joins, and returns at once; the others then release too, and
// every rank builds a new Buffer and runs checked calls on it.
void run_release_meets_no_peer(epx::Bootstrap& bootstrap) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  auto buffer = std::make_unique<epx::Buffer>(bootstrap, fault_buffer_options(num_ranks));
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), *buffer);
  if (rank == num_ranks - 1) {
    const auto start = std::chrono::steady_clock::now();
    buffer->release();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > kWaitTimeoutS)
      throw std::runtime_error("release() took " + std::to_string(seconds) + " s: it must meet no peer");
    if (!buffer->is_destroyed()) throw std::runtime_error("release() left the Buffer usable");
    expect_error([&] { buffer->rank(); }, "used after destroy()");
  }
  bootstrap.barrier();  // the last rank has released before the others do
  buffer->release();
  buffer->release();  // a no-op the second time
  expect_context_alive(rank);
  epx::Buffer again(bootstrap, fault_buffer_options(num_ranks));
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), again);
}

// ---- A rank that exits ----
//
// The last rank (V) ends its process with std::_Exit(0) where it would make the call of `fault`, after a good
// round trip: no destroy(), no destructor, no word to anyone. launch_local counts a child that exits with
// status 0 as a success (run_ranks' check passes), but its shared-memory bootstrap learns that a rank is gone
// only when the rank's worker returns or throws. So every later collective of the launcher's group (reset(),
// the teardown barrier of a Buffer that is not aborted, a new Buffer) would wait for LocalLaunchOptions::
// timeout and then fail: the survivors use none. Their errors come from device waits, destroy() of the
// aborted Buffer meets no one, and the new Buffer is built over a second group of the survivors alone (a
// shared segment mapped before the launch, as launch_local maps its own), as a job would build a new process
// group without the failed rank.
constexpr std::chrono::seconds kSurvivorsTimeout{60};

// `ranks_per_node` > 0: the group runs across (virtual) nodes of that many ranks; the survivors rebuild as
// one node.
void run_exit(epx::Bootstrap& bootstrap, epx::bootstrap::SharedSegment& survivors, Fault fault,
              int ranks_per_node = 0) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  const int victim = num_ranks - 1;
  auto buffer = std::make_unique<epx::Buffer>(bootstrap, fault_buffer_options(num_ranks, ranks_per_node));
  run_checked_calls(normal_case(num_ranks, ranks_per_node), low_latency_case(num_ranks, ranks_per_node),
                    *buffer);
  if (rank == victim) {
    FaultCalls calls(*buffer, num_ranks);
    calls.run(fault, true);  // the calls before the one of `fault`
    std::_Exit(0);
  }

  std::string error;
  const auto start = std::chrono::steady_clock::now();
  {
    FaultCalls calls(*buffer, num_ranks);
    try {
      calls.run(fault, false);
    } catch (const epx::Error& caught) {
      error = caught.message();
    }
  }
  const std::string where = "rank " + std::to_string(rank) + ", exit before " + fault_name(fault);
  if (ranks_per_node > 0) {
    expect_error_across_nodes(where, error, seconds_since(start), rank, victim, ranks_per_node, fault,
                              *buffer);
  } else {
    expect_victim_named(where, error, seconds_since(start), victim, fault, *buffer);
  }
  expect_context_alive(rank);
  expect_error([&] { FaultCalls(*buffer, num_ranks).run(fault, false); }, error);

  const auto destroy_start = std::chrono::steady_clock::now();
  buffer->destroy();  // aborted: meets no one
  const double destroy_seconds = seconds_since(destroy_start);
  if (destroy_seconds > kWaitTimeoutS + 1.0)
    throw std::runtime_error(where + ": destroy() took " + std::to_string(destroy_seconds) + " s");

  epx::bootstrap::ShmBootstrap group(survivors, rank, kSurvivorsTimeout);
  epx::Buffer again(group, fault_buffer_options(num_ranks - 1));
  run_checked_calls(normal_case(num_ranks - 1), low_latency_case(num_ranks - 1), again);
  again.destroy();
}

void run_exit_group(Fault fault) {
  const int num_ranks = fault_test_ranks();
  // Made before run_ranks forks the ranks, so every rank maps the same pages.
  epx::bootstrap::SharedSegment survivors(num_ranks - 1, epx::LocalLaunchOptions{}.max_gather_bytes);
  epx::test::run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) { run_exit(bootstrap, survivors, fault); });
}

// Across virtual nodes (for_each_node_split).
void run_node_exit_groups(Fault fault) {
  for_each_node_split([&](int num_ranks, int ranks_per_node) {
    epx::bootstrap::SharedSegment survivors(num_ranks - 1, epx::LocalLaunchOptions{}.max_gather_bytes);
    epx::test::run_ranks_across_nodes(
        num_ranks, [&](epx::Bootstrap& bootstrap) { run_exit(bootstrap, survivors, fault, ranks_per_node); });
  });
}

// ---- destroy() that one rank never calls ----
//
// destroy() of a Buffer that is not aborted meets every rank at a teardown barrier of the bootstrap, bounded
// by the bootstrap's own bound (LocalLaunchOptions::timeout), not by the device wait bound; when the barrier
// fails, destroy() still frees this rank's memory, then throws. (An aborted Buffer skips the barrier: the
// exit tests above show that.)

// Whether a bootstrap error lists `rank` among the ranks missing from a collective ("(missing: 1, 3)").
bool lists_missing_rank(const std::string& error, int rank) {
  const std::string head = "(missing: ";
  const size_t begin = error.find(head);
  if (begin == std::string::npos) return false;
  const size_t end = error.find(')', begin);
  const std::string list = ", " + error.substr(begin + head.size(), end - begin - head.size()) + ",";
  return list.find(", " + std::to_string(rank) + ",") != std::string::npos;
}

// `buffer`'s destroy() without rank `missing`: within `bound_s` it throws naming that rank and `reason` (how
// the bootstrap knew), and it has freed the Buffer all the same.
void expect_destroy_without(epx::Buffer& buffer, int missing, const std::string& reason, double bound_s) {
  const int rank = buffer.rank();
  const std::string where =
      "rank " + std::to_string(rank) + ", destroy() without rank " + std::to_string(missing);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  try {
    buffer.destroy();
  } catch (const epx::Error& caught) {
    error = caught.message();
  }
  const double seconds = seconds_since(start);
  if (error.find("peers did not reach the teardown barrier") == std::string::npos ||
      error.find(reason) == std::string::npos || !lists_missing_rank(error, missing))
    throw std::runtime_error(where + ": expected the teardown barrier to fail (" + reason + "), got: '" +
                             error + "'");
  if (seconds > bound_s)
    throw std::runtime_error(where + ": took " + std::to_string(seconds) + " s, bound " +
                             std::to_string(bound_s));
  if (!buffer.is_destroyed()) throw std::runtime_error(where + ": the Buffer was not freed");
  expect_error([&] { buffer.rank(); }, "used after destroy()");
  expect_context_alive(rank);
}

// The last rank leaves its worker after a good round trip without destroying its Buffer (leaked: no
// destructor runs either), and its process ends. The launcher's bootstrap records that the worker returned,
// so the others' teardown barrier fails at once, naming it.
void run_destroy_after_rank_left(epx::Bootstrap& bootstrap) {
  const int num_ranks = bootstrap.num_ranks();
  const int victim = num_ranks - 1;
  auto buffer = std::make_unique<epx::Buffer>(bootstrap, fault_buffer_options(num_ranks));
  run_checked_calls(normal_case(num_ranks), low_latency_case(num_ranks), *buffer);
  bootstrap.barrier();  // every rank's kernels are done with the victim's memory
  if (bootstrap.rank() == victim) {
    static_cast<void>(buffer.release());  // the unique_ptr lets go: the Buffer is never destroyed
    return;
  }
  expect_destroy_without(*buffer, victim, "rank " + std::to_string(victim) + "'s worker returned",
                         kWaitTimeoutS + 1.0);
}

// The last rank stays alive but never calls destroy(): the others' teardown barrier waits for the bootstrap's
// bound (short in this test), then fails naming it. The last rank then releases its Buffer (meeting no one).
constexpr std::chrono::seconds kShortBootstrapTimeout{10};

// `ranks_per_node` > 0: across (virtual) nodes, where the Buffer also holds NVSHMEM memory, whose collective
// free a failed teardown barrier must skip (the missing rank would never join it).
void run_destroy_without_live_rank(epx::Bootstrap& bootstrap, int ranks_per_node = 0) {
  const int num_ranks = bootstrap.num_ranks();
  const int victim = num_ranks - 1;
  auto buffer = std::make_unique<epx::Buffer>(bootstrap, fault_buffer_options(num_ranks, ranks_per_node));
  run_checked_calls(normal_case(num_ranks, ranks_per_node), low_latency_case(num_ranks, ranks_per_node),
                    *buffer);
  bootstrap.barrier();  // the others' destroy() starts now
  if (bootstrap.rank() == victim) {
    // Alive past the others' bound (returning earlier would end their wait at once, as above).
    std::this_thread::sleep_for(kShortBootstrapTimeout + std::chrono::seconds(3));
    buffer->release();
    if (!buffer->is_destroyed()) throw std::runtime_error("release() left the Buffer usable");
    return;
  }
  expect_destroy_without(*buffer, victim, "timed out after",
                         std::chrono::duration<double>(kShortBootstrapTimeout).count() + 1.0);
}

TEST(Faults, ReleaseMeetsNoPeer) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) { run_release_meets_no_peer(bootstrap); });
}

TEST(Faults, NotifySkippedThenReset) {
  run_fault_group(Fault::kNotify, false);
}
TEST(Faults, DispatchReceiveSkippedThenReset) {
  run_fault_group(Fault::kDispatchReceive, false);
}
TEST(Faults, CombineSkippedThenReset) {
  run_fault_group(Fault::kCombine, false);
}
TEST(Faults, LowLatencyDispatchSkippedThenReset) {
  run_fault_group(Fault::kLowLatencyDispatch, false);
}
TEST(Faults, LowLatencyCombineSkippedThenReset) {
  run_fault_group(Fault::kLowLatencyCombine, false);
}
TEST(Faults, CleanSkippedThenReset) {
  run_fault_group(Fault::kClean, false);
}
TEST(Faults, NotifySkippedThenRebuild) {
  run_fault_group(Fault::kNotify, true);
}
TEST(Faults, LowLatencyDispatchSkippedThenRebuild) {
  run_fault_group(Fault::kLowLatencyDispatch, true);
}
TEST(Faults, HooksAfterAbortResetAndDestroyAreRefused) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) { run_hooks_after_abort(bootstrap); });
}
TEST(Faults, CapacityExceededAbortsEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) { run_capacity_exceeded(bootstrap); });
}
TEST(Faults, RankCountsThatDisagreeAbortEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks,
                       [](epx::Bootstrap& bootstrap) { run_rank_counts_disagree(bootstrap, false); });
}
// The same with the count exchange inside the launched receive (a guess): the receive's blocks that write
// rows check the totals before they decide whether the rows fit.
TEST(Faults, RankCountsThatDisagreeAbortEveryRankInsideTheReceive) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks,
                       [](epx::Bootstrap& bootstrap) { run_rank_counts_disagree(bootstrap, true); });
}
TEST(Faults, LayoutBoardCountsThatDisagreeAbortEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) { run_layout_counts_disagree(bootstrap); });
}
TEST(Faults, LayoutBoardNotUsedWhereADispatchPassesAnotherLayoutsCounts) {
  const int num_ranks = fault_test_ranks();
  for (const auto after :
       {FaultCalls::LayoutAfter::kNowhere, FaultCalls::LayoutAfter::kFirstExpertOfEachRank}) {
    epx::test::run_ranks(num_ranks,
                         [after](epx::Bootstrap& bootstrap) { run_layout_not_used(bootstrap, after); });
  }
}
TEST(Faults, NormalShapesThatDifferFailOnEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(
      num_ranks, [](epx::Bootstrap& bootstrap) { run_shape_mismatch(bootstrap, MismatchAt::kNormalNotify); });
}
// The combine's records (hidden of x) differ on one rank although its dispatch agreed: the launch
// fingerprints catch it before any record is reduced.
TEST(Faults, NormalCombineShapesThatDifferFailOnEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) {
    run_shape_mismatch(bootstrap, MismatchAt::kNormalCombine);
  });
}
// One rank leaves num_tokens_per_rank out: the others would wait for its totals; the notify's fingerprint
// says so at once instead.
// A cached re-dispatch whose rows differ on one rank: no count exchange runs, the launch fingerprints catch
// it.
TEST(Faults, NormalCachedDispatchShapesThatDifferFailOnEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) {
    run_shape_mismatch(bootstrap, MismatchAt::kNormalCachedDispatch);
  });
}
// Buffers with an output window on some ranks only: their dispatches post how they receive, the others'
// do not; the launch fingerprints (another operation) catch it before any row is written.
TEST(Faults, OutputWindowOnSomeRanksOnlyFailsOnEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) {
    run_shape_mismatch(bootstrap, MismatchAt::kNormalWindowOnSomeRanks);
  });
}
// Across (virtual) nodes: the forwarders check their rail peers' launch fingerprints, the receivers and node
// reducers their local ranks', the final reducers their rail peers'.
TEST(Faults, NodesCombineAndCachedDispatchShapesThatDifferFailOnEveryRank) {
  for_each_node_split([](int num_ranks, int ranks_per_node) {
    for (const MismatchAt at : {MismatchAt::kNormalCombine, MismatchAt::kNormalCachedDispatch}) {
      epx::test::run_ranks_across_nodes(
          num_ranks, [&](epx::Bootstrap& bootstrap) { run_shape_mismatch(bootstrap, at, ranks_per_node); });
    }
  });
}
TEST(Faults, RankTotalsGivenOnSomeRanksOnlyFailOnEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(num_ranks, [](epx::Bootstrap& bootstrap) {
    run_shape_mismatch(bootstrap, MismatchAt::kRankTotalsLeftOut);
  });
}
TEST(Faults, LowLatencyShapesThatDifferFailOnEveryRank) {
  const int num_ranks = fault_test_ranks();
  epx::test::run_ranks(
      num_ranks, [](epx::Bootstrap& bootstrap) { run_shape_mismatch(bootstrap, MismatchAt::kLowLatency); });
}

// The same across (virtual) nodes: the count exchange, the forwarders and the node reducers wait with bounds
// too, and every rank reports within the bound + 1 s.
TEST(Faults, NodesNotifySkippedThenReset) {
  run_node_fault_groups(Fault::kNotify);
}
TEST(Faults, NodesDispatchReceiveSkippedThenReset) {
  run_node_fault_groups(Fault::kDispatchReceive);
}
TEST(Faults, NodesCombineSkippedThenReset) {
  run_node_fault_groups(Fault::kCombine);
}

// A rank exits before each phase; the survivors report it and rebuild among themselves.
TEST(Faults, RankExitsBeforeNotify) {
  run_exit_group(Fault::kNotify);
}
TEST(Faults, RankExitsBeforeDispatchReceive) {
  run_exit_group(Fault::kDispatchReceive);
}
TEST(Faults, RankExitsBeforeCombine) {
  run_exit_group(Fault::kCombine);
}
TEST(Faults, RankExitsBeforeLowLatencyDispatch) {
  run_exit_group(Fault::kLowLatencyDispatch);
}
TEST(Faults, RankExitsBeforeLowLatencyCombine) {
  run_exit_group(Fault::kLowLatencyCombine);
}
TEST(Faults, RankExitsBeforeClean) {
  run_exit_group(Fault::kClean);
}
// ... and across (virtual) nodes, in the count exchange, the forwarding receive and the combine.
TEST(Faults, NodesRankExitsBeforeNotify) {
  run_node_exit_groups(Fault::kNotify);
}
TEST(Faults, NodesRankExitsBeforeDispatchReceive) {
  run_node_exit_groups(Fault::kDispatchReceive);
}
TEST(Faults, NodesRankExitsBeforeCombine) {
  run_node_exit_groups(Fault::kCombine);
}
TEST(Faults, DestroyAfterARankLeftWithoutIt) {
  epx::test::run_ranks(fault_test_ranks(),
                       [](epx::Bootstrap& bootstrap) { run_destroy_after_rank_left(bootstrap); });
}
TEST(Faults, DestroyWhileALiveRankNeverCallsIt) {
  epx::test::run_ranks(
      fault_test_ranks(), [](epx::Bootstrap& bootstrap) { run_destroy_without_live_rank(bootstrap); },
      kShortBootstrapTimeout);
}
TEST(Faults, NodesDestroyWhileALiveRankNeverCallsIt) {
  epx::test::run_ranks_across_nodes(
      2, [](epx::Bootstrap& bootstrap) { run_destroy_without_live_rank(bootstrap, 1); },
      kShortBootstrapTimeout);
}

}  // namespace
