// The table of calls `epx._epx` lends to the torch extension (native_calls.hpp says why), exposed as the
// capsule `_epx._native_calls`.

#include "native_calls.hpp"

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "core/host_steps.hpp"
#include "epx/error.hpp"
#include "epx/low_latency.hpp"
#include "epx/normal.hpp"
#include "py_buffer.hpp"

namespace epx::python {

namespace {

// Runs f (which needs the GIL and may throw) and turns what it throws into the Python error `_epx`'s own
// functions would raise; `failed` is what the call returns then.
template <typename F, typename Result>
Result with_python_error(F&& f, Result failed) noexcept {
  try {
    return f();
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "epx: unknown C++ exception");
  }
  return failed;
}

int low_latency_dispatch_sizes_call(PyObject* buffer, const LowLatencyDispatchInput& input,
                                    LowLatencyDispatchSizes* sizes) {
  return with_python_error(
      [&] {
        const PyBuffer& owner = py::handle(buffer).cast<const PyBuffer&>();
        *sizes = call_without_gil([&] { return low_latency_dispatch_sizes(owner.get(), input); });
        return 0;
      },
      -1);
}

PyObject* low_latency_dispatch_call(PyObject* buffer, const LowLatencyDispatchInput& input,
                                    const LowLatencyDispatchOutput& output, const StreamOrder& order) {
  return with_python_error(
      [&] {
        PyBuffer& owner = py::handle(buffer).cast<PyBuffer&>();
        return py::cast(
                   call_without_gil([&] { return low_latency_dispatch(owner.get(), input, output, order); }))
            .release()
            .ptr();
      },
      static_cast<PyObject*>(nullptr));
}

PyObject* low_latency_combine_call(PyObject* buffer, PyObject* handle, const LowLatencyCombineInput& input,
                                   void* combined_x, const StreamOrder& order) {
  return with_python_error(
      [&] {
        PyBuffer& owner = py::handle(buffer).cast<PyBuffer&>();
        const LowLatencyHandle& native_handle = py::handle(handle).cast<const LowLatencyHandle&>();
        return py::cast(call_without_gil([&] {
                 return low_latency_combine(owner.get(), native_handle, input, combined_x, order);
               }))
            .release()
            .ptr();
      },
      static_cast<PyObject*>(nullptr));
}

PyObject* dispatch_cached_call(PyObject* buffer, PyObject* handle, const DispatchInput& input,
                               const DispatchOutput& output, int rows, const StreamOrder& order) {
  return with_python_error(
      [&] {
        PyBuffer& owner = py::handle(buffer).cast<PyBuffer&>();
        const DispatchHandle& cached = py::handle(handle).cast<const DispatchHandle&>();
        Event event = call_without_gil([&] {
          // As epx.Buffer.dispatch does for a cached handle: the receive goes out with the count exchange.
          const DispatchPlan plan =
              dispatch_notify(owner.get(), input, order, &cached, DispatchOverlap::kLaunchReceive, nullptr);
          if (plan.num_recv_rows != rows) {
            dispatch_cancel(owner.get(), plan);  // the launched receive drains: the peers' calls complete
            throw Error(__FILE__, __LINE__,
                        "a cached dispatch planned " + std::to_string(plan.num_recv_rows) +
                            " rows where its handle has " + std::to_string(rows));
          }
          return dispatch_receive(owner.get(), plan, input, output, order);
        });
        return py::cast(std::move(event)).release().ptr();
      },
      static_cast<PyObject*>(nullptr));
}

PyObject* combine_call(PyObject* buffer, PyObject* handle, const CombineInput& input,
                       const CombineOutput& output, const StreamOrder& order) {
  return with_python_error(
      [&] {
        PyBuffer& owner = py::handle(buffer).cast<PyBuffer&>();
        const DispatchHandle& native_handle = py::handle(handle).cast<const DispatchHandle&>();
        return py::cast(call_without_gil(
                            [&] { return combine(owner.get(), native_handle, input, output, order); }))
            .release()
            .ptr();
      },
      static_cast<PyObject*>(nullptr));
}

// `values` as a Python list, through the C API: pybind's item assignment costs tens of ns an item, and a
// dispatch returns one count per local expert (144 at 288 experts on 2 ranks). A list left partly filled by
// an error frees cleanly (its empty items are null).
py::list int_list(const std::vector<int>& values) {
  PyObject* raw = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (raw == nullptr) throw py::error_already_set();
  py::list list = py::reinterpret_steal<py::list>(raw);
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLong(values[i]);
    if (item == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(raw, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyObject* dispatch_call(PyObject* buffer, const DispatchInput& input, const StreamOrder& order,
                        DispatchOverlap overlap, const DispatchOutputGuess* guess,
                        bool (*allocate)(void* context, int rows, DispatchOutput* outputs), void* context,
                        DispatchHandleArrays* arrays) {
  return with_python_error(
      [&]() -> PyObject* {
        const HostStep step("native dispatch_call");
        PyBuffer& owner = py::handle(buffer).cast<PyBuffer&>();
        DispatchPlan plan;
        DispatchOutput outputs = guess != nullptr ? guess->outputs : DispatchOutput{};
        bool allocated = true;
        // One GIL release for notify and receive: the GIL comes back in between only when the outputs are
        // allocated after the counts (not when the launched receive wrote into the guess). Each release is a
        // chance for another Python thread to take the GIL and keep it for its switch interval.
        Event event = call_without_gil([&] {
          plan = dispatch_notify(owner.get(), input, order, nullptr, overlap, guess);
          if (!plan.rows_in_guess) {
            const HostStep allocate_step("native dispatch_call: allocate outputs (torch)");
            const py::gil_scoped_acquire gil;
            allocated = allocate(context, plan.num_recv_rows, &outputs);
          }
          if (!allocated) {
            dispatch_cancel(owner.get(), plan);  // the launched receive drains
            return Event{};
          }
          return dispatch_receive(owner.get(), plan, input, outputs, order);
        });
        if (!allocated) return nullptr;
        const HostStep result_step("native dispatch_call: result");
        const int rows = plan.num_recv_rows;
        const bool rows_in_guess = plan.rows_in_guess;
        const DispatchHandle& handle = plan.handle;
        *arrays = {handle.deep_ep_matrices_device(), handle.recv_src_idx_device(),
                   handle.is_token_in_rank_device(), handle.send_head_device(), handle.num_channels()};
        py::list per_expert = int_list(plan.num_recv_tokens_per_expert);
        return py::make_tuple(std::move(plan.handle), rows, std::move(per_expert), rows_in_guess,
                              std::move(event))
            .release()
            .ptr();
      },
      static_cast<PyObject*>(nullptr));
}

PyObject* get_dispatch_layout_call(PyObject* buffer, const int64_t* topk_idx, int num_tokens, int num_topk,
                                   int num_experts, const DispatchLayoutOutput& output,
                                   const StreamOrder& order) {
  return with_python_error(
      [&] {
        PyBuffer& owner = py::handle(buffer).cast<PyBuffer&>();
        return py::cast(call_without_gil([&] {
                 return get_dispatch_layout(owner.get(), topk_idx, num_tokens, num_topk, num_experts, output,
                                            order);
               }))
            .release()
            .ptr();
      },
      static_cast<PyObject*>(nullptr));
}

// One table for the process (the capsule points at it; it never changes).
const NativeCalls kCalls{native_call_sizes(),
                         &low_latency_dispatch_sizes_call,
                         &low_latency_dispatch_call,
                         &low_latency_combine_call,
                         &dispatch_cached_call,
                         &combine_call,
                         &dispatch_call,
                         &get_dispatch_layout_call};

}  // namespace

void bind_native_calls(py::module_& m) {
  m.attr("_native_calls") = py::capsule(static_cast<const void*>(&kCalls), kNativeCallsCapsule);
}

}  // namespace epx::python
