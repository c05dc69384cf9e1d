#include <gtest/gtest.h>

#include <thread>

#include "core/exclusive_use.hpp"
#include "epx/error.hpp"

namespace {

// Whether another thread can claim `use` now.
bool another_thread_can_claim(epx::ExclusiveUse& use) {
  bool claimed = false;
  std::thread other([&] {
    const epx::ExclusiveUse::Claim claim = use.claim("combine", 0);
    claimed = true;
  });
  other.join();
  return claimed;
}

// A second thread inside a call is refused with an error naming the call; the owner may nest claims, and
// once every claim ended another thread may call.
TEST(ExclusiveUse, SecondThreadIsRefusedOwnerMayNest) {
  epx::ExclusiveUse use;
  {
    const epx::ExclusiveUse::Claim outer = use.claim("dispatch_notify", 3);
    const epx::ExclusiveUse::Claim inner = use.claim("synchronize", 3);  // the same thread: allowed
    std::string refused;
    std::thread other([&] {
      try {
        const epx::ExclusiveUse::Claim claim = use.claim("combine", 3);
      } catch (const epx::Error& error) {
        refused = error.what();
      }
    });
    other.join();
    EXPECT_NE(refused.find("rank 3: combine called while another thread is inside a call"), std::string::npos)
        << refused;
  }
  EXPECT_TRUE(another_thread_can_claim(use));
}

// A claim ends when its call throws, so the next call of the thread (or of another) still works.
TEST(ExclusiveUse, ClaimEndsWhenTheCallThrows) {
  epx::ExclusiveUse use;
  try {
    const epx::ExclusiveUse::Claim claim = use.claim("dispatch_receive", 0);
    EPX_FAIL("a rejected argument");
  } catch (const epx::Error&) {
  }
  EXPECT_TRUE(another_thread_can_claim(use));
}

}  // namespace
