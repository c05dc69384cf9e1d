#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <vector>

#include "epx/bootstrap.hpp"

namespace epx::python {

namespace py = pybind11;

// An epx::Bootstrap whose collectives call back into Python, so a Buffer can be built over any Python
// process group (the package passes torch.distributed's all_gather_object).
//   all_gather(payload: bytes) -> sequence of num_ranks bytes-like objects (rank r's payload at index r)
//   barrier() -> None
// A Python exception raised by a callback becomes an epx::Error naming the collective. The callbacks run with
// the GIL (taken if the calling C++ code released it); during interpreter shutdown they are not called and
// the collective fails instead, so a Buffer collected then frees its memory locally.
class PyBootstrap final : public Bootstrap {
 public:
  PyBootstrap(int rank, int num_ranks, py::object all_gather, py::object barrier);
  ~PyBootstrap() override;
  PyBootstrap(const PyBootstrap&) = delete;
  PyBootstrap& operator=(const PyBootstrap&) = delete;

  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  std::vector<std::byte> all_gather(const void* data, size_t bytes) override;
  void barrier() override;

 private:
  int rank_;
  int num_ranks_;
  py::object all_gather_;
  py::object barrier_;
};

}  // namespace epx::python
