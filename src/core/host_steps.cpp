#include "core/host_steps.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "core/env.hpp"

namespace epx {

namespace {

double mean_us(const std::vector<uint64_t>& samples) {
  if (samples.empty()) return 0.0;
  const uint64_t total = std::accumulate(samples.begin(), samples.end(), uint64_t{0});
  return static_cast<double>(total) / 1e3 / static_cast<double>(samples.size());
}

double median_us(std::vector<uint64_t> samples) {
  if (samples.empty()) return 0.0;
  const auto middle = samples.begin() + static_cast<std::ptrdiff_t>(samples.size() / 2);
  std::nth_element(samples.begin(), middle, samples.end());
  return static_cast<double>(*middle) / 1e3;
}

// Every sample by name, printed when the process exits (a static's destructor). Every sample, not a sum: a
// step's first call (a pool growing, a module loading) can be a thousand times its usual time, so the mean
// alone misleads; the median shows the usual call.
struct StepRegistry {
  std::mutex mutex;
  std::map<std::string, std::vector<uint64_t>> samples;
  ~StepRegistry() {
    for (const auto& [name, ns] : samples) {
      std::fprintf(stderr, "epx host step %s: median %.2f us, mean %.2f us x %zu\n", name.c_str(),
                   median_us(ns), mean_us(ns), ns.size());
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
  steps.samples[name].push_back(ns);
}

}  // namespace epx
