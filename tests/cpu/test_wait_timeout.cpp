#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/wait_timeout.hpp"
#include "epx/error.hpp"

namespace {

std::string message_of(double (*parse)(const char*, double), const char* text) {
  try {
    parse(text, 30.0);
  } catch (const epx::Error& error) {
    return error.what();
  }
  return "";
}

TEST(WaitTimeout, SecondsBecomeNanoseconds) {
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(30.0), 30'000'000'000u);
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(0.5), 500'000'000u);
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(1e-12), 1u);  // never 0: a zero bound fails every wait at once
}

// Large bounds and infinity mean "wait forever", not a wrapped (tiny) bound.
TEST(WaitTimeout, HugeAndInfiniteBoundsNeverWrap) {
  const uint64_t never = UINT64_MAX / 2;
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(std::numeric_limits<double>::infinity()), never);
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(1e300), never);
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(1e11), never);  // 1e20 ns: beyond the 64-bit timer
  EXPECT_EQ(epx::wait_timeout_ns_from_seconds(1e9), 1'000'000'000'000'000'000u);
  EXPECT_THROW(epx::wait_timeout_ns_from_seconds(0.0), epx::Error);
  EXPECT_THROW(epx::wait_timeout_ns_from_seconds(-1.0), epx::Error);
  EXPECT_THROW(epx::wait_timeout_ns_from_seconds(std::nan("")), epx::Error);
}

TEST(WaitTimeout, EnvironmentTextIsCheckedAndNamed) {
  EXPECT_EQ(epx::wait_timeout_seconds_from_text(nullptr, 30.0), 30.0);
  EXPECT_EQ(epx::wait_timeout_seconds_from_text("", 30.0), 30.0);
  EXPECT_EQ(epx::wait_timeout_seconds_from_text("2.5", 30.0), 2.5);
  EXPECT_TRUE(std::isinf(epx::wait_timeout_seconds_from_text("inf", 30.0)));
  const auto parse = &epx::wait_timeout_seconds_from_text;
  EXPECT_NE(message_of(parse, "soon").find("EPX_WAIT_TIMEOUT_S = soon: must be a number of seconds"),
            std::string::npos);
  EXPECT_NE(message_of(parse, "0").find("must be > 0"), std::string::npos);
  EXPECT_NE(message_of(parse, "nan").find("must be a number of seconds"), std::string::npos);
}

}  // namespace
