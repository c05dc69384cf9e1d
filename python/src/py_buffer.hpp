#pragma once

// The Python-facing Buffer of `epx._epx` (runtime.cpp binds it; native_calls.cpp takes it from Python too).

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

#include "epx/buffer.hpp"
#include "py_bootstrap.hpp"

namespace epx::python {

// The Python-facing Buffer: owns its bootstrap bridge (the C++ Buffer keeps a reference to it).
class PyBuffer {
 public:
  PyBuffer(int rank, int num_ranks, py::object all_gather, py::object barrier, const BufferOptions& options)
      : bootstrap_(std::make_unique<PyBootstrap>(rank, num_ranks, std::move(all_gather), std::move(barrier))),
        buffer_(std::make_unique<Buffer>(*bootstrap_, options)) {}

  // Collected without destroy() (a finalizer, or the interpreter's exit): free this rank's memory without
  // meeting the peers. A collective here could hang: peers collect their objects at other times, or never.
  ~PyBuffer() {
    if (buffer_) buffer_->release();
  }
  PyBuffer(const PyBuffer&) = delete;
  PyBuffer& operator=(const PyBuffer&) = delete;
  Buffer& get() const { return *buffer_; }  // throws on use after destroy (Buffer::live)

 private:
  std::unique_ptr<PyBootstrap> bootstrap_;  // declared first: destroyed after the Buffer that uses it
  std::unique_ptr<Buffer> buffer_;
};

}  // namespace epx::python
