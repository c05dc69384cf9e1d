#include "core/abort_state.hpp"

#include <utility>

#include "core/abort_word.hpp"
#include "epx/error.hpp"

namespace epx {

void AbortState::throw_if_aborted() const {
  if (aborted()) EPX_FAIL(message_);
}

void AbortState::enter(std::string message) {
  if (!aborted()) message_ = std::move(message);
  EPX_FAIL(message_);
}

void AbortState::observe_record(const FailureRecord& record) {
  throw_if_aborted();
  if (record.flag == 1) enter(describe_failure(record));
}

void AbortState::observe_abort_word(int rank, int32_t word) {
  throw_if_aborted();
  if (abort_word_is_set(word)) enter(describe_abort_word(rank, word));
}

}  // namespace epx
