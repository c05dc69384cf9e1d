#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>

#include "core/abort_state.hpp"
#include "core/abort_word.hpp"
#include "core/shape_fingerprint.hpp"
#include "core/wait_record.hpp"
#include "epx/error.hpp"

namespace {

using epx::WaitPhase;

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const epx::Error& error) {
    return error.message();
  }
  return "";
}

// A set record of `rank` that gave up on `peer` in `phase`, expecting `expected` and seeing `seen`.
epx::FailureRecord record_of(int rank, int peer, WaitPhase phase, int64_t expected, int64_t seen) {
  epx::FailureRecord record{};
  record.flag = 1;
  record.rank = rank;
  record.peer = peer;
  record.phase = static_cast<int32_t>(phase);
  record.expected = expected;
  record.seen = seen;
  return record;
}

epx::FailureRecord failure_record() {
  epx::FailureRecord record = record_of(0, 1, WaitPhase::kBarrier, 7, 6);
  record.waited_ns = 1'000'000'000;
  return record;
}

TEST(AbortWord, RoundTripsEveryRankPeerAndPhase) {
  for (int rank = 0; rank < 64; ++rank) {
    for (int peer = -1; peer < 64; ++peer) {
      for (int phase = 0; phase <= static_cast<int>(WaitPhase::kLayoutCounts); ++phase) {
        const int32_t word = epx::encode_abort_word(rank, peer, static_cast<WaitPhase>(phase));
        ASSERT_TRUE(epx::abort_word_is_set(word));
        const epx::AbortCause cause = epx::decode_abort_word(word);
        ASSERT_EQ(cause.rank, rank);
        ASSERT_EQ(cause.peer, peer);
        ASSERT_EQ(cause.phase, static_cast<WaitPhase>(phase));
      }
    }
  }
  EXPECT_FALSE(epx::abort_word_is_set(0));
}

TEST(AbortWord, DescribesTheRankThatGaveUp) {
  EXPECT_EQ(epx::describe_abort_word(3, epx::encode_abort_word(2, 1, WaitPhase::kBarrier)),
            "rank 3: the group was aborted: rank 2 timed out waiting for peer 1 in barrier");
  EXPECT_EQ(epx::describe_abort_word(0, epx::encode_abort_word(1, -1, WaitPhase::kCapacity)),
            "rank 0: the group was aborted: rank 1 exceeded its capacity (num_worst_tokens)");
}

TEST(WaitRecord, OwnTimeoutNamesRankPeerPhaseAndValues) {
  EXPECT_EQ(epx::describe_failure(failure_record()),
            "rank 0 timed out after 1.0 s waiting for peer 1 in barrier: expected >= 7, saw 6");
}

TEST(WaitRecord, ReleasedWaitNamesWhereItStoppedAndTheFirstCause) {
  epx::FailureRecord record = failure_record();
  record.rank = 3;
  record.peer = 2;
  record.phase = static_cast<int32_t>(WaitPhase::kDispatchReceive);
  record.abort_word = epx::encode_abort_word(2, 1, WaitPhase::kBarrier);
  EXPECT_EQ(epx::describe_failure(record),
            "rank 3 stopped waiting for peer 2 in dispatch receive (expected >= 7, saw 6): the group was "
            "aborted: rank 2 timed out waiting for peer 1 in barrier");
  record.peer = -1;
  EXPECT_EQ(epx::describe_failure(record),
            "rank 3 skipped dispatch receive: the group was aborted: rank 2 timed out waiting for peer 1 in "
            "barrier");
}

TEST(WaitRecord, CapacityNamesRowsNeededAndRoom) {
  epx::FailureRecord record{};
  record.flag = 1;
  record.peer = -1;
  record.phase = static_cast<int32_t>(WaitPhase::kCapacity);
  record.expected = 64;
  record.seen = 70;
  EXPECT_EQ(epx::describe_failure(record),
            "rank 0: capacity exceeded for data from peer -1: needed 70 rows, room for 64");
}

TEST(WaitRecord, RankCountsNameThePeerAndBothCounts) {
  const epx::FailureRecord record = record_of(1, 0, WaitPhase::kRankCounts, 41, 42);
  EXPECT_EQ(
      epx::describe_failure(record),
      "rank 1: num_tokens_per_rank of peer 0 gives 41 tokens for this rank, but its is_token_in_rank marks "
      "42 (pass get_dispatch_layout's outputs unchanged)");
  EXPECT_EQ(
      epx::describe_abort_word(2, epx::encode_abort_word(1, 0, WaitPhase::kRankCounts)),
      "rank 2: the group was aborted: rank 1 found that the num_tokens_per_rank of peer 0 disagrees with "
      "its is_token_in_rank");
}

