#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace epx {

// Every failure the library reports is an epx::Error: host argument checks, CUDA/NCCL/NVSHMEM errors and
// device-side wait timeouts. what() starts with "file:line: " so the message points at its source.
class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message);
  const std::string& file() const { return file_; }
  int line() const { return line_; }
  // The message without the "file:line: " prefix.
  const std::string& message() const { return message_; }

 private:
  std::string file_;
  int line_;
  std::string message_;
};

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

[[noreturn]] void throw_invalid_argument(const char* file, int line, const char* condition, const char* name,
                                         const std::string& value, const char* rule);
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace detail
}  // namespace epx

// EPX_CHECK(cond, "argument", value, "rule"): one condition per check, so the message names the part that
// failed, e.g. "invalid num_tokens = -3: must be >= 0 (failed check: num_tokens >= 0)".
#define EPX_CHECK(cond, name, value, rule)                                                                 \
  do {                                                                                                     \
    if (!(cond))                                                                                           \
      ::epx::detail::throw_invalid_argument(__FILE__, __LINE__, #cond, name, ::epx::detail::concat(value), \
                                            rule);                                                         \
  } while (0)

// EPX_FAIL("message parts", ...): an error that is not about one argument (a peer, a transport, a state).
#define EPX_FAIL(...) ::epx::detail::throw_error(__FILE__, __LINE__, ::epx::detail::concat(__VA_ARGS__))
