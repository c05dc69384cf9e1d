// Host-only part of the binding: the exception type, constants, Config, buffer size hints, buffer maps and
// the bridge that lets a Python process group act as an epx::Bootstrap. Needs no GPU and no CUDA.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_bytes.hpp"
#include "binding.hpp"
#include "buffer_map/low_latency_buffer_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "py_bootstrap.hpp"

namespace epx::python {

namespace {

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// ---- Tensor views of memory the runtime owns, as DLPack capsules ----
//
// DLPack's C ABI (dlpack.h, v0.x "dltensor" capsules), the few structs a producer needs: torch's from_dlpack
// builds a tensor on the memory in one C call (the __cuda_array_interface__ path parses a dict, asks the
// driver which device a pointer is on and needs two view ops after). The binding stays torch-free.
struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// What a view keeps: its shape and a reference to the Python object that owns the memory.
struct DeviceViewContext {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  PyObject* owner = nullptr;
};

// Called by the consumer (any thread, with or without the GIL) once the tensor is freed, or by the capsule's
// destructor when no consumer took it.
void release_device_view(DLManagedTensor* managed) {
  auto* context = static_cast<DeviceViewContext*>(managed->manager_ctx);
  if (context->owner != nullptr && Py_IsInitialized() && !python_finalizing()) {
    const PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(context->owner);
    PyGILState_Release(state);
  }
  delete context;
}

// A "dltensor" capsule over `address` of `shape` elements of (code, bits), on (device_type, device_id),
// keeping `owner` alive while a tensor uses it.
py::capsule device_view_capsule(uintptr_t address, int code, int bits, const std::vector<int64_t>& shape,
                                int device_type, int device_id, const py::object& owner) {
  auto context = std::make_unique<DeviceViewContext>();
  context->shape = shape;
  DLTensor& tensor = context->managed.dl_tensor;
  tensor.data = to_pointer<void*>(address);
  tensor.device = DLDevice{device_type, device_id};
  tensor.ndim = static_cast<int32_t>(context->shape.size());
  tensor.dtype = DLDataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  tensor.shape = context->shape.data();
  tensor.strides = nullptr;
  tensor.byte_offset = 0;
  context->managed.manager_ctx = context.get();
  context->managed.deleter = release_device_view;
  context->owner = owner.inc_ref().ptr();
  DLManagedTensor* managed = &context.release()->managed;
  return py::capsule(managed, "dltensor", [](PyObject* capsule) {
    // A consumer renames the capsule "used_dltensor" and owns the tensor; otherwise it is freed here.
    if (PyCapsule_IsValid(capsule, "dltensor")) {
      auto* unused = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
      unused->deleter(unused);
    }
  });
}

// "TypeName: message" of a Python exception (what() would append the traceback).
std::string describe(const py::error_already_set& error) {
  return std::string(py::str(error.type().attr("__name__"))) + ": " + std::string(py::str(error.value()));
}

// epx::Error -> epx.EpxError (a RuntimeError): str() is the C++ what() ("file:line: message"); the attributes
// file, line and message carry its parts. Created with the C API so the class has these attributes (None)
// even when Python code raises it. The module holds a reference, and so does error_type (never released:
// the class lives as long as the interpreter).
PyObject* error_type = nullptr;

// Sets attribute `name` of `object` to `value` (a new reference, may be null); false with a Python error set.
bool set_new_attr(PyObject* object, const char* name, PyObject* value) {
  if (value == nullptr) return false;
  const int status = PyObject_SetAttrString(object, name, value);
  Py_DECREF(value);
  return status == 0;
}

PyObject* utf8(const std::string& text) {
  // "replace": a message with bytes that are not UTF-8 still reaches Python.
  return PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
}

// Sets the current Python error to an epx.EpxError built from `error`. Needs the GIL; never throws: if the
// instance can not be built, a plain EpxError (or RuntimeError before the class exists) with what() is set.
void set_epx_error(const epx::Error& error) noexcept {
  PyObject* const type = error_type != nullptr ? error_type : PyExc_RuntimeError;
  const std::string what = error.what();
  PyObject* const text = utf8(what);
  PyObject* const instance = text != nullptr ? PyObject_CallOneArg(type, text) : nullptr;
  Py_XDECREF(text);
  if (instance == nullptr) {
    PyErr_Clear();
    PyErr_SetString(type, what.c_str());
    return;
  }
  if (type == error_type) {
    const bool ok = set_new_attr(instance, "file", utf8(error.file())) &&
                    set_new_attr(instance, "line", PyLong_FromLong(error.line())) &&
                    set_new_attr(instance, "message", utf8(error.message()));
    if (!ok) PyErr_Clear();  // the parts stay None; str() still has the whole message
  }
  PyErr_SetObject(type, instance);
  Py_DECREF(instance);
}

void register_error(py::module_& m) {
  py::dict attributes;
  attributes["__doc__"] = py::str(
      "Every failure EPX reports: an argument check (naming the argument, its value and the rule), a CUDA "
      "error, or a device-side wait timeout. str() is the C++ message with its source location; file, line "
      "and message are its parts (None when raised from Python).");
  attributes["file"] = py::none();
  attributes["line"] = py::none();
  attributes["message"] = py::none();
  error_type = PyErr_NewException("epx._epx.EpxError", PyExc_RuntimeError, attributes.ptr());
  if (error_type == nullptr) throw py::error_already_set();
  m.add_object("EpxError", py::handle(error_type));  // the module keeps a reference; so does error_type
  // Module-local: tried first for this module's calls, before (and never instead of) the translators other
  // pybind11 modules register process-wide (torch's, when both share pybind11's internals), and never run
  // for their exceptions. pybind11 calls translators with the GIL held; it is taken here if not, defensively.
  py::register_local_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const epx::Error& error) {
      if (PyGILState_Check()) {
        set_epx_error(error);
      } else {
        const PyGILState_STATE gil = PyGILState_Ensure();
        set_epx_error(error);
        PyGILState_Release(gil);
      }
    }
  });
}

