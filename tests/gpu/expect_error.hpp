#pragma once

#include "epx/error.hpp"

#include <functional>
#include <stdexcept>
#include <string>

namespace epx::test {

// Throws unless `call` throws an epx::Error whose message contains `needle` (a worker can not use gtest
// assertions: they would stay in the child process).
inline void expect_error(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
  } catch (const epx::Error& error) {
    if (error.message().find(needle) == std::string::npos)
      throw std::runtime_error("expected an error about '" + needle + "', got: " + error.message());
    return;
  }
  throw std::runtime_error("expected an epx::Error about '" + needle + "', nothing was thrown");
}

}  // namespace epx::test
