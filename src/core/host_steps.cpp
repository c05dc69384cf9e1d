#include "core/host_steps.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/env.hpp"

namespace epx {

namespace {

// Every sample: a step's first call (a pool growing, a module loading) can be a thousand times its usual
// time, so the mean alone misleads; the median shows the usual call.
struct StepTotals {
  uint64_t ns = 0;
  std::vector<uint64_t> samples;
};

double median_us(std::vector<uint64_t> samples) {
  if (samples.empty()) return 0.0;
  const auto middle = samples.begin() + static_cast<std::ptrdiff_t>(samples.size() / 2);
  std::nth_element(samples.begin(), middle, samples.end());
  return static_cast<double>(*middle) / 1e3;
}

// Totals by name, printed when the process exits (a static's destructor).
struct StepRegistry {
  std::mutex mutex;
  std::map<std::string, StepTotals> totals;
  ~StepRegistry() {
    for (const auto& [name, t] : totals) {
      const size_t count = t.samples.size();
      std::fprintf(stderr, "epx host step %s: median %.2f us, mean %.2f us x %zu\n", name.c_str(),
                   median_us(t.samples),
                   count == 0 ? 0.0 : static_cast<double>(t.ns) / 1e3 / static_cast<double>(count), count);
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
  t.samples.push_back(ns);
}

}  // namespace epx
