#pragma once

// Shared helpers of the `epx._epx` extension. The binding speaks in plain values: device pointers, streams
// and events are Python ints, host arrays are numpy arrays; torch lives only in the Python package above it.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/fields.hpp"

namespace epx::python {

namespace py = pybind11;

template <typename Pointer>
Pointer to_pointer(uintptr_t address) {
  return reinterpret_cast<Pointer>(address);  // NOLINT(performance-no-int-to-ptr)
}

// A pointer field of a plain struct as an int property (0 = null).
template <typename Class, typename Pointer>
void def_pointer(py::class_<Class>& cls, const char* name, Pointer Class::*member) {
  static_assert(std::is_pointer_v<Pointer>, "def_pointer needs a pointer member");
  cls.def_property(
      name, [member](const Class& self) { return reinterpret_cast<uintptr_t>(self.*member); },
      [member](Class& self, uintptr_t address) {
        self.*member = reinterpret_cast<Pointer>(address);  // NOLINT(performance-no-int-to-ptr)
      });
}

// The names Fields<Class> lists, as interned Python strings in its order (made once, kept for the process):
// keyword lookups by these hit the keyword dict's cached hashes.
template <typename Class>
const std::vector<PyObject*>& interned_field_names() {
  static const std::vector<PyObject*> names = [] {
    std::vector<PyObject*> result;
    Fields<Class>::visit(
        [&result](const char* name, auto) { result.push_back(PyUnicode_InternFromString(name)); });
    return result;
  }();
  return names;
}

// Class(**fields) for Fields<Class>: one Python call sets every field given by keyword (pointers as ints),
// the others keep their defaults. The per-call structs of the torch layer are built this way: one call
// instead of one attribute assignment per field. An unknown keyword or a value of the wrong type raises
// TypeError naming the field.
template <typename Class>
Class from_field_kwargs(const py::kwargs& kwargs) {
  const std::vector<PyObject*>& names = interned_field_names<Class>();
  Class value{};
  size_t index = 0;
  py::ssize_t num_used = 0;
  Fields<Class>::visit([&](const char* name, auto member) {
    PyObject* item = PyDict_GetItem(kwargs.ptr(), names[index++]);  // borrowed; null when not given
    if (item == nullptr) return;
    ++num_used;
    using Member = std::remove_reference_t<decltype(std::declval<Class&>().*member)>;
    try {
      if constexpr (std::is_pointer_v<Member>) {
        value.*member = to_pointer<Member>(py::cast<uintptr_t>(py::handle(item)));
      } else {
        value.*member = py::cast<Member>(py::handle(item));
      }
    } catch (const py::cast_error&) {
      throw py::type_error(std::string(name) + ": cannot take a " + Py_TYPE(item)->tp_name);
    }
  });
  if (num_used != PyDict_Size(kwargs.ptr())) {
    for (const auto& item : kwargs) {
      const std::string key = py::str(item.first);
      bool known = false;
      Fields<Class>::visit([&](const char* name, auto) { known = known || key == name; });
      if (!known) throw py::type_error("unknown field " + key);
    }
  }
  return value;
}

// Every field Fields<Class> lists (epx/fields.hpp): pointers as int properties, the rest as values;
// and the keyword constructor Class(**fields) (from_field_kwargs), which also serves Class().
template <typename Class>
void def_fields(py::class_<Class>& cls) {
  cls.def(py::init([](const py::kwargs& kwargs) { return from_field_kwargs<Class>(kwargs); }));
  Fields<Class>::visit([&cls](const char* name, auto member) {
    using Member = std::remove_reference_t<decltype(std::declval<Class&>().*member)>;
    if constexpr (std::is_pointer_v<Member>) {
      def_pointer(cls, name, member);
    } else {
      cls.def_readwrite(name, member);
    }
  });
}

// Raises a C++ exception caught by call_without_gil as the Python exception it maps to; needs the GIL.
// epx::Error becomes epx.EpxError (set here, then thrown as py::error_already_set, so no exception
// translator is involved); any other exception is rethrown to pybind11's own translation.
[[noreturn]] void raise_cpp_exception(std::exception_ptr error);

// Runs f() with the GIL released and returns its result once the GIL is held again. Use it instead of
// py::call_guard<py::gil_scoped_release> for C++ calls that can throw: an exception f throws is caught while
// the GIL is still released (as a std::exception_ptr: C++ only, no Python object) and raised as the Python
// exception only after the GIL is back, so no C++ exception unwinds out of a GIL-released region and no
// Python error is built there. f must not touch Python objects.
template <typename F>
auto call_without_gil(F&& f) -> std::invoke_result_t<F&> {
  using Result = std::invoke_result_t<F&>;
  std::exception_ptr error;
  if constexpr (std::is_void_v<Result>) {
    {
      py::gil_scoped_release release;
      try {
        f();
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) raise_cpp_exception(std::move(error));
  } else {
    std::optional<Result> result;
    {
      py::gil_scoped_release release;
      try {
        result.emplace(f());
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) raise_cpp_exception(std::move(error));
    return std::move(*result);
  }
}

// Parts of the module, one translation unit each (they compile in parallel).
void bind_core(py::module_& m);       // errors, constants, Config, size hints, buffer maps, bootstrap bridge
void bind_reference(py::module_& m);  // the CPU reference and its seeded test data
void bind_runtime(py::module_& m);    // Buffer, Event, normal and low-latency calls (EPX_WITH_CUDA only)
void bind_native_calls(py::module_& m);  // the table the torch extension calls through (EPX_WITH_CUDA only)

}  // namespace epx::python
