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

// The environment variable `name` as a count: its integer value, at least 0, or -1 when it is not set
// ("the default").
inline int env_count(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return -1;
  const int value = std::atoi(text);
  return value > 0 ? value : 0;
}

}  // namespace epx
