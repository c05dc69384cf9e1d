// The field lists beside the public input and output structs (epx/fields.hpp): a static_assert after
// each list checks that it names every field (the Python binding binds what they list). Here, on structs of
// its own (the public ones need the CUDA headers), that the check counts right.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/fields.hpp"

namespace {

enum class Mode { kA, kB };

// Pointers, an enum, a bool and defaults: as the public structs have.
struct FourFields {
  const void* x = nullptr;
  Mode mode = Mode::kA;
  int64_t* ids = nullptr;
  bool flag = false;
};

// A struct with a field its list forgot.
struct TwoFields {
  int listed = 0;
  const float* forgotten = nullptr;
};

}  // namespace

template <>
struct epx::Fields<FourFields> {
  template <typename Visit>
  static constexpr void visit(Visit&& v) {
    v("x", &FourFields::x);
    v("mode", &FourFields::mode);
    v("ids", &FourFields::ids);
    v("flag", &FourFields::flag);
  }
};
static_assert(epx::lists_every_field<FourFields>());

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
  EXPECT_FALSE(epx::lists_every_field<TwoFields>());
}

TEST(Fields, ListsNameTheMembersInDeclarationOrder) {
  std::vector<std::string> names;
  int pointers = 0;
  FourFields fields;
  epx::Fields<FourFields>::visit([&](const char* name, auto member) {
    names.emplace_back(name);
    if constexpr (std::is_pointer_v<std::remove_reference_t<decltype(fields.*member)>>) ++pointers;
  });
  EXPECT_EQ(names, (std::vector<std::string>{"x", "mode", "ids", "flag"}));
  EXPECT_EQ(pointers, 2);
}
