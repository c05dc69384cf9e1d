#include "core/host_steps.hpp"

#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "core/env.hpp"

namespace epx {

namespace {

struct StepTotals {
  uint64_t ns = 0;
  uint64_t count = 0;
};

// Totals by name, printed when the process exits (a static's destructor).
struct StepRegistry {
  std::mutex mutex;
  std::map<std::string, StepTotals> totals;
  ~StepRegistry() {
    for (const auto& [name, t] : totals) {
      std::fprintf(stderr, "epx host step %s: %.2f us x %llu\n", name.c_str(),
                   t.count == 0 ? 0.0 : static_cast<double>(t.ns) / 1e3 / static_cast<double>(t.count),
                   static_cast<unsigned long long>(t.count));
    }
  }
};

StepRegistry& registry() {
  static StepRegistry steps;
  return steps;
}

}  // namespace

bool host_steps_requested() {
  static const bool requested = env_equals("EPX_HOST_STEPS", "1");
  return requested;
}

uint64_t HostStep::now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

void HostStep::add(const char* name, uint64_t ns) {
  StepRegistry& steps = registry();
  const std::lock_guard<std::mutex> lock(steps.mutex);
  StepTotals& t = steps.totals[name];
  t.ns += ns;
  ++t.count;
}

}  // namespace epx