void bind_constants(py::module_& m) {
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_NVL_RANKS") = kMaxNvlRanks;
  m.attr("MAX_CHANNELS") = kMaxChannels;
  m.attr("MAX_LOW_LATENCY_RANKS") = kMaxLowLatencyRanks;
  m.attr("MAX_LOW_LATENCY_TOKENS_PER_RANK") = kMaxLowLatencyTokensPerRank;
  m.attr("LOW_LATENCY_SIZE_HINT_ALIGN") = kLowLatencySizeHintAlign;
}

// epx::Config: the settings of normal-mode calls (SM budget, send chunk, queue tokens), DeepEP V1's fields.
void bind_config(py::module_& m) {
  const Config defaults{};
  py::class_<Config>(m, "Config")
      .def(py::init([](int num_sms, int nvl_send, int nvl_recv, int rdma_send, int rdma_recv) {
             return Config{num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv};
           }),
           py::arg("num_sms") = defaults.num_sms,
           py::arg("num_max_nvl_chunked_send_tokens") = defaults.num_max_nvl_chunked_send_tokens,
           py::arg("num_max_nvl_chunked_recv_tokens") = defaults.num_max_nvl_chunked_recv_tokens,
           py::arg("num_max_rdma_chunked_send_tokens") = defaults.num_max_rdma_chunked_send_tokens,
           py::arg("num_max_rdma_chunked_recv_tokens") = defaults.num_max_rdma_chunked_recv_tokens,
           "Not checked here: validate_config, the size hints and Buffer.config check it.")
      .def_readwrite("num_sms", &Config::num_sms)
      .def_readwrite("num_max_nvl_chunked_send_tokens", &Config::num_max_nvl_chunked_send_tokens)
      .def_readwrite("num_max_nvl_chunked_recv_tokens", &Config::num_max_nvl_chunked_recv_tokens)
      .def_readwrite("num_max_rdma_chunked_send_tokens", &Config::num_max_rdma_chunked_send_tokens)
      .def_readwrite("num_max_rdma_chunked_recv_tokens", &Config::num_max_rdma_chunked_recv_tokens)
      .def("num_channels", &Config::num_channels, "num_sms / 2 (at least 1): the channels of a call.")
      .def("get_nvl_buffer_size_hint", &Config::get_nvl_buffer_size_hint, py::arg("hidden_bytes"),
           py::arg("num_ranks"),
           "NVLink buffer bytes per rank for normal-mode calls with this config (rows of up to hidden_bytes, "
           "up "
           "to 16 top-k); independent of the token count.")
      .def("get_rdma_buffer_size_hint", &Config::get_rdma_buffer_size_hint, py::arg("hidden_bytes"),
           py::arg("num_ranks"), py::arg("ranks_per_node") = 0,
           "Symmetric-buffer bytes per rank for normal-mode calls across nodes with this config (nodes of "
           "ranks_per_node ranks; 0: one node up to 8 ranks, nodes of 8 above); 0 within one node. "
           "Independent "
           "of the token count.")
      .def("__eq__",
           [](const Config& a, const Config& b) {
             return a.num_sms == b.num_sms &&
                    a.num_max_nvl_chunked_send_tokens == b.num_max_nvl_chunked_send_tokens &&
                    a.num_max_nvl_chunked_recv_tokens == b.num_max_nvl_chunked_recv_tokens &&
                    a.num_max_rdma_chunked_send_tokens == b.num_max_rdma_chunked_send_tokens &&
                    a.num_max_rdma_chunked_recv_tokens == b.num_max_rdma_chunked_recv_tokens;
           })
      .def("__repr__", [](const Config& c) {
        return detail::concat("_epx.Config(num_sms=", c.num_sms,
                              ", num_max_nvl_chunked_send_tokens=", c.num_max_nvl_chunked_send_tokens,
                              ", num_max_nvl_chunked_recv_tokens=", c.num_max_nvl_chunked_recv_tokens,
                              ", num_max_rdma_chunked_send_tokens=", c.num_max_rdma_chunked_send_tokens,
                              ", num_max_rdma_chunked_recv_tokens=", c.num_max_rdma_chunked_recv_tokens, ")");
      });
  m.def(
      "recommended_config",
      [](const std::string& op, int num_ranks, int num_sms, const std::string& gpu_kind) {
        EPX_CHECK(op == "dispatch" || op == "combine", "op", op, "must be dispatch or combine");
        const GpuKind kind = gpu_kind_of(gpu_kind);
        EPX_CHECK(gpu_kind == gpu_kind_name(kind), "gpu_kind", gpu_kind, "must be H100, H200 or other");
        return recommended_config(op == "dispatch" ? ConfigFor::kDispatch : ConfigFor::kCombine, num_ranks,
                                  num_sms, kind);
      },
      py::arg("op"), py::arg("num_ranks"), py::arg("num_sms"), py::arg("gpu_kind") = "other",
      "DeepEP's recommended config for `op` and the group size with num_sms (Config's defaults where DeepEP "
      "has none), with EPX's measured chunks at 2 ranks for the GPU kind (Buffer.gpu_kind): what a Buffer "
      "within one node starts with, and what epx-bench runs.");
  m.def(
      "validate_config", &validate_config, py::arg("config"),
      "Raises EpxError naming the first field that breaks a rule (>= 1; send chunk <= queue tokens; at most "
      "128 channels).");
}

