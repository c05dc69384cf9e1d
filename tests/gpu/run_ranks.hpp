#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>

#include "epx/local_launcher.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/device_info.hpp"

namespace epx::test {

// EPX_TEST_RANKS_PER_GPU=N lets N ranks share each GPU (rank r on device r % GPUs). The ranks' kernels then
// take turns on the GPU by time slicing, so this checks the logic of larger groups (indexing, barriers,
// counts) on a machine with fewer GPUs; it is far too slow for timings and NCCL refuses it. Default 1.
inline int test_ranks_per_gpu() {
  const char* value = std::getenv("EPX_TEST_RANKS_PER_GPU");
  const int n = value != nullptr ? std::atoi(value) : 1;
  return n > 1 ? n : 1;
}

// EPX_TEST_MIN_RANKS=N skips the tests of fewer than N ranks: a run with ranks sharing GPUs then covers only
// the groups that one rank per GPU could not (scripts/gpu-check.sh runs both side by side). Default 1.
inline int test_min_ranks() {
  const char* value = std::getenv("EPX_TEST_MIN_RANKS");
  return value != nullptr ? std::atoi(value) : 1;
}

// How many ranks the GPU tests can start here.
inline int test_rank_capacity() {
  return visible_gpu_count() * test_ranks_per_gpu();
}

// Runs `worker` in one process per rank (rank r on device r, or r % GPUs when ranks share GPUs) and fails the
// test with the launcher's summary if any rank fails; skips the test when the machine has too few GPUs.
// `bootstrap_timeout` bounds every collective wait of the ranks' group (LocalLaunchOptions::timeout).
inline void run_ranks(int num_ranks, const std::function<void(Bootstrap&)>& worker,
                      std::chrono::milliseconds bootstrap_timeout = std::chrono::milliseconds(300000)) {
  const int num_gpus = visible_gpu_count();
  if (num_gpus * test_ranks_per_gpu() < num_ranks) {
    GTEST_SKIP() << "needs " << num_ranks << (num_ranks == 1 ? " GPU" : " GPUs") << ", found " << num_gpus;
  }
  if (num_ranks < test_min_ranks()) {
    GTEST_SKIP() << num_ranks << " ranks: below EPX_TEST_MIN_RANKS=" << test_min_ranks();
  }
  LocalLaunchOptions options;
  options.num_ranks = num_ranks;
  options.timeout = bootstrap_timeout;
  const LocalLaunchResult result = launch_local(options, [&](Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(bootstrap.rank() % num_gpus));
    worker(bootstrap);
    return 0;
  });
  ASSERT_TRUE(result.ok()) << result.summary();
}

// run_ranks for groups that span (virtual) nodes: also skips where EPX was built without the NVSHMEM
// transport, which those groups need.
inline void run_ranks_across_nodes(
    int num_ranks, const std::function<void(Bootstrap&)>& worker,
    std::chrono::milliseconds bootstrap_timeout = std::chrono::milliseconds(300000)) {
#ifndef EPX_HAVE_NVSHMEM
  GTEST_SKIP() << "EPX was built without the NVSHMEM transport";
#endif
  run_ranks(num_ranks, worker, bootstrap_timeout);
}

// Name generator for suites parametrized by the rank count (INSTANTIATE_TEST_SUITE_P's last argument): the
// names end in /TwoRanks, /FourRanks, /EightRanks rather than /0, /1, so a filter or a log line says how
// many ranks ran and stays valid when a count is added.
inline std::string rank_count_name(const ::testing::TestParamInfo<int>& info) {
  switch (info.param) {
    case 2:
      return "TwoRanks";
    case 4:
      return "FourRanks";
    case 8:
      return "EightRanks";
    default:
      return std::to_string(info.param) + "Ranks";
  }
}

}  // namespace epx::test
