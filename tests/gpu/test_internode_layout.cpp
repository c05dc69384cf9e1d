// get_dispatch_layout when the group spans nodes: tokens per node (num_tokens_per_rdma_rank) next to the
// per-rank and per-expert counts, on virtual nodes (BufferOptions::ranks_per_node or EPX_RANKS_PER_NODE),
// checked against the CPU reference. Also how the Buffer settles the node size on one host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/normal.hpp"
#include "expect_error.hpp"
#include "gpu/cuda_check.hpp"
#include "reference/layout.hpp"
#include "reference/test_data.hpp"
#include "run_ranks.hpp"
#include "test_low_latency_harness.hpp"  // DeviceArray

namespace {

using epx::test::DeviceArray;
using epx::test::run_ranks;

template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  if (got != want) throw std::runtime_error(what + " differs from the reference");
}

// Every rank runs get_dispatch_layout on its own routing (0, 1, 333 and 4097 tokens; uniform and skewed) and
// checks every output, num_tokens_per_rdma_rank included, against the reference for nodes of
// `ranks_per_node`. The node size comes from BufferOptions, or from EPX_RANKS_PER_NODE when `from_env`.
void check_layout_per_node(int num_ranks, int ranks_per_node, bool from_env) {
  run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) {
    if (from_env) setenv("EPX_RANKS_PER_NODE", std::to_string(ranks_per_node).c_str(), 1);
    epx::BufferOptions options;
    if (!from_env) options.ranks_per_node = ranks_per_node;
    epx::Buffer buffer(bootstrap, options);
    if (buffer.ranks_per_node() != ranks_per_node)
      throw std::runtime_error("ranks_per_node() is " + std::to_string(buffer.ranks_per_node()));
    const int R = num_ranks, K = 8, E = 8 * num_ranks, N = num_ranks / ranks_per_node;
    const int rank = bootstrap.rank();
    uint64_t seed = 40;
    for (int T : {0, 1, 333, 4097}) {
      for (bool unbalanced : {false, true}) {
        ++seed;
        const std::vector<int64_t> ids =
            epx::reference::make_routing(seed, std::vector<int>(R, T), K, E, R, unbalanced)[rank];
        DeviceArray topk(size_t(T) * K * 8), per_rank(R * 4), per_expert(E * 4), in_rank(size_t(T) * R),
            per_node(N * 4);
        topk.upload(ids, nullptr);
        EPX_CUDA_CHECK(cudaDeviceSynchronize());
        const epx::DispatchLayoutOutput out{per_rank.get<int>(), per_expert.get<int>(), in_rank.get<bool>(),
                                            per_node.get<int>()};
        epx::get_dispatch_layout(buffer, topk.get<int64_t>(), T, K, E, out, epx::StreamOrder{});
        buffer.synchronize(nullptr);

        const epx::reference::DispatchLayout want =
            epx::reference::get_dispatch_layout(ids.data(), T, K, E, R, ranks_per_node);
        const std::string where = "rank " + std::to_string(rank) + ", " + std::to_string(T) + " tokens: ";
        expect_equal(per_rank.download<int>(R), want.num_tokens_per_rank, where + "num_tokens_per_rank");
        expect_equal(per_expert.download<int>(E), want.num_tokens_per_expert,
                     where + "num_tokens_per_expert");
        expect_equal(in_rank.download<uint8_t>(size_t(T) * R), want.is_token_in_rank,
                     where + "is_token_in_rank");
        std::vector<int> want_per_node = want.num_tokens_per_rdma_rank;
        if (N == 1) {  // one node: the reference has none; the kernel counts tokens sent anywhere
          int sent = 0;
          for (int t = 0; t < T; ++t) {
            bool any = false;
            for (int r = 0; r < R; ++r) any = any || want.is_token_in_rank[size_t(t) * R + r] != 0;
            sent += any;
          }
          want_per_node = {sent};
        }
        expect_equal(per_node.download<int>(N), want_per_node, where + "num_tokens_per_rdma_rank");

        // Without the optional output the rest is unchanged.
        const epx::DispatchLayoutOutput without{per_rank.get<int>(), per_expert.get<int>(),
                                                in_rank.get<bool>()};
        epx::get_dispatch_layout(buffer, topk.get<int64_t>(), T, K, E, without, epx::StreamOrder{});
        buffer.synchronize(nullptr);
        expect_equal(per_rank.download<int>(R), want.num_tokens_per_rank,
                     where + "num_tokens_per_rank (alone)");
      }
    }
  });
}

TEST(DispatchLayoutNodes, TwoNodesOfOne) {
  check_layout_per_node(2, 1, false);
}

TEST(DispatchLayoutNodes, TwoNodesOfTwo) {
  check_layout_per_node(4, 2, false);
}

TEST(DispatchLayoutNodes, FourNodesOfOneFromTheEnvironment) {
  check_layout_per_node(4, 1, true);
}

// Without an override, ranks on one host whose GPUs reach each other are one node, as before detection.
TEST(DispatchLayoutNodes, OneHostIsOneNode) {
  const int num_ranks = std::min(epx::test::test_rank_capacity(), 4);
  if (num_ranks < 1) GTEST_SKIP() << "needs 1 GPU";
  run_ranks(num_ranks, [&](epx::Bootstrap& bootstrap) {
    unsetenv("EPX_RANKS_PER_NODE");
    epx::Buffer buffer(bootstrap, epx::BufferOptions{});
    if (buffer.ranks_per_node() != num_ranks || buffer.spans_nodes())
      throw std::runtime_error("one host should be one node, got ranks_per_node " +
                               std::to_string(buffer.ranks_per_node()));
  });
  check_layout_per_node(num_ranks, num_ranks, false);
}

// Ranks that ask for different node sizes all raise the same error, and none builds a Buffer.
TEST(DispatchLayoutNodes, NodeSizesThatDifferBetweenRanksFailOnEveryRank) {
  run_ranks(2, [&](epx::Bootstrap& bootstrap) {
    epx::BufferOptions options;
    options.ranks_per_node = bootstrap.rank() == 0 ? 1 : 2;
    epx::test::expect_error(
        [&] { epx::Buffer buffer(bootstrap, options); },
        "invalid ranks_per_node = 1 on rank 0, 2 on rank 1: must be the same on every rank");
  });
}

}  // namespace