void bind_size_hints(py::module_& m) {
  m.def(
      "normal_nvl_buffer_size_hint", &normal_nvl_buffer_size_hint, py::arg("hidden_bytes"),
      py::arg("num_ranks"), py::arg("config") = Config{},
      "NVLink buffer bytes per rank for normal-mode calls with `config` (Config.get_nvl_buffer_size_hint): "
      "the queues of (num_ranks - 1) sources x num_sms / 2 channels x num_max_nvl_chunked_recv_tokens "
      "records "
      "of the largest record for hidden_bytes (= hidden * 2), plus the control and notify areas; a multiple "
      "of 128. Independent of the token count.");
  m.def("get_low_latency_rdma_size_hint", &get_low_latency_rdma_size_hint,
        py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
        py::arg("num_experts"), "Low-latency buffer bytes per rank; a multiple of 2 MiB.");
}

// The benchmarks' byte counts (bench/bench_bytes.hpp), so python -m epx_tools.bench counts what epx-bench
// counts.
void bind_bench_bytes(py::module_& m) {
  m.def("normal_row_bytes", &normal_row_bytes, py::arg("hidden"), py::arg("fp8"));
  m.def(
      "low_latency_selection_bytes",
      [](int hidden, const std::string& format) {
        if (format == "fp8") return low_latency_selection_bytes(hidden, WireFormat::kFp8);
        if (format == "bf16") return low_latency_selection_bytes(hidden, WireFormat::kBf16);
        if (format == "logfmt") return low_latency_selection_bytes(hidden, WireFormat::kLogFmt);
        throw py::value_error("unknown low-latency format '" + format + "' (fp8, bf16 or logfmt)");
      },
      py::arg("hidden"), py::arg("format"));
}

