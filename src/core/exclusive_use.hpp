#pragma once

#include <atomic>
#include <thread>

#include "epx/error.hpp"

namespace epx {

// Catches two threads inside one Buffer's calls at the same time: a Buffer's calls share its comm stream,
// host scratch and protocol counters, so interleaved calls would corrupt each other silently. A thread may
// claim again while it holds a claim (a call that calls another); a second thread gets an epx::Error naming
// the call. Sequential use from several threads is fine.
class ExclusiveUse {
 public:
  class Claim {
   public:
    explicit Claim(ExclusiveUse* use) : use_(use) {}
    Claim(const Claim&) = delete;
    Claim& operator=(const Claim&) = delete;
    ~Claim() {
      if (use_ != nullptr && --use_->depth_ == 0)
        use_->owner_.store(std::thread::id{}, std::memory_order_release);
    }

   private:
    ExclusiveUse* use_;
  };

  // Throws when another thread holds a claim; `call` names the refused call, `rank` the Buffer's rank.
  Claim claim(const char* call, int rank) {
    const std::thread::id self = std::this_thread::get_id();
    std::thread::id expected{};
    if (!owner_.compare_exchange_strong(expected, self, std::memory_order_acquire) && expected != self) {
      EPX_FAIL(
          "rank ", rank, ": ", call,
          " called while another thread is inside a call on the same Buffer (a Buffer serves one thread at "
          "a time: its calls share one stream and one set of counters)");
    }
    ++depth_;  // only the owner gets here
    return Claim(this);
  }

 private:
  std::atomic<std::thread::id> owner_{};
  int depth_ = 0;
};

}  // namespace epx
