#include "epx/error.hpp"

#include <cstdlib>

namespace epx {

namespace {

// EPX_DEBUG_ERRORS=1: what() also names the source and the failed condition.
bool debug_errors() {
  const char* value = std::getenv("EPX_DEBUG_ERRORS");
  return value != nullptr && value[0] == '1';
}

std::string what_text(const char* file, int line, const std::string& message,
                      const std::string& failed_check) {
  if (!debug_errors()) return message;
  std::string text = std::string(file) + ":" + std::to_string(line) + ": " + message;
  if (!failed_check.empty()) text += " (failed check: " + failed_check + ")";
  return text;
}

}  // namespace

Error::Error(const char* file, int line, const std::string& message, const std::string& failed_check)
    : std::runtime_error(what_text(file, line, message, failed_check)),
      file_(file),
      line_(line),
      message_(message),
      failed_check_(failed_check) {}

namespace detail {

void throw_invalid_argument(const char* file, int line, const char* condition, const char* name,
                            const std::string& value, const char* rule) {
  throw Error(file, line, concat("invalid ", name, " = ", value, ": ", rule), condition);
}

void throw_error(const char* file, int line, const std::string& message) {
  throw Error(file, line, message);
}

}  // namespace detail
}  // namespace epx
