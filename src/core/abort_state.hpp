#pragma once

#include <cstdint>
#include <string>

#include "core/wait_record.hpp"

namespace epx {

// The host's view of whether a Buffer's group failed: running until a wait record or an abort word shows
// that some wait gave up, then aborted, with one message that every later call raises, until reset().
// Plain host code: the Buffer feeds it what it reads from mapped or device memory.
class AbortState {
 public:
  bool aborted() const { return !message_.empty(); }
  const std::string& message() const { return message_; }

  // Throws epx::Error with the stored message once aborted.
  void throw_if_aborted() const;
  // A snapshot of the host-mapped record: when its flag is set, the state becomes aborted with its
  // description (unless it already was) and throws.
  void observe_record(const FailureRecord& record);
  // This rank's abort word (read from device memory): when set and no record explained the failure, the
  // state becomes aborted with the cause the word names, and throws.
  void observe_abort_word(int rank, int32_t word);
  // The group was reset (Buffer::reset): running again.
  void reset() { message_.clear(); }

 private:
  void enter(std::string message);
  std::string message_;
};

}  // namespace epx