TEST(WaitRecord, LayoutCountsNameThePeerWhatItPostedAndWhatItSends) {
  epx::FailureRecord record = record_of(1, 0, WaitPhase::kLayoutCounts, 41, 40);
  EXPECT_EQ(
      epx::describe_failure(record),
      "rank 1: peer 0's get_dispatch_layout posted 40 tokens for this rank, but its dispatch sends 41 (each "
      "rank must pass its own last get_dispatch_layout's outputs, unchanged, to the dispatch after it)");
  EXPECT_EQ(epx::describe_abort_word(2, epx::encode_abort_word(1, 0, WaitPhase::kLayoutCounts)),
            "rank 2: the group was aborted: rank 1 found that the counts peer 0's get_dispatch_layout posted "
            "disagree with its dispatch");
  record.peer = -1;
  EXPECT_EQ(epx::describe_failure(record), "rank 1: the dispatch outputs hold 41 rows, but 40 rows arrive");
  EXPECT_EQ(epx::describe_abort_word(2, epx::encode_abort_word(1, -1, WaitPhase::kLayoutCounts)),
            "rank 2: the group was aborted: rank 1 got more dispatch rows than its outputs hold");
}

TEST(AbortState, StaysAbortedWithTheFirstMessageUntilReset) {
  epx::AbortState state;
  EXPECT_FALSE(state.aborted());
  EXPECT_NO_THROW(state.observe_record(epx::FailureRecord{}));
  EXPECT_NO_THROW(state.observe_abort_word(0, 0));
  const std::string first = error_of([&] { state.observe_record(failure_record()); });
  EXPECT_EQ(first, "rank 0 timed out after 1.0 s waiting for peer 1 in barrier: expected >= 7, saw 6");
  EXPECT_TRUE(state.aborted());
  // Later observations, and any later call, raise the first message.
  EXPECT_EQ(error_of([&] { state.throw_if_aborted(); }), first);
  EXPECT_EQ(
      error_of([&] { state.observe_abort_word(0, epx::encode_abort_word(3, 2, WaitPhase::kCombineReduce)); }),
      first);
  EXPECT_EQ(error_of([&] { state.observe_record(epx::FailureRecord{}); }), first);
  state.reset();
  EXPECT_FALSE(state.aborted());
  EXPECT_NO_THROW(state.throw_if_aborted());
}

TEST(AbortState, APeersAbortWordAlsoAborts) {
  epx::AbortState state;
  EXPECT_EQ(error_of([&] { state.observe_abort_word(1, epx::encode_abort_word(0, 1, WaitPhase::kBarrier)); }),
            "rank 1: the group was aborted: rank 0 timed out waiting for peer 1 in barrier");
  EXPECT_TRUE(state.aborted());
}

}  // namespace

namespace {

epx::ShapeFingerprint fingerprint_with(int field, int32_t value) {
  int32_t values[epx::kNumShapeFields] = {2048, 4096, 0, 8, 256, 10, 256, 0, 0, 0, 0};
  values[field] = value;
  return epx::make_shape_fingerprint(values);
}

TEST(ShapeFingerprint, EveryFieldChangesTheHashAndIsNamed) {
  const epx::ShapeFingerprint base = fingerprint_with(0, 2048);
  EXPECT_NE(base.hash, 0);
  for (int field = 0; field < epx::kNumShapeFields; ++field) {
    const epx::ShapeFingerprint other = fingerprint_with(field, base.values[field] + 1);
    EXPECT_NE(other.hash, base.hash) << epx::shape_field_name(field);
    EXPECT_EQ(epx::first_differing_field(base, other), field);
    EXPECT_STRNE(epx::shape_field_name(field), "?");
  }
  EXPECT_EQ(epx::first_differing_field(base, fingerprint_with(0, 2048)), -1);
}

TEST(ShapeFingerprint, MismatchRecordNamesPeerFieldAndBothValues) {
  epx::FailureRecord record = record_of(0, 1, WaitPhase::kShapeMismatch, 2048, 4096);
  record.detail = static_cast<int32_t>(epx::ShapeField::kHidden);
  EXPECT_EQ(
      epx::describe_failure(record),
      "rank 0: peer 1 called with hidden = 4096, this rank with 2048 (every rank must pass the same shapes "
      "and config)");
  EXPECT_EQ(epx::describe_abort_word(2, epx::encode_abort_word(0, 1, WaitPhase::kShapeMismatch)),
            "rank 2: the group was aborted: rank 0 found that peer 1 called with other shapes");
}

}  // namespace

namespace {

TEST(WaitRecord, SnapshotCopiesEveryFieldOnceTheFlagIsSet) {
  epx::FailureRecord record{};
  record.rank = 3;
  record.peer = 1;
  record.phase = static_cast<int32_t>(WaitPhase::kShapeMismatch);
  record.expected = 256;
  record.seen = 128;
  record.waited_ns = 42;
  record.abort_word = epx::encode_abort_word(2, 1, WaitPhase::kBarrier);
  record.detail = static_cast<int32_t>(epx::ShapeField::kHidden);
  // Not set yet: the snapshot holds nothing (a half-written record is never read).
  const epx::FailureRecord before = epx::snapshot_failure_record(record);
  EXPECT_EQ(before.flag, 0);
  EXPECT_EQ(before.rank, 0);
  record.flag = 1;
  const epx::FailureRecord copy = epx::snapshot_failure_record(record);
  EXPECT_EQ(std::memcmp(&copy, &record, sizeof(record)), 0);
}

}  // namespace
