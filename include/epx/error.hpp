#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace epx {

// Every failure the library reports is an epx::Error: host argument checks, CUDA/NCCL/NVSHMEM errors and
// device-side wait timeouts. what() is what a user reads: the message alone ("invalid num_tokens = -3: must
// be
// >= 0"). With EPX_DEBUG_ERRORS=1 in the environment it also starts with "file:line: " and, for an argument
// check, ends with " (failed check: <condition>)": where a developer looks.
class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message, const std::string& failed_check = {});
  const std::string& file() const { return file_; }
  int line() const { return line_; }
  // The message alone (what() without the debug parts).
  const std::string& message() const { return message_; }
  // The condition of the argument check that failed ("" for other errors).
  const std::string& failed_check() const { return failed_check_; }

 private:
  std::string file_;
  int line_;
  std::string message_;
  std::string failed_check_;
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
// failed, e.g. "invalid num_tokens = -3: must be >= 0" (Error::failed_check(): "num_tokens >= 0").
#define EPX_CHECK(cond, name, value, rule)                                                                 \
  do {                                                                                                     \
    if (!(cond))                                                                                           \
      ::epx::detail::throw_invalid_argument(__FILE__, __LINE__, #cond, name, ::epx::detail::concat(value), \
                                            rule);                                                         \
  } while (0)

// EPX_FAIL("message parts", ...): an error that is not about one argument (a peer, a transport, a state).
#define EPX_FAIL(...) ::epx::detail::throw_error(__FILE__, __LINE__, ::epx::detail::concat(__VA_ARGS__))
