#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "epx/local_launcher.hpp"

// Workers run in forked children: they report problems by throwing (the message lands in
// LocalLaunchResult::failures) and every assertion runs in the parent.
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kSeed = 20240611;

epx::LocalLaunchOptions options_for(int num_ranks, milliseconds timeout = milliseconds(2000)) {
  epx::LocalLaunchOptions options;
  options.num_ranks = num_ranks;
  options.timeout = timeout;
  options.max_gather_bytes = 64 << 10;
  options.kill_grace = milliseconds(300);
  return options;
}

// Byte j of what rank r sends in round i: stamped with (r, i, j) so a misplaced byte points at its source.
std::byte stamp(int rank, int round_idx, size_t byte_idx) {
  const uint32_t value =
      static_cast<uint32_t>(rank * 1000 + round_idx) * 2654435761u + static_cast<uint32_t>(byte_idx);
  return static_cast<std::byte>(value ^ (value >> 13));
}

std::vector<std::byte> stamped_payload(int rank, int round_idx, size_t bytes) {
  std::vector<std::byte> payload(bytes);
  for (size_t j = 0; j < bytes; ++j) payload[j] = stamp(rank, round_idx, j);
  return payload;
}

void check_gathered(const std::vector<std::byte>& gathered, int num_ranks, int round_idx, size_t bytes) {
  if (gathered.size() != static_cast<size_t>(num_ranks) * bytes) {
    throw std::runtime_error("round " + std::to_string(round_idx) + ": gathered " +
                             std::to_string(gathered.size()) + " bytes");
  }
  for (int peer = 0; peer < num_ranks; ++peer) {
    for (size_t j = 0; j < bytes; ++j) {
      if (gathered[peer * bytes + j] != stamp(peer, round_idx, j)) {
        throw std::runtime_error("round " + std::to_string(round_idx) + ": byte " + std::to_string(j) +
                                 " from rank " + std::to_string(peer) + " is wrong");
      }
    }
  }
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The failure line of `rank`, or "" when it has none.
std::string failure_of(const epx::LocalLaunchResult& result, int rank) {
  const std::string prefix = "rank " + std::to_string(rank) + ": ";
  for (const std::string& failure : result.failures) {
    if (failure.rfind(prefix, 0) == 0) return failure;
  }
  return "";
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(LocalLauncher, AllGatherAndBarrierForOneToEightRanks) {
  for (int num_ranks = 1; num_ranks <= 8; ++num_ranks) {
    const auto result = epx::launch_local(options_for(num_ranks), [](epx::Bootstrap& group) {
      if (group.num_ranks() < 1 || group.rank() < 0 || group.rank() >= group.num_ranks()) {
        throw std::runtime_error("bad rank/num_ranks");
      }
      // Same seed on every rank, so all ranks draw the same sizes.
      std::mt19937 rng(kSeed);
      const size_t sizes[] = {0, 1, 3, 8, 100, 4096, 65536};
      for (int round_idx = 0; round_idx < 12; ++round_idx) {
        const size_t bytes = sizes[rng() % std::size(sizes)];
        const auto payload = stamped_payload(group.rank(), round_idx, bytes);
        check_gathered(group.all_gather(payload.data(), bytes), group.num_ranks(), round_idx, bytes);
        if (rng() % 2 == 0) group.barrier();
      }
      const auto empty = group.all_gather(nullptr, 0);
      if (!empty.empty()) throw std::runtime_error("0-byte all_gather returned data");
      const auto values = epx::all_gather_value<int64_t>(group, group.rank() * 1000 + 7);
      for (int peer = 0; peer < group.num_ranks(); ++peer) {
        if (values.at(peer) != peer * 1000 + 7) throw std::runtime_error("all_gather_value mismatch");
      }
      group.barrier();
      return 0;
    });
    EXPECT_TRUE(result.ok()) << "num_ranks=" << num_ranks << ": " << result.summary();
    EXPECT_EQ(result.exit_codes, std::vector<int>(num_ranks, 0));
  }
}

// Back-to-back gathers with no barrier between them exercise the double-buffered slots: a fast rank
// writing call c+2 must never clobber call c before a slow rank has read it.
TEST(LocalLauncher, BackToBackGathersKeepEveryRoundIntact) {
  const auto result = epx::launch_local(options_for(4), [](epx::Bootstrap& group) {
    std::mt19937 rng(kSeed + group.rank());
    for (int round_idx = 0; round_idx < 300; ++round_idx) {
      const size_t bytes = 1 + round_idx % 97;
      const auto payload = stamped_payload(group.rank(), round_idx, bytes);
      const auto gathered = group.all_gather(payload.data(), bytes);
      if (rng() % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
      check_gathered(gathered, group.num_ranks(), round_idx, bytes);
    }
    return 0;
  });
  EXPECT_TRUE(result.ok()) << result.summary();
}

TEST(LocalLauncher, AllGatherValueOfStruct) {
  struct Info {
    int32_t rank;
    float scale;
    uint64_t handle;
  };
  const auto result = epx::launch_local(options_for(3), [](epx::Bootstrap& group) {
    const Info mine{group.rank(), 0.5f * group.rank(), 0xABCD0000ull + group.rank()};
    const std::vector<Info> infos = epx::all_gather_value(group, mine);
    if (infos.size() != 3) throw std::runtime_error("wrong count");
    for (int peer = 0; peer < 3; ++peer) {
      if (infos[peer].rank != peer || infos[peer].scale != 0.5f * peer ||
          infos[peer].handle != 0xABCD0000ull + peer)
        throw std::runtime_error("wrong Info from rank " + std::to_string(peer));
    }
    return 0;
  });
  EXPECT_TRUE(result.ok()) << result.summary();
}

TEST(LocalLauncher, RejectsInvalidOptions) {
  const auto worker = [](epx::Bootstrap&) { return 0; };
  for (const int num_ranks : {0, -1, 65}) {
    EXPECT_THROW(epx::launch_local(options_for(num_ranks), worker), epx::Error) << num_ranks;
  }
  auto options = options_for(2);
  options.timeout = milliseconds(0);
  EXPECT_THROW(epx::launch_local(options, worker), epx::Error);
  options = options_for(2);
  options.max_gather_bytes = size_t{1} << 31;
  EXPECT_THROW(epx::launch_local(options, worker), epx::Error);
  try {
    epx::launch_local(options_for(65), worker);
  } catch (const epx::Error& error) {
    EXPECT_TRUE(contains(error.what(), "num_ranks = 65")) << error.what();
  }
}

TEST(LocalLauncher, MismatchedByteCountsFailOnEveryRank) {
  constexpr int kNumRanks = 4;
  const auto result = epx::launch_local(options_for(kNumRanks), [](epx::Bootstrap& group) {
    group.barrier();
    const std::vector<std::byte> payload(16);
    group.all_gather(payload.data(), group.rank() == 2 ? 8 : 16);
    return 0;
  });
  EXPECT_FALSE(result.ok());
  ASSERT_EQ(result.failures.size(), static_cast<size_t>(kNumRanks)) << result.summary();
  for (int rank = 0; rank < kNumRanks; ++rank) {
    const std::string failure = failure_of(result, rank);
    EXPECT_TRUE(contains(failure, "exited with code 1")) << failure;
    EXPECT_TRUE(contains(failure, "all_gather #1")) << failure;
    EXPECT_TRUE(contains(failure, "rank 0 passed 16 bytes, rank 2 passed 8 bytes")) << failure;
    EXPECT_EQ(result.exit_codes[rank], 1);
  }
}

TEST(LocalLauncher, MismatchedCollectivesFailOnEveryRank) {
  constexpr int kNumRanks = 3;
  const auto result = epx::launch_local(options_for(kNumRanks), [](epx::Bootstrap& group) {
    const int value = 1;
    if (group.rank() == 1) {
      group.barrier();
    } else {
      group.all_gather(&value, sizeof(value));
    }
    return 0;
  });
  ASSERT_EQ(result.failures.size(), static_cast<size_t>(kNumRanks)) << result.summary();
  for (const std::string& failure : result.failures) {
    EXPECT_TRUE(contains(failure, "rank 0 called all_gather, rank 1 called barrier")) << failure;
  }
}

TEST(LocalLauncher, OversizedGatherFailsOnEveryRank) {
  auto options = options_for(2);
  options.max_gather_bytes = 1024;
  const auto result = epx::launch_local(options, [](epx::Bootstrap& group) {
    const std::vector<std::byte> payload(2048);
    group.all_gather(payload.data(), payload.size());
    return 0;
  });
  ASSERT_EQ(result.failures.size(), 2u) << result.summary();
  for (const std::string& failure : result.failures) {
    EXPECT_TRUE(contains(failure, "invalid bytes = 2048")) << failure;
    EXPECT_TRUE(contains(failure, "max_gather_bytes = 1024")) << failure;
  }
}

TEST(LocalLauncher, ThrowingWorkerFailsItsPeersQuickly) {
  constexpr int kNumRanks = 4;
  const auto start = Clock::now();
  const auto result = epx::launch_local(options_for(kNumRanks), [](epx::Bootstrap& group) {
    if (group.rank() == 1) throw std::runtime_error("boom from rank 1");
    group.barrier();
    return 0;
  });
  EXPECT_LT(seconds_since(start), 1.5);
  EXPECT_EQ(failure_of(result, 1), "rank 1: exited with code 1: boom from rank 1");
  ASSERT_EQ(result.failures.size(), static_cast<size_t>(kNumRanks)) << result.summary();
  EXPECT_EQ(result.failures.front(), failure_of(result, 1)) << "the root cause should be reported first";
  for (const int rank : {0, 2, 3}) {
    const std::string failure = failure_of(result, rank);
    EXPECT_TRUE(contains(failure, "barrier #0")) << failure;
    EXPECT_TRUE(contains(failure, "rank 1")) << failure;
    EXPECT_TRUE(contains(failure, "boom from rank 1")) << failure;
    EXPECT_FALSE(contains(failure, "timed out")) << failure;
  }
}

TEST(LocalLauncher, CrashedWorkerFailsPeersWaitingInBarrier) {
  constexpr int kNumRanks = 4;
  const auto start = Clock::now();
  const auto result = epx::launch_local(options_for(kNumRanks), [](epx::Bootstrap& group) {
    group.barrier();
    if (group.rank() == 2) {
      prctl(PR_SET_DUMPABLE, 0);  // no core file
      std::this_thread::sleep_for(milliseconds(50));
      raise(SIGSEGV);
    }
    group.barrier();
    return 0;
  });
  EXPECT_LT(seconds_since(start), 1.5);
  EXPECT_EQ(result.exit_codes[2], -SIGSEGV);
  EXPECT_TRUE(contains(failure_of(result, 2), "rank 2: killed by signal 11")) << result.summary();
  for (const int rank : {0, 1, 3}) {
    const std::string failure = failure_of(result, rank);
    EXPECT_TRUE(contains(failure, "barrier #1 aborted: rank 2 failed (killed by signal 11")) << failure;
    EXPECT_TRUE(contains(failure, "3 of 4 ranks had arrived (missing: 2)")) << failure;
    EXPECT_EQ(result.exit_codes[rank], 1);
  }
}

TEST(LocalLauncher, AbruptExitFailsPeers) {
  const auto start = Clock::now();
  const auto result = epx::launch_local(options_for(3), [](epx::Bootstrap& group) {
    if (group.rank() == 1) _exit(3);
    group.barrier();
    return 0;
  });
  EXPECT_LT(seconds_since(start), 1.5);
  EXPECT_EQ(failure_of(result, 1), "rank 1: exited with code 3");
  EXPECT_EQ(result.exit_codes[1], 3);
  for (const int rank : {0, 2}) {
    EXPECT_TRUE(contains(failure_of(result, rank), "rank 1 failed (exited with code 3)")) << result.summary();
  }
}

TEST(LocalLauncher, EarlyReturnFailsPeersWithoutTimeout) {
  const auto start = Clock::now();
  const auto result = epx::launch_local(options_for(4), [](epx::Bootstrap& group) {
    group.barrier();
    if (group.rank() == 3) return 0;
    group.barrier();
    return 0;
  });
  EXPECT_LT(seconds_since(start), 1.5);
  EXPECT_EQ(result.exit_codes[3], 0);
  EXPECT_EQ(failure_of(result, 3), "");
  ASSERT_EQ(result.failures.size(), 3u) << result.summary();
  for (const int rank : {0, 1, 2}) {
    const std::string failure = failure_of(result, rank);
    EXPECT_TRUE(contains(failure, "barrier #1")) << failure;
    EXPECT_TRUE(contains(failure, "rank 3")) << failure;
  }
}

TEST(LocalLauncher, LateRankMakesPeersTimeOut) {
  constexpr int kNumRanks = 4;
  const auto start = Clock::now();
  const auto result = epx::launch_local(options_for(kNumRanks, milliseconds(500)), [](epx::Bootstrap& group) {
    if (group.rank() == 3) std::this_thread::sleep_for(std::chrono::seconds(20));
    group.barrier();
    return 0;
  });
  // 500 ms timeout + 300 ms kill grace; the sleeper is killed, not waited for.
  EXPECT_LT(seconds_since(start), 2.5);
  ASSERT_EQ(result.failures.size(), static_cast<size_t>(kNumRanks)) << result.summary();
  EXPECT_TRUE(contains(result.failures.front(), "barrier #0 timed out after 500 ms")) << result.summary();
  for (const int rank : {0, 1, 2}) {
    const std::string failure = failure_of(result, rank);
    EXPECT_TRUE(contains(failure, "barrier #0")) << failure;
    EXPECT_TRUE(contains(failure, "3 of 4 ranks had arrived (missing: 3)")) << failure;
  }
  EXPECT_EQ(result.exit_codes[3], -SIGKILL);
  EXPECT_TRUE(contains(failure_of(result, 3), "killed by signal 9")) << result.summary();
  EXPECT_TRUE(contains(failure_of(result, 3), "by the launcher")) << result.summary();
}

TEST(LocalLauncher, NonZeroReturnCodeIsAFailure) {
  const auto result = epx::launch_local(options_for(2), [](epx::Bootstrap& group) {
    group.barrier();
    return group.rank() == 0 ? 7 : 0;
  });
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.exit_codes, (std::vector<int>{7, 0}));
  EXPECT_EQ(result.failures, std::vector<std::string>{"rank 0: exited with code 7"});
  EXPECT_EQ(result.summary(), "1 of 2 ranks failed:\n  rank 0: exited with code 7");
}

TEST(LocalLauncher, SummaryOfSuccess) {
  const auto result = epx::launch_local(options_for(2), [](epx::Bootstrap&) { return 0; });
  EXPECT_TRUE(result.ok());
  EXPECT_EQ(result.summary(), "all 2 ranks succeeded");
}

}  // namespace