void bind_normal_buffer_map(py::module_& m) {
  py::class_<NormalShape>(m, "NormalShape")
      .def(py::init(
               [](int num_ranks, int num_experts, int hidden, int x_row_bytes, int num_scales, int num_topk) {
                 return NormalShape{num_ranks, num_experts, hidden, x_row_bytes, num_scales, num_topk};
               }),
           py::arg("num_ranks"), py::arg("num_experts"), py::arg("hidden"), py::arg("x_row_bytes"),
           py::arg("num_scales") = 0, py::arg("num_topk") = 0)
      .def_readwrite("num_ranks", &NormalShape::num_ranks)
      .def_readwrite("num_experts", &NormalShape::num_experts)
      .def_readwrite("hidden", &NormalShape::hidden)
      .def_readwrite("x_row_bytes", &NormalShape::x_row_bytes)
      .def_readwrite("num_scales", &NormalShape::num_scales)
      .def_readwrite("num_topk", &NormalShape::num_topk);
  m.def("validate_normal_shape", &validate_normal_shape, py::arg("shape"));

  m.def(
      "channel_token_range",
      [](int num_tokens, int num_channels, int channel) {
        const TokenRange range = channel_token_range(num_tokens, num_channels, channel);
        return py::make_tuple(range.begin, range.end);
      },
      py::arg("num_tokens"), py::arg("num_channels"), py::arg("channel"),
      "(begin, end) of the tokens of a rank's batch that `channel` carries.");

  py::class_<NormalRecord>(m, "NormalRecord")
      .def(py::init(
               [](int x_bytes, int num_scales, int num_topk_idx, int num_topk_weights, bool with_src_idx) {
                 return NormalRecord{x_bytes, num_scales, num_topk_idx, num_topk_weights, with_src_idx};
               }),
           py::arg("x_bytes"), py::arg("num_scales") = 0, py::arg("num_topk_idx") = 0,
           py::arg("num_topk_weights") = 0, py::arg("with_src_idx") = false)
      .def_readwrite("x_bytes", &NormalRecord::x_bytes)
      .def_readwrite("num_scales", &NormalRecord::num_scales)
      .def_readwrite("num_topk_idx", &NormalRecord::num_topk_idx)
      .def_readwrite("num_topk_weights", &NormalRecord::num_topk_weights)
      .def_readwrite("with_src_idx", &NormalRecord::with_src_idx)
      .def("scales_offset", &NormalRecord::scales_offset)
      .def("topk_idx_offset", &NormalRecord::topk_idx_offset)
      .def("topk_weights_offset", &NormalRecord::topk_weights_offset)
      .def("src_idx_offset", &NormalRecord::src_idx_offset)
      .def("bytes", &NormalRecord::bytes, "Bytes of one record (a multiple of 16).")
      .def_static("dispatch", &NormalRecord::dispatch, py::arg("shape"))
      .def_static("combine", &NormalRecord::combine, py::arg("hidden"), py::arg("num_topk"))
      .def_static(
          "largest", &NormalRecord::largest, py::arg("hidden_bytes"),
          "The largest record of any call with rows of up to hidden_bytes (what the size hint uses).");

  py::class_<NormalBufferMap>(m, "NormalBufferMap")
      .def_static("of", &NormalBufferMap::of, py::arg("num_ranks"), py::arg("config"), py::arg("record"),
                  "The map of a call with `config` and records of `record` on num_ranks ranks.")
      .def_readonly("num_ranks", &NormalBufferMap::num_ranks)
      .def_readonly("num_channels", &NormalBufferMap::num_channels)
      .def_readonly("queue_tokens", &NormalBufferMap::queue_tokens)
      .def_readonly("record_bytes", &NormalBufferMap::record_bytes)
      .def_property_readonly_static("CONTROL_OFFSET",
                                    [](py::object) { return NormalBufferMap::kControlOffset; })
      .def_property_readonly_static("COUNTERS_OFFSET",
                                    [](py::object) { return NormalBufferMap::kCountersOffset; })
      .def_property_readonly_static("NOTIFY_OFFSET",
                                    [](py::object) { return NormalBufferMap::kNotifyOffset; })
      .def_property_readonly_static("NOTIFY_HALF_BYTES",
                                    [](py::object) { return NormalBufferMap::kNotifyHalfBytes; })
      .def_property_readonly_static("DIRECT_OFFSET",
                                    [](py::object) { return NormalBufferMap::kDirectOffset; })
      .def_property_readonly_static("QUEUES_OFFSET",
                                    [](py::object) { return NormalBufferMap::kQueuesOffset; })
      .def_static("source_slot", &NormalBufferMap::source_slot, py::arg("src"), py::arg("owner"))
      .def("queue_bytes", &NormalBufferMap::queue_bytes)
      .def("total_bytes", &NormalBufferMap::total_bytes);
  m.def("check_normal_map_fits", &check_normal_map_fits, py::arg("buffer_map"), py::arg("buffer_bytes"),
        "Raises EpxError naming the bytes needed when buffer_map does not fit buffer_bytes.");
}

