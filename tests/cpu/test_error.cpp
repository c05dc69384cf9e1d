#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "epx/error.hpp"

namespace {

void check_tokens(int num_tokens) {
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
}

TEST(Error, CheckNamesArgumentValueAndRule) {
  try {
    check_tokens(-3);
    FAIL() << "expected epx::Error";
  } catch (const epx::Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(message, "invalid num_tokens = -3: must be >= 0");
    EXPECT_EQ(error.message(), message);
    EXPECT_EQ(error.failed_check(), "num_tokens >= 0");
    EXPECT_NE(error.file().find("test_error.cpp"), std::string::npos) << error.file();
  }
}

// EPX_DEBUG_ERRORS=1: the source and the failed condition too, for whoever debugs the library.
TEST(Error, DebugErrorsAddSourceAndCondition) {
  setenv("EPX_DEBUG_ERRORS", "1", 1);
  try {
    check_tokens(-3);
    FAIL() << "expected epx::Error";
  } catch (const epx::Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("test_error.cpp:"), std::string::npos) << message;
    EXPECT_NE(message.find("invalid num_tokens = -3: must be >= 0 (failed check: num_tokens >= 0)"),
              std::string::npos)
        << message;
  }
  unsetenv("EPX_DEBUG_ERRORS");
}

TEST(Error, PassingCheckDoesNotThrow) {
  EXPECT_NO_THROW(check_tokens(0));
}

TEST(Error, FailJoinsParts) {
  try {
    EPX_FAIL("peer ", 3, " unreachable");
  } catch (const epx::Error& error) {
    EXPECT_EQ(error.message(), "peer 3 unreachable");
    EXPECT_GT(error.line(), 0);
  }
}

}  // namespace
