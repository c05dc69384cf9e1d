#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "core/block_recycler.hpp"

namespace {

using epx::BlockRecycler;

char memory[8][1];  // distinct addresses to stand for device blocks

BlockRecycler::Block block(int i, size_t bytes) {
  return {memory[i], bytes};
}

// Requests round up to the granularity, so sizes that differ a little share a block size.
TEST(BlockRecycler, RoundsRequestsUp) {
  EXPECT_EQ(BlockRecycler::rounded(0), BlockRecycler::kGranularityBytes);
  EXPECT_EQ(BlockRecycler::rounded(1), BlockRecycler::kGranularityBytes);
  EXPECT_EQ(BlockRecycler::rounded(4096), 4096u);
  EXPECT_EQ(BlockRecycler::rounded(4097), 8192u);
}

// A take gets the smallest kept block that holds the request and is at most twice its rounded size; nothing
// when none does (the caller allocates then).
TEST(BlockRecycler, TakesTheSmallestBlockThatFits) {
  BlockRecycler recycler;
  EXPECT_EQ(recycler.take(4096).address, nullptr);
  ASSERT_TRUE(recycler.keep(block(0, 32768)));
  ASSERT_TRUE(recycler.keep(block(1, 8192)));
  ASSERT_TRUE(recycler.keep(block(2, 65536)));
  // 9,000 rounds to 12,288: 32,768 is more than twice that, 8,192 too small.
  EXPECT_EQ(recycler.take(9000).address, nullptr);
  const BlockRecycler::Block small = recycler.take(8000);
  EXPECT_EQ(small.address, memory[1]);
  EXPECT_EQ(small.bytes, 8192u);
  EXPECT_EQ(recycler.take(8000).address, nullptr);     // 32,768 > 2 * 8,192: it stays for a larger request
  EXPECT_EQ(recycler.take(16000).address, memory[0]);  // 32,768 <= 2 * 16,384
  EXPECT_EQ(recycler.take(16000).address, nullptr);
  EXPECT_EQ(recycler.take(40000).address, memory[2]);
  EXPECT_EQ(recycler.take(40000).address, nullptr);  // taken once only
}

// A request of less than half the granularity takes back the block size it allocates (rounded(bytes)): a
// worst-case dispatch's row array (4 bytes a row and one more, 1,025 bytes at 256 rows) took a pool
// allocation and a free every call while the rule compared with twice the request itself.
TEST(BlockRecycler, SmallRequestsReuseTheirRoundedBlock) {
  BlockRecycler recycler;
  const size_t request = 4 * 256 + 1;
  ASSERT_EQ(recycler.take(request).address, nullptr);
  ASSERT_TRUE(recycler.keep(block(0, BlockRecycler::rounded(request))));
  EXPECT_EQ(recycler.take(request).address, memory[0]);
  ASSERT_TRUE(recycler.keep(block(1, 2 * BlockRecycler::kGranularityBytes)));
  EXPECT_EQ(recycler.take(1).address, memory[1]);  // at most twice rounded(1)
  ASSERT_TRUE(recycler.keep(block(2, 4 * BlockRecycler::kGranularityBytes)));
  EXPECT_EQ(recycler.take(1).address, nullptr);  // more than twice: it stays
}

// At most kMaxKept blocks are kept; closed, nothing is kept and close returns what was, once.
TEST(BlockRecycler, KeepsABoundedNumberUntilClosed) {
  BlockRecycler recycler;
  for (size_t i = 0; i < BlockRecycler::kMaxKept; ++i) EXPECT_TRUE(recycler.keep(block(0, 4096 * (i + 1))));
  EXPECT_FALSE(recycler.keep(block(1, 4096)));  // full: the caller frees it
  EXPECT_EQ(recycler.close().size(), BlockRecycler::kMaxKept);
  EXPECT_FALSE(recycler.keep(block(1, 4096)));  // closed
  EXPECT_TRUE(recycler.close().empty());
  EXPECT_EQ(recycler.take(4096).address, nullptr);
}

// Handles are freed on any thread: keeps and takes from several threads lose and duplicate no block.
TEST(BlockRecycler, ThreadsShareIt) {
  BlockRecycler recycler;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&recycler, t] {
      for (int i = 0; i < 1000; ++i) {
        if (recycler.keep(block(t, 4096))) {
          const BlockRecycler::Block taken = recycler.take(4096);
          EXPECT_NE(taken.address, nullptr);  // at least this thread's block is there
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_TRUE(recycler.close().empty());
}

}  // namespace
