#pragma once

// Shared helpers of the `epx._epx` extension. The binding speaks in plain values: device pointers, streams
// and events are Python ints, host arrays are numpy arrays; torch lives only in the Python package above it.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace epx::python {

namespace py = pybind11;

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

template <typename Pointer>
Pointer to_pointer(uintptr_t address) {
  return reinterpret_cast<Pointer>(address);  // NOLINT(performance-no-int-to-ptr)
}

// Parts of the module, one translation unit each (they compile in parallel).
void bind_core(py::module_& m);       // errors, constants, size hints, layouts, the bootstrap bridge
void bind_reference(py::module_& m);  // the CPU reference and its seeded test data
void bind_runtime(py::module_& m);    // Buffer, Event, normal and low-latency calls (EPX_WITH_CUDA only)

}  // namespace epx::python
