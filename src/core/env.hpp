#pragma once

#include <cstdlib>
#include <string_view>

namespace epx {

// Whether the environment variable `name` is set to exactly `value` (callers that read a switch once keep the
// answer in a static).
inline bool env_equals(const char* name, std::string_view value) {
  const char* text = std::getenv(name);
  return text != nullptr && std::string_view(text) == value;
}

}  // namespace epx
