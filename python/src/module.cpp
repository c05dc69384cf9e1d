// epx._epx: the pybind11 module over the EPX C++ API. It takes raw device pointers, shapes, dtype codes and
// stream/event handles as ints, so it builds without torch; the epx Python package wraps it with torch.

#include <pybind11/pybind11.h>

#include "binding.hpp"

#ifndef EPX_VERSION
#define EPX_VERSION "0.0.0"
#endif

PYBIND11_MODULE(_epx, m) {
  namespace py = pybind11;
  m.doc() = "EPX MoE all-to-all dispatch/combine: the C++ API on raw pointers (use the epx package instead)";
  m.attr("__version__") = EPX_VERSION;
  epx::python::bind_core(m);
  py::module_ reference = m.def_submodule("reference", "The CPU reference (the tests' oracle) and test data");
  epx::python::bind_reference(reference);
  // Whether low-latency groups may span nodes (BufferOptions.ranks_per_node < num_ranks).
#if defined(EPX_HAVE_NVSHMEM)
  m.attr("WITH_NVSHMEM") = true;
#else
  m.attr("WITH_NVSHMEM") = false;
#endif
#if defined(EPX_WITH_CUDA)
  m.attr("WITH_CUDA") = true;
  epx::python::bind_runtime(m);
  epx::python::bind_native_calls(m);
#else
  m.attr("WITH_CUDA") = false;
#endif
}
