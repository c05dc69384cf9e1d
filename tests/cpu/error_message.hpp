#pragma once

#include <functional>
#include <string>

#include "epx/error.hpp"

namespace epx::test {

// The message `call` throws; "" when it throws nothing.
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const epx::Error& error) {
    return error.message();
  }
  return "";
}

}  // namespace epx::test
