#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

// The named fields of EPX's plain input and output structs, listed once beside each struct. Tools walk the
// list instead of naming the fields again: the Python binding binds every field it lists (so a new field
// costs its declaration and one line in the list), and a static_assert after each list (lists_every_field)
// checks that it counts as many fields as the struct has.
namespace epx {

// Specialised beside each struct T:
//   template <> struct Fields<T> {
//     template <typename Visit> static constexpr void visit(Visit&& v) { v("name", &T::name); ... }
//   };
template <typename T>
struct Fields;

// How many fields the plain aggregate T has (flat structs only: a member that is itself an aggregate would
// count its own fields). Counts the initialisers T{...} accepts.
namespace fields_detail {
struct AnyValue {
  template <typename U>
  constexpr operator U() const noexcept;  // NOLINT(google-explicit-constructor): converts to any field
};
// Whether T{v_0, ..., v_{n-1}} compiles for the index sequence 0..n-1.
template <typename T, typename Indices, typename = void>
struct Takes : std::false_type {};
template <typename T, std::size_t... I>
struct Takes<T, std::index_sequence<I...>, std::void_t<decltype(T{(static_cast<void>(I), AnyValue{})...})>>
    : std::true_type {};
template <typename T, std::size_t N>
constexpr std::size_t count_from() {
  if constexpr (N > 64 || !Takes<T, std::make_index_sequence<N + 1>>::value) {
    return N;
  } else {
    return count_from<T, N + 1>();
  }
}
}  // namespace fields_detail

template <typename T>
constexpr std::size_t aggregate_field_count() {
  static_assert(std::is_aggregate_v<T>, "only plain aggregates have a field count");
  return fields_detail::count_from<T, 0>();
}

// How many fields Fields<T> lists.
template <typename T>
constexpr std::size_t listed_field_count() {
  std::size_t count = 0;
  Fields<T>::visit([&count](const char*, auto) { ++count; });
  return count;
}

// Whether Fields<T> lists every field of T (each list is followed by a static_assert of it).
template <typename T>
constexpr bool lists_every_field() {
  return listed_field_count<T>() == aggregate_field_count<T>();
}

}  // namespace epx
