#pragma once

#include <cstdint>

// Where the host spends a call's time, step by step (EPX_HOST_STEPS=1): a tool for the measured breakdown of
// the host cost per call, like EPX_NORMAL_PHASES for the kernels, not a feature. Each HostStep scope adds its
// nanoseconds to the counter of its name (a string literal); the totals print to stderr at exit, one line a
// name: "epx host step <name>: median <us> us, mean <us> us x <count>". Off, a scope costs one load of a
// static flag.
namespace epx {

bool host_steps_requested();

class HostStep {
 public:
  explicit HostStep(const char* name) : name_(host_steps_requested() ? name : nullptr) {
    if (name_ != nullptr) start_ns_ = now_ns();
  }
  ~HostStep() {
    if (name_ != nullptr) add(name_, now_ns() - start_ns_);
  }
  HostStep(const HostStep&) = delete;
  HostStep& operator=(const HostStep&) = delete;

 private:
  static uint64_t now_ns();
  static void add(const char* name, uint64_t ns);
  const char* name_;
  uint64_t start_ns_ = 0;
};

}  // namespace epx
