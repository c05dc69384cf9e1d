#include <gtest/gtest.h>

#include <cstdlib>

#include "core/env.hpp"

namespace {

// A count from the environment: -1 when unset (the caller's default), its value otherwise, never below 0.
TEST(Env, CountIsMinusOneUnsetAndNeverNegative) {
  const char* name = "EPX_TEST_ENV_COUNT";
  unsetenv(name);
  EXPECT_EQ(epx::env_count(name), -1);
  setenv(name, "6", 1);
  EXPECT_EQ(epx::env_count(name), 6);
  setenv(name, "0", 1);
  EXPECT_EQ(epx::env_count(name), 0);
  setenv(name, "-3", 1);
  EXPECT_EQ(epx::env_count(name), 0);
  setenv(name, "junk", 1);
  EXPECT_EQ(epx::env_count(name), 0);
  unsetenv(name);
}

TEST(Env, EqualsOnlyTheExactValue) {
  const char* name = "EPX_TEST_ENV_EQUALS";
  unsetenv(name);
  EXPECT_FALSE(epx::env_equals(name, "1"));
  setenv(name, "1", 1);
  EXPECT_TRUE(epx::env_equals(name, "1"));
  EXPECT_FALSE(epx::env_equals(name, "10"));
  unsetenv(name);
}

}  // namespace