void bind_low_latency_buffer_map(py::module_& m) {
  py::class_<LowLatencyBufferMap>(m, "LowLatencyBufferMap")
      .def(py::init<int, int, int, int>(), py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"),
           py::arg("num_ranks"), py::arg("num_experts"))
      .def_readonly("num_max_tokens", &LowLatencyBufferMap::num_max_tokens)
      .def_readonly("hidden", &LowLatencyBufferMap::hidden)
      .def_readonly("num_ranks", &LowLatencyBufferMap::num_ranks)
      .def_readonly("num_experts", &LowLatencyBufferMap::num_experts)
      .def("num_local_experts", &LowLatencyBufferMap::num_local_experts)
      .def("num_groups", &LowLatencyBufferMap::num_groups)
      .def("num_recv_rows", &LowLatencyBufferMap::num_recv_rows)
      .def("dispatch_msg_bytes", &LowLatencyBufferMap::dispatch_msg_bytes)
      .def("combine_slot_bytes", &LowLatencyBufferMap::combine_slot_bytes)
      .def("control_end_offset", &LowLatencyBufferMap::control_end_offset)
      .def("combine_send_offset", &LowLatencyBufferMap::combine_send_offset)
      .def("combine_send_bytes", &LowLatencyBufferMap::combine_send_bytes)
      .def("half_bytes", &LowLatencyBufferMap::half_bytes)
      .def("half_offset", &LowLatencyBufferMap::half_offset, py::arg("half"))
      .def("listings_half_bytes", &LowLatencyBufferMap::listings_half_bytes)
      .def("listings_offset", &LowLatencyBufferMap::listings_offset, py::arg("half"))
      .def("total_bytes", &LowLatencyBufferMap::total_bytes)
      .def(
          "recv_flag_offset",
          [](const LowLatencyBufferMap& self, int half, int op, int src_rank) {
            return self.recv_flag_offset(half, static_cast<LowLatencyOp>(op), src_rank);
          },
          py::arg("half"), py::arg("op"), py::arg("src_rank"))
      .def("dispatch_recv_count_offset", &LowLatencyBufferMap::dispatch_recv_count_offset, py::arg("half"),
           py::arg("local_expert"), py::arg("src_rank"))
      .def("dispatch_recv_msg_offset", &LowLatencyBufferMap::dispatch_recv_msg_offset, py::arg("half"),
           py::arg("src_rank"), py::arg("token"))
      .def("combine_recv_slot_offset", &LowLatencyBufferMap::combine_recv_slot_offset, py::arg("half"),
           py::arg("token"), py::arg("topk_pos"));
}

