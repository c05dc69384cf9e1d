#include <gtest/gtest.h>

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
    EXPECT_NE(message.find("num_tokens = -3"), std::string::npos) << message;
    EXPECT_NE(message.find("must be >= 0"), std::string::npos) << message;
    EXPECT_NE(message.find("test_error.cpp:"), std::string::npos) << message;
    EXPECT_EQ(error.message().rfind("invalid num_tokens", 0), 0u) << error.message();
  }
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
