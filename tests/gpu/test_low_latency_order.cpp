// How low-latency calls are ordered across the caller's streams: a call that follows one which joined the
// caller's stream launches straight on that stream (no comm-stream hops); the comm stream's next work must
// still come after it, whichever stream or event the next call names.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "epx/local_launcher.hpp"
#include "gpu/device_info.hpp"
#include "stream_gate.hpp"
#include "test_low_latency_harness.hpp"

namespace {

using epx::test::DeviceArray;

enum class NextCall { kOtherStream, kPreviousEvent };

// One rank on one GPU. Call 1 from stream a joins a; call 2 from a launches straight on a, behind a gate held
// on a; call 3 (async_finish, on the comm stream) comes from stream b, or from a with a previous event
// recorded on b. Call 3 must not finish while the gate holds call 2.
void check_next_call_waits_for_the_joined_stream(NextCall next) {
  const epx::LocalLaunchResult result = epx::launch_local({}, [next](epx::Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(0));
    constexpr int kTokens = 8, kHidden = 256, kExperts = 4, kTopk = 2;
    epx::BufferOptions options;
    options.num_rdma_bytes = epx::get_low_latency_rdma_size_hint(kTokens, kHidden, 1, kExperts);
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);

    const size_t rows = size_t(kExperts) * kTokens;
    DeviceArray x(kTokens * kHidden * 2), ids(kTokens * kTopk * 8), recv_x(rows * kHidden * 2),
        count(kExperts * 4), info(rows * 4), pos(rows * 4), range(kExperts * 8);
    ids.upload(std::vector<int64_t>{0, 1, 1, 2, 2, 3, 3, 0, 0, 2, 1, 3, -1, 1, 2, -1}, nullptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    epx::LowLatencyDispatchInput in;
    in.x = x.get();
    in.topk_idx = ids.get<int64_t>();
    in.num_tokens = kTokens;
    in.num_topk = kTopk;
    in.hidden = kHidden;
    in.num_max_dispatch_tokens_per_rank = kTokens;
    in.num_experts = kExperts;
    in.use_fp8 = false;
    epx::LowLatencyDispatchOutput out;
    out.recv_x = recv_x.get();
    out.recv_count = count.get<int>();
    out.recv_src_info = info.get<int>();
    out.recv_topk_pos = pos.get<int>();
    out.recv_layout_range = range.get<epx::LowLatencyRange>();

    cudaStream_t a = nullptr, b = nullptr;
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    cudaEvent_t on_b = nullptr;
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&on_b, cudaEventDisableTiming));
    bool gate_timed_out = false;
    bool third_done_early = false;
    {
      epx::low_latency_dispatch(buffer, in, out, {a, nullptr, false});  // through the comm stream, joins a
      epx::test::StreamGate gate(a, std::chrono::seconds(10));
      epx::low_latency_dispatch(buffer, in, out, {a, nullptr, false});  // straight on a, held
      EPX_CUDA_CHECK(cudaEventRecord(on_b, b));
      const epx::StreamOrder third = next == NextCall::kOtherStream ? epx::StreamOrder{b, nullptr, true}
                                                                    : epx::StreamOrder{a, on_b, true};
      const epx::LowLatencyDispatchResult result = epx::low_latency_dispatch(buffer, in, out, third);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      third_done_early = cudaEventQuery(result.event.get()) != cudaErrorNotReady;
      gate.release();
      result.event.synchronize();
      EPX_CUDA_CHECK(cudaStreamSynchronize(a));
      gate_timed_out = gate.timed_out();
    }
    buffer.synchronize(buffer.comm_stream());
    EPX_CUDA_CHECK(cudaEventDestroy(on_b));
    EPX_CUDA_CHECK(cudaStreamDestroy(a));
    EPX_CUDA_CHECK(cudaStreamDestroy(b));
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

}  // namespace
