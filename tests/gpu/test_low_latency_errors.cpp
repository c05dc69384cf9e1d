#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>

#include "epx/error.hpp"
#include "epx/local_launcher.hpp"
#include "expect_error.hpp"
#include "gpu/device_info.hpp"
#include "test_low_latency_harness.hpp"

namespace {

using epx::test::DeviceArray;

using epx::test::expect_error;

// Rejected calls on one GPU, then a full checked dispatch + combine on the same buffer: a rejected call must
// leave the buffer usable.
TEST(LowLatencyErrors, RejectedCallsLeaveTheBufferUsable) {
  if (epx::visible_gpu_count() < 1) GTEST_SKIP() << "needs 1 GPU";
  const epx::LocalLaunchResult result = epx::launch_local({}, [](epx::Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(0));
    epx::test::LowLatencyCase c;
    c.num_ranks = 1;
    c.num_max_tokens = 8;
    c.hidden = 256;
    c.num_experts = 4;
    c.num_topk = 2;
    c.use_fp8 = true;
    epx::BufferOptions options;
    options.num_rdma_bytes = epx::get_low_latency_rdma_size_hint(8, 256, 1, 4);
    options.wait_timeout_s = 20.0;
    epx::Buffer buffer(bootstrap, options);

    const int num_local = 4;
    const size_t rows = size_t(num_local) * 8;
    DeviceArray x(8 * 256 * 2), ids(8 * 2 * 8), weights(8 * 2 * 4), recv_x(rows * 256), scales(rows * 2 * 4),
        count(num_local * 4), info(rows * 4), pos(rows * 4), range(num_local * 8), out(8 * 256 * 2);
    ids.upload(std::vector<int64_t>(16, 1), nullptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    epx::LowLatencyDispatchInput in;
    in.x = x.get();
    in.topk_idx = ids.get<int64_t>();
    in.num_tokens = 8;
    in.num_topk = 2;
    in.hidden = 256;
    in.num_max_dispatch_tokens_per_rank = 8;
    in.num_experts = 4;
    epx::LowLatencyDispatchOutput o;
    o.recv_x = recv_x.get();
    o.recv_x_scales = scales.get();
    o.recv_count = count.get<int>();
    o.recv_src_info = info.get<int>();
    o.recv_topk_pos = pos.get<int>();
    o.recv_layout_range = range.get<epx::LowLatencyRange>();
    const epx::StreamOrder order{};
    auto dispatch = [&](epx::LowLatencyDispatchInput i, epx::LowLatencyDispatchOutput out_ptrs,
                        epx::StreamOrder ord) { return epx::low_latency_dispatch(buffer, i, out_ptrs, ord); };

    auto bad = in;
    bad.num_tokens = 9;
    expect_error([&] { dispatch(bad, o, order); }, "num_tokens");
    bad = in;
    bad.num_topk = 17;
    expect_error([&] { dispatch(bad, o, order); }, "top-k > 16");
    bad = in;
    bad.hidden = 200;
    expect_error([&] { dispatch(bad, o, order); }, "hidden");
    bad = in;
    bad.num_max_dispatch_tokens_per_rank = 1 << 12;
    expect_error([&] { dispatch(bad, o, order); }, "num_rdma_bytes");
    bad = in;
    bad.use_ue8m0 = true;
    expect_error([&] { dispatch(bad, o, order); }, "round_scale");
    bad = in;
    bad.return_recv_hook = true;
    expect_error([&] { dispatch(bad, o, epx::StreamOrder{nullptr, nullptr, true}); }, "async_finish");
    auto bad_out = o;
    bad_out.recv_x_scales = nullptr;
    expect_error([&] { dispatch(in, bad_out, order); }, "recv_x_scales");
    bad_out = o;
    bad_out.recv_layout_range = nullptr;
    expect_error([&] { dispatch(in, bad_out, order); }, "recv_layout_range");
    bad = in;
    bad.topk_weights = weights.get<float>();  // weights without a table for their listings
    expect_error([&] { dispatch(bad, o, order); }, "recv_token_listings");
    DeviceArray listings(sizeof(epx::LowLatencyListing) * 8 * 2);
    bad_out = o;
    bad_out.recv_token_listings = listings.get<epx::LowLatencyListing>();  // a table, but no weights
    expect_error([&] { dispatch(in, bad_out, order); }, "topk_weights");

    // Two pending receives are fine, a third call on a busy half is not; a hook runs once.
    auto hooked = in;
    hooked.return_recv_hook = true;
    const epx::LowLatencyDispatchResult first = dispatch(hooked, o, order);
    const epx::LowLatencyDispatchResult second = dispatch(hooked, o, order);
    expect_error([&] { dispatch(in, o, order); }, "has not run");
    first.hook(nullptr);
    expect_error([&] { first.hook(nullptr); }, "runs once");
    second.hook(nullptr);

    // Combine must match its dispatch.
    epx::LowLatencyCombineInput comb;
    comb.x = x.get();
    comb.topk_idx = ids.get<int64_t>();
    comb.topk_weights = weights.get<float>();
    comb.num_tokens = 7;
    comb.num_topk = 2;
    expect_error([&] { epx::low_latency_combine(buffer, second.handle, comb, out.get(), order); },
                 "num_tokens");
    comb.num_tokens = 8;
    comb.num_topk = 3;
    expect_error([&] { epx::low_latency_combine(buffer, second.handle, comb, out.get(), order); },
                 "num_topk");
    comb.num_topk = 2;
    comb.pre_reduce = true;  // the dispatch had no topk_weights
    expect_error([&] { epx::low_latency_combine(buffer, second.handle, comb, out.get(), order); },
                 "pre_reduce");
    comb.pre_reduce = false;
    comb.x = nullptr;
    expect_error([&] { epx::low_latency_combine(buffer, second.handle, comb, out.get(), order); },
                 "zero_copy");
    buffer.synchronize(nullptr);

    // The same buffer still works, checked against the reference, also after a clean.
    epx::test::LowLatencyRunner(c, buffer).run();
    epx::clean_low_latency_buffer(buffer, 8, 256, 4, order);
    c.seed = 2;
    c.dispatch_hook = true;
    epx::test::LowLatencyRunner(c, buffer).run();
    c.seed = 3;
    c.pre_reduce = true;
    epx::test::LowLatencyRunner(c, buffer).run();
    return 0;
  });
  ASSERT_TRUE(result.ok()) << result.summary();
}

}  // namespace
