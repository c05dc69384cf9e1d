#pragma once

#include <cstdint>
#include <vector>

#include "formats/bf16.hpp"

// Hand-written BF16 rows for the reference tests: values in, bits out, and back.
namespace epx::test {

inline std::vector<uint16_t> bf16_values(const std::vector<float>& values) {
  std::vector<uint16_t> bits;
  for (float v : values) bits.push_back(float_to_bf16(v));
  return bits;
}

inline std::vector<float> float_values(const std::vector<uint16_t>& bits) {
  std::vector<float> values;
  for (uint16_t b : bits) values.push_back(bf16_to_float(b));
  return values;
}

}  // namespace epx::test
