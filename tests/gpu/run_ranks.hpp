#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>

#include "common/cuda_check.hpp"
#include "common/device_info.hpp"
#include "epx/local_launcher.hpp"

namespace epx::test {

// Runs `worker` in one process per GPU (rank r on device r) and fails the test with the launcher's summary if
// any rank fails; skips the test when the machine has fewer GPUs.
inline void run_ranks(int num_ranks, const std::function<void(Bootstrap&)>& worker) {
  const int num_gpus = visible_gpu_count();
  if (num_gpus < num_ranks) GTEST_SKIP() << "needs " << num_ranks << " GPUs, found " << num_gpus;
  LocalLaunchOptions options;
  options.num_ranks = num_ranks;
  options.timeout = std::chrono::milliseconds(300000);
  const LocalLaunchResult result = launch_local(options, [&](Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(bootstrap.rank()));
    worker(bootstrap);
    return 0;
  });
  ASSERT_TRUE(result.ok()) << result.summary();
}

}  // namespace epx::test
