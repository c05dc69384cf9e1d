// How low-latency calls are ordered across the caller's streams: a call that follows one which joined the
// caller's stream launches straight on that stream (no comm-stream hops); the comm stream's next work must
// still come after it, whichever stream or event the next call names.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "epx/local_launcher.hpp"
#include "gpu/device_info.hpp"
#include "stream_gate.hpp"
#include "test_low_latency_harness.hpp"

namespace {

using epx::test::DeviceArray;

// A low-latency dispatch of one rank on one GPU, ready to be called with any stream order.
struct OneRankDispatch {
  static constexpr int kTokens = 8, kHidden = 256, kExperts = 4, kTopk = 2;
  static epx::BufferOptions options() {
    epx::BufferOptions options;
    options.num_rdma_bytes = epx::get_low_latency_rdma_size_hint(kTokens, kHidden, 1, kExperts);
    options.wait_timeout_s = 20.0;
    return options;
  }

  explicit OneRankDispatch(epx::Bootstrap& bootstrap)
      : buffer(bootstrap, options()),
        x(kTokens * kHidden * 2),
        ids(kTokens * kTopk * 8),
        recv_x(size_t(kExperts) * kTokens * kHidden * 2),
        count(kExperts * 4),
        info(size_t(kExperts) * kTokens * 4),
        pos(size_t(kExperts) * kTokens * 4),
        range(kExperts * 8) {
    ids.upload(std::vector<int64_t>{0, 1, 1, 2, 2, 3, 3, 0, 0, 2, 1, 3, -1, 1, 2, -1}, nullptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    in.x = x.get();
    in.topk_idx = ids.get<int64_t>();
    in.num_tokens = kTokens;
    in.num_topk = kTopk;
    in.hidden = kHidden;
    in.num_max_dispatch_tokens_per_rank = kTokens;
    in.num_experts = kExperts;
    in.use_fp8 = false;
    out.recv_x = recv_x.get();
    out.recv_count = count.get<int>();
    out.recv_src_info = info.get<int>();
    out.recv_topk_pos = pos.get<int>();
    out.recv_layout_range = range.get<epx::LowLatencyRange>();
  }
  epx::LowLatencyDispatchResult call(const epx::StreamOrder& order) {
    return epx::low_latency_dispatch(buffer, in, out, order);
  }

  epx::Buffer buffer;
  DeviceArray x, ids, recv_x, count, info, pos, range;
  epx::LowLatencyDispatchInput in;
  epx::LowLatencyDispatchOutput out;
};

// Two non-blocking streams, destroyed with their owner.
struct TwoStreams {
  TwoStreams() {
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  }
  ~TwoStreams() {
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
  cudaStream_t a = nullptr, b = nullptr;
};

enum class NextCall { kOtherStream, kPreviousEvent };

// Call 1 from stream a joins a; call 2 from a launches straight on a, behind a gate held on a; call 3
// (async_finish, on the comm stream) comes from stream b, or from a with a previous event recorded on b. Call
// 3 must not finish while the gate holds call 2.
void check_next_call_waits_for_the_joined_stream(NextCall next) {
  const epx::LocalLaunchResult result = epx::launch_local({}, [next](epx::Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(0));
    OneRankDispatch dispatch(bootstrap);
    const TwoStreams streams;
    cudaEvent_t on_b = nullptr;
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&on_b, cudaEventDisableTiming));
    bool gate_timed_out = false;
    bool third_done_early = false;
    {
      dispatch.call({streams.a, nullptr, false});  // through the comm stream, joins a
      epx::test::StreamGate gate(streams.a, std::chrono::seconds(10));
      dispatch.call({streams.a, nullptr, false});  // straight on a, held
      EPX_CUDA_CHECK(cudaEventRecord(on_b, streams.b));
      const epx::StreamOrder third = next == NextCall::kOtherStream
                                         ? epx::StreamOrder{streams.b, nullptr, true}
                                         : epx::StreamOrder{streams.a, on_b, true};
      const epx::LowLatencyDispatchResult result = dispatch.call(third);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      third_done_early = cudaEventQuery(result.event.get()) != cudaErrorNotReady;
      gate.release();
      result.event.synchronize();
      EPX_CUDA_CHECK(cudaStreamSynchronize(streams.a));
      gate_timed_out = gate.timed_out();
    }
    dispatch.buffer.synchronize(dispatch.buffer.comm_stream());
    EPX_CUDA_CHECK(cudaEventDestroy(on_b));
    if (third_done_early) throw std::runtime_error("the third call finished while the second was held");
    if (gate_timed_out) throw std::runtime_error("the gate timed out: a call waited for the held stream");
    return 0;
  });
  ASSERT_TRUE(result.ok()) << result.summary();
}

TEST(LowLatencyOrder, CallFromAnotherStreamWaitsForTheJoinedStream) {
  if (epx::visible_gpu_count() < 1) GTEST_SKIP() << "needs 1 GPU";
  check_next_call_waits_for_the_joined_stream(NextCall::kOtherStream);
}

TEST(LowLatencyOrder, CallWithPreviousEventWaitsForTheJoinedStream) {
  if (epx::visible_gpu_count() < 1) GTEST_SKIP() << "needs 1 GPU";
  check_next_call_waits_for_the_joined_stream(NextCall::kPreviousEvent);
}

// A call captured on the joined stream belongs to its graph: a later call from another stream neither joins
// the capture nor waits for an event recorded in it (which fails once the capture ended).
TEST(LowLatencyOrder, CallCapturedOnTheJoinedStreamStaysInItsGraph) {
  if (epx::visible_gpu_count() < 1) GTEST_SKIP() << "needs 1 GPU";
  const epx::LocalLaunchResult result = epx::launch_local({}, [](epx::Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(0));
    OneRankDispatch dispatch(bootstrap);
    const TwoStreams streams;
    dispatch.call({streams.a, nullptr, false});  // through the comm stream, joins a
    EPX_CUDA_CHECK(cudaStreamBeginCapture(streams.a, cudaStreamCaptureModeThreadLocal));
    dispatch.call({streams.a, nullptr, false});  // straight on a, into the graph
    cudaGraph_t graph = nullptr;
    EPX_CUDA_CHECK(cudaStreamEndCapture(streams.a, &graph));
    dispatch.call({streams.b, nullptr, false});
    dispatch.call({streams.a, nullptr, true}).event.synchronize();
    cudaGraphExec_t exec = nullptr;
    EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    EPX_CUDA_CHECK(cudaGraphLaunch(exec, streams.a));
    EPX_CUDA_CHECK(cudaStreamSynchronize(streams.a));
    dispatch.call({streams.b, nullptr, false});
    EPX_CUDA_CHECK(cudaStreamSynchronize(streams.b));
    EPX_CUDA_CHECK(cudaGraphExecDestroy(exec));
    EPX_CUDA_CHECK(cudaGraphDestroy(graph));
    return 0;
  });
  ASSERT_TRUE(result.ok()) << result.summary();
}

}  // namespace