// Runs one all_gather and one barrier through a PyBootstrap: lets the CPU tests check the bridge (payload
// order, size checks, callback errors) without a GPU.
py::bytes bootstrap_round_trip(int rank, int num_ranks, py::object all_gather, py::object barrier,
                               const std::string& payload) {
  PyBootstrap bootstrap(rank, num_ranks, std::move(all_gather), std::move(barrier));
  const std::vector<std::byte> gathered = bootstrap.all_gather(payload.data(), payload.size());
  bootstrap.barrier();
  return py::bytes(reinterpret_cast<const char*>(gathered.data()), gathered.size());
}

// Testing aids for the exception path of GIL-released calls (see bind_core): throw what `error` names after
// sleeping sleep_ms, or return 42.
int throw_for_test(const std::string& error, const std::string& message, int sleep_ms) {
  if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  if (error.empty()) return 42;
  if (error == "epx") EPX_FAIL(message);
  if (error == "invalid_argument") throw std::invalid_argument(message);
  if (error == "bad_alloc") throw std::bad_alloc();
  throw std::logic_error("unknown error kind '" + error + "'");
}

}  // namespace

void raise_cpp_exception(std::exception_ptr error) {
  try {
    std::rethrow_exception(std::move(error));
  } catch (const epx::Error& epx_error) {
    set_epx_error(epx_error);
  }
  // Only an epx::Error gets here (others left the catch above for pybind11's translators): its Python error
  // is set; error_already_set hands it to pybind11, which restores it without consulting any translator.
  throw py::error_already_set();
}

PyBootstrap::PyBootstrap(int rank, int num_ranks, py::object all_gather, py::object barrier)
    : rank_(rank), num_ranks_(num_ranks), all_gather_(std::move(all_gather)), barrier_(std::move(barrier)) {
  EPX_CHECK(num_ranks_ >= 1, "num_ranks", num_ranks_, "must be >= 1");
  EPX_CHECK(rank_ >= 0, "rank", rank_, "must be >= 0");
  EPX_CHECK(rank_ < num_ranks_, "rank", rank_, "must be < num_ranks");
  EPX_CHECK(PyCallable_Check(all_gather_.ptr()), "all_gather", "not callable",
            "must be a callable taking bytes and returning one bytes per rank");
  EPX_CHECK(PyCallable_Check(barrier_.ptr()), "barrier", "not callable", "must be a callable");
}

PyBootstrap::~PyBootstrap() {
  if (python_finalizing()) {
    // Dropping references then could run arbitrary finalizers on a half-torn-down interpreter.
    all_gather_.release();
    barrier_.release();
    return;
  }
  py::gil_scoped_acquire gil;
  all_gather_ = py::object();
  barrier_ = py::object();
}

