#include "epx/error.hpp"

namespace epx {

Error::Error(const char* file, int line, const std::string& message)
    : std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + message),
      file_(file),
      line_(line),
      message_(message) {}

namespace detail {

void throw_invalid_argument(const char* file, int line, const char* condition, const char* name,
                            const std::string& value, const char* rule) {
  throw Error(file, line,
              concat("invalid ", name, " = ", value, ": ", rule, " (failed check: ", condition, ")"));
}

void throw_error(const char* file, int line, const std::string& message) {
  throw Error(file, line, message);
}

}  // namespace detail
}  // namespace epx
