#pragma once

#include <functional>
#include <string>

#include "epx/error.hpp"

namespace epx::test {

// The message `call` throws, without the " (failed check: ...)" suffix; "" when it throws nothing.
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const epx::Error& error) {
    const std::string message = error.message();
    return message.substr(0, message.find(" (failed check"));
  }
  return "";
}

}  // namespace epx::test