std::vector<std::byte> PyBootstrap::all_gather(const void* data, size_t bytes) {
  if (python_finalizing()) EPX_FAIL("bootstrap all_gather: the Python interpreter is shutting down");
  py::gil_scoped_acquire gil;
  std::vector<std::byte> gathered(bytes * num_ranks_);
  try {
    py::object result = all_gather_(py::bytes(static_cast<const char*>(data), bytes));
    EPX_CHECK(PySequence_Check(result.ptr()) && !PyBytes_Check(result.ptr()), "all_gather result",
              std::string(py::str(py::type::of(result))),
              "must be a sequence with one bytes object per rank");
    const py::sequence parts = py::reinterpret_borrow<py::sequence>(result);
    EPX_CHECK(static_cast<int>(parts.size()) == num_ranks_, "all_gather result length", parts.size(),
              detail::concat("must equal num_ranks (", num_ranks_, ")").c_str());
    for (int r = 0; r < num_ranks_; ++r) {
      const py::object part = parts[r];
      Py_buffer view;
      if (PyObject_GetBuffer(part.ptr(), &view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        EPX_FAIL("bootstrap all_gather: the payload of rank ", r, " is a ",
                 std::string(py::str(py::type::of(part))), ", not bytes");
      }
      const size_t part_bytes = static_cast<size_t>(view.len);
      if (part_bytes == bytes && bytes > 0) std::memcpy(gathered.data() + r * bytes, view.buf, bytes);
      PyBuffer_Release(&view);
      if (part_bytes != bytes) {
        EPX_FAIL("bootstrap all_gather: rank ", r, " sent ", part_bytes, " bytes but rank ", rank_, " sent ",
                 bytes, " (every rank must pass the same count)");
      }
    }
  } catch (py::error_already_set& error) {
    EPX_FAIL("bootstrap all_gather: the Python callback raised ", describe(error));
  }
  return gathered;
}

void PyBootstrap::barrier() {
  if (python_finalizing()) EPX_FAIL("bootstrap barrier: the Python interpreter is shutting down");
  py::gil_scoped_acquire gil;
  try {
    barrier_();
  } catch (py::error_already_set& error) {
    EPX_FAIL("bootstrap barrier: the Python callback raised ", describe(error));
  }
}

void bind_core(py::module_& m) {
  register_error(m);
  bind_constants(m);
  bind_config(m);
  bind_size_hints(m);
  bind_bench_bytes(m);
  bind_normal_buffer_map(m);
  bind_low_latency_buffer_map(m);
  m.def("device_view_capsule", &device_view_capsule, py::arg("address"), py::arg("code"), py::arg("bits"),
        py::arg("shape"), py::arg("device_type"), py::arg("device_id"), py::arg("owner"),
        "A DLPack capsule (\"dltensor\") over device memory at `address`: `shape` elements of DLPack type "
        "(code, "
        "bits), compact, on DLPack device (device_type, device_id); the tensor made from it keeps `owner` "
        "alive.");
  m.def("_bootstrap_round_trip", &bootstrap_round_trip, py::arg("rank"), py::arg("num_ranks"),
        py::arg("all_gather"), py::arg("barrier"), py::arg("payload"),
        "Testing aid: one all_gather of payload and one barrier through the Python bootstrap bridge; returns "
        "the gathered bytes.");

  // Testing aids for how a C++ exception reaches Python from each kind of call: with the GIL held (the
  // exception translator), through py::call_guard<py::gil_scoped_release>, and through call_without_gil (how
  // every GIL-releasing binding calls C++). error: "" (returns 42), "epx", "invalid_argument", "bad_alloc".
  const auto doc =
      "Testing aid: sleeps sleep_ms, then raises the C++ exception `error` names, or returns 42.";
  m.def("_throw_with_gil", &throw_for_test, py::arg("error"), py::arg("message") = "",
        py::arg("sleep_ms") = 0, doc);
  m.def("_throw_call_guard", &throw_for_test, py::arg("error"), py::arg("message") = "",
        py::arg("sleep_ms") = 0, py::call_guard<py::gil_scoped_release>(), doc);
  m.def(
      "_throw_without_gil",
      [](const std::string& error, const std::string& message, int sleep_ms) {
        return call_without_gil([&] { return throw_for_test(error, message, sleep_ms); });
      },
      py::arg("error"), py::arg("message") = "", py::arg("sleep_ms") = 0, doc);
}

}  // namespace epx::python
