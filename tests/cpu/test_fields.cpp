// The field lists beside the public input and output structs (epx/common/fields.hpp) name every field: the
// Python binding binds what they list, so a field missing from a list would be missing from Python.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epx/common/fields.hpp"
#include "epx/low_latency.hpp"
#include "epx/normal.hpp"

namespace {

template <typename T>
constexpr bool lists_every_field() {
  return epx::listed_field_count<T>() == epx::aggregate_field_count<T>();
}

static_assert(lists_every_field<epx::DispatchLayoutOutput>());
static_assert(lists_every_field<epx::DispatchInput>());
static_assert(lists_every_field<epx::DispatchOutput>());
static_assert(lists_every_field<epx::CombineInput>());
static_assert(lists_every_field<epx::CombineOutput>());
static_assert(lists_every_field<epx::LowLatencyDispatchInput>());
static_assert(lists_every_field<epx::LowLatencyDispatchOutput>());
static_assert(lists_every_field<epx::LowLatencyCombineInput>());

// A struct with a field its list forgot.
struct TwoFields {
  int listed = 0;
  const float* forgotten = nullptr;
};

}  // namespace

template <>
struct epx::Fields<TwoFields> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("listed", &TwoFields::listed);
  }
};

TEST(Fields, AForgottenFieldIsCounted) {
  EXPECT_EQ(epx::aggregate_field_count<TwoFields>(), 2u);
  EXPECT_EQ(epx::listed_field_count<TwoFields>(), 1u);
  EXPECT_FALSE(lists_every_field<TwoFields>());
}

TEST(Fields, ListsNameTheMembersInDeclarationOrder) {
  std::vector<std::string> names;
  epx::Fields<epx::CombineOutput>::visit([&names](const char* name, auto) { names.emplace_back(name); });
  EXPECT_EQ(names, (std::vector<std::string>{"combined_x", "combined_topk_weights"}));
  epx::DispatchInput in;
  int pointers = 0;
  epx::Fields<epx::DispatchInput>::visit([&](const char*, auto member) {
    if constexpr (std::is_pointer_v<std::remove_reference_t<decltype(in.*member)>>) ++pointers;
  });
  EXPECT_EQ(pointers, 7);  // x, x_scales, topk_idx, topk_weights and the three layout arrays
}
