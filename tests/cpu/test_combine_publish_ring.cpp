// A combine sender group with a publisher warp (src/kernels/combine_publish_ring.hpp): random schedules of
// the writers' leader granting chunks, writer warps arriving, the publisher storing the tail and the peer's
// reader consuming records show every stream finishing, each tail covering only records every writer wrote,
// and no ring slot counting two chunks' arrivals.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/combine_publish_ring.hpp"

namespace epx::kernels {
namespace {

struct Stream {
  int num_rows, queue, chunk, num_writers;
};

// Runs one schedule to its end; false when no step could run before the tail reached num_rows.
bool run_schedule(const Stream& s, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int> chunk_end;                     // chunk k's end, as the leader granted it
  std::vector<int> next_chunk(s.num_writers, 0);  // the chunk each writer warp writes next
  int slot_end[kPublishRingSlots] = {}, written[kPublishRingSlots] = {};
  int pushed = 0, published = 0, tail = 0, consumed = 0;
  while (tail < s.num_rows) {
    std::vector<int> steps;  // 0: grant, 1 + w: writer w arrives, -1: publish, -2: read one record
    const int granted = static_cast<int>(chunk_end.size());
    // The leader reserves chunk `granted` once every writer finished the chunk before (the writers' barrier
    // inside the grant's share), its slot is free and the queue has room.
    const bool writers_done =
        std::all_of(next_chunk.begin(), next_chunk.end(), [&](int c) { return c == granted; });
    if (pushed < s.num_rows && writers_done && writers_may_start(granted, published) &&
        s.queue - (pushed - consumed) > 0)
      steps.push_back(0);
    for (int w = 0; w < s.num_writers; ++w)
      if (next_chunk[w] < granted) steps.push_back(1 + w);
    if (publisher_may_take(written[publish_ring_slot(published)], s.num_writers)) steps.push_back(-1);
    if (consumed < tail) steps.push_back(-2);
    if (steps.empty()) return false;
    const int step = steps[std::uniform_int_distribution<size_t>(0, steps.size() - 1)(rng)];
    if (step == 0) {
      const int grant = std::min({s.queue - (pushed - consumed), s.chunk, s.num_rows - pushed});
      pushed += grant;
      chunk_end.push_back(pushed);
      slot_end[publish_ring_slot(granted)] = pushed;
    } else if (step > 0) {
      const int slot = publish_ring_slot(next_chunk[step - 1]++);
      EXPECT_LT(written[slot], s.num_writers) << "a slot counted two chunks";
      ++written[slot];
    } else if (step == -1) {
      // Every writer finished the chunk published: the tail covers only written records.
      for (int w = 0; w < s.num_writers; ++w) EXPECT_GT(next_chunk[w], published);
      const int slot = publish_ring_slot(published);
      EXPECT_EQ(slot_end[slot], chunk_end[published]);
      EXPECT_GT(slot_end[slot], tail);
      tail = slot_end[slot];
      written[slot] = 0;
      ++published;
    } else {
      ++consumed;
    }
  }
  return true;
}

TEST(CombinePublishRing, EveryScheduleFinishesAndPublishesOnlyWrittenRecords) {
  for (const Stream s :
       {Stream{1, 256, 32, 11}, Stream{1000, 256, 32, 11}, Stream{341, 256, 16, 11}, Stream{77, 1, 1, 2},
        Stream{50, 3, 2, 4}, Stream{64, 64, 64, 2}, Stream{200, 8, 5, 3}}) {
    for (unsigned seed = 0; seed < 200; ++seed) {
      SCOPED_TRACE(::testing::Message() << s.num_rows << " rows, queue " << s.queue << ", chunk " << s.chunk
                                        << ", " << s.num_writers << " writers, seed " << seed);
      ASSERT_TRUE(run_schedule(s, seed));
    }
  }
}

TEST(CombinePublishRing, SlotsAlternateAndTheWritersWaitForTheSlotsLastUser) {
  EXPECT_EQ(publish_ring_slot(0), 0);
  EXPECT_EQ(publish_ring_slot(3), 1);
  EXPECT_TRUE(writers_may_start(0, 0));
  EXPECT_TRUE(writers_may_start(1, 0));
  EXPECT_FALSE(writers_may_start(2, 0));
  EXPECT_TRUE(writers_may_start(2, 1));
  EXPECT_FALSE(publisher_may_take(10, 11));
  EXPECT_TRUE(publisher_may_take(11, 11));
  EXPECT_FALSE(group_takes_publisher(2));
  EXPECT_TRUE(group_takes_publisher(3));
}

}  // namespace
}  // namespace epx::kernels
