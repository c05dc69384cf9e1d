// The CUDA runtime part of the binding: Buffer, Event and the normal / low-latency calls on raw device
// pointers (ints), streams and events (ints). Calls that may wait on the GPU or on peers release the GIL
// through call_without_gil (binding.hpp): their C++ errors become Python exceptions once the GIL is back.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>

#include "binding.hpp"
#include "epx/buffer.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "epx/event.hpp"
#include "epx/low_latency.hpp"
#include "epx/normal.hpp"
#include "py_buffer.hpp"

namespace epx::python {

namespace {

cudaStream_t stream_of(uintptr_t handle) {
  return to_pointer<cudaStream_t>(handle);
}

void bind_buffer(py::module_& m) {
  py::class_<BufferOptions> options(m, "BufferOptions");
  options
      .def(py::init([](size_t num_nvl_bytes, size_t num_rdma_bytes, int num_sms, double wait_timeout_s,
                       int ranks_per_node, uintptr_t comm_stream, bool enable_shrink) {
             return BufferOptions{.num_nvl_bytes = num_nvl_bytes,
                                  .num_rdma_bytes = num_rdma_bytes,
                                  .num_sms = num_sms,
                                  .wait_timeout_s = wait_timeout_s,
                                  .ranks_per_node = ranks_per_node,
                                  .comm_stream = reinterpret_cast<cudaStream_t>(comm_stream),
                                  .enable_shrink = enable_shrink};
           }),
           py::arg("num_nvl_bytes") = 0, py::arg("num_rdma_bytes") = 0, py::arg("num_sms") = 20,
           py::arg("wait_timeout_s") = 30.0, py::arg("ranks_per_node") = 0, py::arg("comm_stream") = 0,
           py::arg("enable_shrink") = false)
      .def_readwrite("num_nvl_bytes", &BufferOptions::num_nvl_bytes)
      .def_readwrite("num_nvl_output_bytes", &BufferOptions::num_nvl_output_bytes)
      .def_readwrite("num_nvl_staging_bytes", &BufferOptions::num_nvl_staging_bytes)
      .def_readwrite("num_rdma_bytes", &BufferOptions::num_rdma_bytes)
      .def_readwrite("num_sms", &BufferOptions::num_sms)
      .def_readwrite("wait_timeout_s", &BufferOptions::wait_timeout_s)
      .def_readwrite("ranks_per_node", &BufferOptions::ranks_per_node)
      .def_readwrite("enable_shrink", &BufferOptions::enable_shrink);

  // Construction and destroy() run collectives through the bootstrap callbacks: they keep the GIL.
  py::class_<PyBuffer>(m, "Buffer")
      .def(py::init<int, int, py::object, py::object, const BufferOptions&>(), py::arg("rank"),
           py::arg("num_ranks"), py::arg("all_gather"), py::arg("barrier"), py::arg("options"),
           "Collective over the group the callbacks talk to; uses the current CUDA device.")
      .def("destroy", [](PyBuffer& self) { self.get().destroy(); })
      .def_property_readonly("is_destroyed", [](const PyBuffer& self) { return self.get().is_destroyed(); })
      .def_property_readonly("rank", [](const PyBuffer& self) { return self.get().rank(); })
      .def_property_readonly("num_ranks", [](const PyBuffer& self) { return self.get().num_ranks(); })
      .def_property_readonly("ranks_per_node",
                             [](const PyBuffer& self) { return self.get().ranks_per_node(); })
      .def_property_readonly("spans_nodes", [](const PyBuffer& self) { return self.get().spans_nodes(); })
      .def_property_readonly("device", [](const PyBuffer& self) { return self.get().device(); })
      .def_property_readonly("num_device_sms",
                             [](const PyBuffer& self) { return self.get().num_device_sms(); })
      .def_property_readonly(
          "gpu_kind", [](const PyBuffer& self) { return std::string(gpu_kind_name(self.get().gpu_kind())); },
          "This rank's GPU kind for the measured defaults: \"H100\", \"H200\" or \"other\".")
      .def_property_readonly(
          "combine_send_chunk", [](const PyBuffer& self) { return self.get().combine_send_chunk(); },
          "The send chunk a combine within one node uses: the config's once a caller set one, else the "
          "recommended combine chunk for the group, the SM budget and the GPU kind.")
      .def_property_readonly(
          "comm_stream",
          [](const PyBuffer& self) { return reinterpret_cast<uintptr_t>(self.get().comm_stream()); })
      .def_property(
          "num_sms", [](const PyBuffer& self) { return self.get().num_sms(); },
          [](PyBuffer& self, int num_sms) { self.get().set_num_sms(num_sms); })
      // A copy: set the whole config to change it (set_config checks it against the GPU).
      .def_property(
          "config", [](const PyBuffer& self) { return Config(self.get().config()); },
          [](PyBuffer& self, const Config& config) { self.get().set_config(config); },
          "The config of the normal-mode calls (SM budget, send chunk, queue tokens); every call uses it.")
      .def_property_readonly("wait_timeout_ns",
                             [](const PyBuffer& self) { return self.get().wait_timeout_ns(); })
      .def_property_readonly("enable_shrink", [](const PyBuffer& self) { return self.get().enable_shrink(); })
      .def_property_readonly(
          "nvl_buffer",
          [](const PyBuffer& self) { return reinterpret_cast<uintptr_t>(self.get().nvl_buffer()); })
      .def_property_readonly("num_nvl_bytes", [](const PyBuffer& self) { return self.get().num_nvl_bytes(); })
      .def_property_readonly("num_nvl_output_bytes",
                             [](const PyBuffer& self) { return self.get().num_nvl_output_bytes(); })
      .def_property_readonly("num_nvl_staging_bytes",
                             [](const PyBuffer& self) { return self.get().num_nvl_staging_bytes(); })
      .def_property_readonly(
          "nvl_output_window",
          [](const PyBuffer& self) { return reinterpret_cast<uintptr_t>(self.get().nvl_output_window()); })
      .def_property_readonly(
          "symmetric_buffer",
          [](const PyBuffer& self) { return reinterpret_cast<uintptr_t>(self.get().symmetric_buffer()); })
      .def_property_readonly("num_rdma_bytes",
                             [](const PyBuffer& self) { return self.get().num_rdma_bytes(); })
      .def("check_timeout", [](const PyBuffer& self) { self.get().check_timeout(); })
      .def(
          "check", [](const PyBuffer& self) { call_without_gil([&] { self.get().check(); }); },
          "Raises EpxError when a device wait of this rank or of a peer gave up (after a torch or event "
          "sync).")
      .def_property_readonly("is_aborted", [](const PyBuffer& self) { return self.get().is_aborted(); })
      .def_property_readonly(
          "dispatch_count_wait_ns", [](const PyBuffer& self) { return dispatch_count_wait_ns(self.get()); },
          "Nanoseconds the host spent waiting for dispatch counts, summed since construction or reset().")
      // Collective through the bootstrap callbacks: keeps the GIL, as construction does.
      .def(
          "reset", [](PyBuffer& self) { self.get().reset(); },
          "Collective: clears an abort and re-synchronizes both buffers; the Buffer runs calls again.")
      .def(
          "synchronize",
          [](const PyBuffer& self, uintptr_t stream) {
            call_without_gil([&] { self.get().synchronize(stream_of(stream)); });
          },
          py::arg("stream"));
}

void bind_event(py::module_& m) {
  py::class_<Event>(m, "Event")
      .def(py::init<>())
      .def_static(
          "record", [](uintptr_t stream) { return Event::record(stream_of(stream)); }, py::arg("stream"),
          "A new event recorded on `stream`.")
      .def_property_readonly("valid", &Event::valid)
      .def("__bool__", &Event::valid)
      .def_property_readonly("handle",
                             [](const Event& self) { return reinterpret_cast<uintptr_t>(self.get()); })
      .def(
          "wait_on", [](const Event& self, uintptr_t stream) { self.wait_on(stream_of(stream)); },
          py::arg("stream"), "Makes `stream` wait for this event (no-op when empty).")
      .def("synchronize", [](const Event& self) { call_without_gil([&] { self.synchronize(); }); });

  py::class_<StreamOrder> order(m, "StreamOrder");
  order
      .def(py::init([](uintptr_t compute_stream, uintptr_t previous_event, bool async_finish) {
             return StreamOrder{stream_of(compute_stream), to_pointer<cudaEvent_t>(previous_event),
                                async_finish};
           }),
           py::arg("compute_stream") = 0, py::arg("previous_event") = 0, py::arg("async_finish") = false)
      .def_readwrite("async_finish", &StreamOrder::async_finish);
  def_pointer(order, "compute_stream", &StreamOrder::compute_stream);
  def_pointer(order, "previous_event", &StreamOrder::previous_event);
}

void bind_normal(py::module_& m) {
  py::enum_<TokenFormat>(m, "TokenFormat").value("BF16", TokenFormat::kBf16).value("FP8", TokenFormat::kFp8);

  py::class_<DispatchLayoutOutput> layout_out(m, "DispatchLayoutOutput");
  def_fields(layout_out);
  m.def(
      "get_dispatch_layout",
      [](PyBuffer& buffer, uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts,
         const DispatchLayoutOutput& out, const StreamOrder& order) {
        return call_without_gil([&] {
          return get_dispatch_layout(buffer.get(), to_pointer<const int64_t*>(topk_idx), num_tokens, num_topk,
                                     num_experts, out, order);
        });
      },
      py::arg("buffer"), py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
      py::arg("num_experts"), py::arg("out"), py::arg("order"));

  py::class_<DispatchInput> in(m, "DispatchInput");
  def_fields(in);

  py::class_<DispatchHandle>(m, "DispatchHandle")
      .def_property_readonly("valid", &DispatchHandle::valid)
      .def_property_readonly("num_tokens", &DispatchHandle::num_tokens)
      .def_property_readonly("num_recv_rows", &DispatchHandle::num_recv_rows)
      .def_property_readonly("hidden", &DispatchHandle::hidden)
      .def_property_readonly(
          "recv_src_idx",
          [](const DispatchHandle& self) { return reinterpret_cast<uintptr_t>(self.recv_src_idx_device()); })
      .def_property_readonly("num_recv_per_rank", &DispatchHandle::num_recv_per_rank)
      .def_property_readonly("num_channels", &DispatchHandle::num_channels)
      .def_property_readonly("recv_channel_offset",
                             [](const DispatchHandle& self) {
                               return reinterpret_cast<uintptr_t>(self.recv_channel_offset_device());
                             })
      .def_property_readonly(
          "send_head",
          [](const DispatchHandle& self) { return reinterpret_cast<uintptr_t>(self.send_head_device()); })
      .def_property_readonly("is_token_in_rank",
                             [](const DispatchHandle& self) {
                               return reinterpret_cast<uintptr_t>(self.is_token_in_rank_device());
                             })
      .def_property_readonly("deep_ep_matrices",
                             [](const DispatchHandle& self) {
                               return reinterpret_cast<uintptr_t>(self.deep_ep_matrices_device());
                             })
      .def_property_readonly("num_nodes", &DispatchHandle::num_nodes)
      .def_property_readonly("num_forward_records", &DispatchHandle::num_forward_records)
      .def_property_readonly("node_channel_offset",
                             [](const DispatchHandle& self) {
                               return reinterpret_cast<uintptr_t>(self.node_channel_offset_device());
                             })
      .def_property_readonly("forward_mask", [](const DispatchHandle& self) {
        return reinterpret_cast<uintptr_t>(self.forward_mask_device());
      });

  py::class_<DispatchPlan>(m, "DispatchPlan")
      .def_readonly("num_recv_rows", &DispatchPlan::num_recv_rows)
      .def_readonly("num_recv_tokens_per_expert", &DispatchPlan::num_recv_tokens_per_expert)
      .def_readonly("handle", &DispatchPlan::handle)
      .def_readonly("rows_in_guess", &DispatchPlan::rows_in_guess)
      .def_readonly("counts_from_layout", &DispatchPlan::counts_from_layout);

  py::class_<DispatchOutput> out(m, "DispatchOutput");
  def_fields(out);

  py::class_<DispatchOutputGuess>(m, "DispatchOutputGuess")
      .def(py::init<>())
      .def_readwrite("outputs", &DispatchOutputGuess::outputs)
      .def_readwrite("rows", &DispatchOutputGuess::rows);

  py::enum_<DispatchOverlap>(m, "DispatchOverlap")
      .value("NONE", DispatchOverlap::kNone)
      .value("LAUNCH_RECEIVE", DispatchOverlap::kLaunchReceive)
      .value("HANDLE_BEFORE_RECEIVE", DispatchOverlap::kHandleBeforeReceive);
  m.def(
      "dispatch_notify",
      [](PyBuffer& buffer, const DispatchInput& input, const StreamOrder& order,
         std::optional<DispatchHandle> cached, DispatchOverlap overlap,
         std::optional<DispatchOutputGuess> guess) {
        return call_without_gil([&] {
          return dispatch_notify(buffer.get(), input, order, cached ? &*cached : nullptr, overlap,
                                 guess ? &*guess : nullptr);
        });
      },
      py::arg("buffer"), py::arg("input"), py::arg("order"), py::arg("cached") = py::none(),
      py::arg("overlap") = DispatchOverlap::kNone, py::arg("guess") = py::none());
  m.def(
      "dispatch_cancel",
      [](PyBuffer& buffer, const DispatchPlan& plan) {
        call_without_gil([&] { dispatch_cancel(buffer.get(), plan); });
      },
      py::arg("buffer"), py::arg("plan"));
  m.def(
      "dispatch_receive",
      [](PyBuffer& buffer, const DispatchPlan& plan, const DispatchInput& input, const DispatchOutput& output,
         const StreamOrder& order) {
        return call_without_gil([&] { return dispatch_receive(buffer.get(), plan, input, output, order); });
      },
      py::arg("buffer"), py::arg("plan"), py::arg("input"), py::arg("output"), py::arg("order"));

  py::class_<CombineInput> combine_in(m, "CombineInput");
  def_fields(combine_in);

  py::class_<CombineOutput> combine_out(m, "CombineOutput");
  def_fields(combine_out);

  m.def(
      "combine",
      [](PyBuffer& buffer, const DispatchHandle& handle, const CombineInput& input,
         const CombineOutput& output, const StreamOrder& order) {
        return call_without_gil([&] { return combine(buffer.get(), handle, input, output, order); });
      },
      py::arg("buffer"), py::arg("handle"), py::arg("input"), py::arg("output"), py::arg("order"));
}

void bind_low_latency(py::module_& m) {
  using In = LowLatencyDispatchInput;
  py::class_<In> in(m, "LowLatencyDispatchInput");
  def_fields(in);

  using Out = LowLatencyDispatchOutput;
  py::class_<Out> out(m, "LowLatencyDispatchOutput");
  def_fields(out);

  using Sizes = LowLatencyDispatchSizes;
  py::class_<Sizes>(m, "LowLatencyDispatchSizes")
      .def_readonly("num_local_experts", &Sizes::num_local_experts)
      .def_readonly("num_rows_per_expert", &Sizes::num_rows_per_expert)
      .def_readonly("num_scale_columns", &Sizes::num_scale_columns)
      .def_readonly("recv_x_bytes", &Sizes::recv_x_bytes)
      .def_readonly("recv_x_scales_bytes", &Sizes::recv_x_scales_bytes)
      .def_readonly("recv_count_bytes", &Sizes::recv_count_bytes)
      .def_readonly("recv_src_info_bytes", &Sizes::recv_src_info_bytes)
      .def_readonly("recv_layout_range_bytes", &Sizes::recv_layout_range_bytes)
      .def_readonly("recv_token_listings_bytes", &Sizes::recv_token_listings_bytes);
  m.def(
      "low_latency_dispatch_sizes",
      [](const PyBuffer& buffer, const In& input) { return low_latency_dispatch_sizes(buffer.get(), input); },
      py::arg("buffer"), py::arg("input"));

  py::class_<LowLatencyHandle> handle(m, "LowLatencyHandle");
  handle.def(py::init<>())
      .def_readwrite("num_tokens", &LowLatencyHandle::num_tokens)
      .def_readwrite("num_topk", &LowLatencyHandle::num_topk)
      .def_readwrite("hidden", &LowLatencyHandle::hidden)
      .def_readwrite("num_max_dispatch_tokens_per_rank", &LowLatencyHandle::num_max_dispatch_tokens_per_rank)
      .def_readwrite("num_experts", &LowLatencyHandle::num_experts);
  def_pointer(handle, "recv_src_info", &LowLatencyHandle::recv_src_info);
  def_pointer(handle, "recv_topk_pos", &LowLatencyHandle::recv_topk_pos);
  def_pointer(handle, "recv_layout_range", &LowLatencyHandle::recv_layout_range);
  def_pointer(handle, "recv_token_listings", &LowLatencyHandle::recv_token_listings);

  py::class_<LowLatencyRecvHook>(m, "LowLatencyRecvHook")
      .def_property_readonly("valid", &LowLatencyRecvHook::valid)
      .def_property_readonly("done", &LowLatencyRecvHook::done)
      .def(
          "__call__",
          [](const LowLatencyRecvHook& self, uintptr_t stream) {
            call_without_gil([&] { self(stream_of(stream)); });
          },
          py::arg("stream"));

  py::class_<LowLatencyDispatchResult>(m, "LowLatencyDispatchResult")
      .def_readonly("handle", &LowLatencyDispatchResult::handle)
      .def_readonly("event", &LowLatencyDispatchResult::event)
      .def_readonly("hook", &LowLatencyDispatchResult::hook);
  m.def(
      "low_latency_dispatch",
      [](PyBuffer& buffer, const In& input, const Out& output, const StreamOrder& order) {
        return call_without_gil([&] { return low_latency_dispatch(buffer.get(), input, output, order); });
      },
      py::arg("buffer"), py::arg("input"), py::arg("output"), py::arg("order"));

  using CIn = LowLatencyCombineInput;
  py::class_<CIn> combine_in(m, "LowLatencyCombineInput");
  def_fields(combine_in);

  py::class_<LowLatencyCombineResult>(m, "LowLatencyCombineResult")
      .def_readonly("event", &LowLatencyCombineResult::event)
      .def_readonly("hook", &LowLatencyCombineResult::hook);
  m.def(
      "low_latency_combine",
      [](PyBuffer& buffer, const LowLatencyHandle& handle, const CIn& input, uintptr_t combined_x,
         const StreamOrder& order) {
        return call_without_gil([&] {
          return low_latency_combine(buffer.get(), handle, input, to_pointer<void*>(combined_x), order);
        });
      },
      py::arg("buffer"), py::arg("handle"), py::arg("input"), py::arg("combined_x"), py::arg("order"));
  m.def(
      "next_low_latency_combine_buffer",
      [](const PyBuffer& buffer, const LowLatencyHandle& handle) {
        return reinterpret_cast<uintptr_t>(next_low_latency_combine_buffer(buffer.get(), handle));
      },
      py::arg("buffer"), py::arg("handle"));
  m.def(
      "clean_low_latency_buffer",
      [](PyBuffer& buffer, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts,
         const StreamOrder& order) {
        call_without_gil([&] {
          clean_low_latency_buffer(buffer.get(), num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                   order);
        });
      },
      py::arg("buffer"), py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"),
      py::arg("num_experts"), py::arg("order"));

  // Rank masks (DeepEP's low_latency_*_mask_buffer).
  m.def(
      "low_latency_update_mask_buffer",
      [](PyBuffer& buffer, int rank_to_mask, bool mask, const StreamOrder& order) {
        call_without_gil([&] { low_latency_update_mask_buffer(buffer.get(), rank_to_mask, mask, order); });
      },
      py::arg("buffer"), py::arg("rank_to_mask"), py::arg("mask"), py::arg("order"));
  m.def(
      "low_latency_query_mask_buffer",
      [](PyBuffer& buffer, uintptr_t mask_status, const StreamOrder& order) {
        call_without_gil(
            [&] { low_latency_query_mask_buffer(buffer.get(), to_pointer<int*>(mask_status), order); });
      },
      py::arg("buffer"), py::arg("mask_status"), py::arg("order"));
  m.def(
      "low_latency_clean_mask_buffer",
      [](PyBuffer& buffer, const StreamOrder& order) {
        call_without_gil([&] { low_latency_clean_mask_buffer(buffer.get(), order); });
      },
      py::arg("buffer"), py::arg("order"));
  m.def(
      "read_low_latency_mask",
      [](const PyBuffer& buffer) {
        const LowLatencyMaskBits bits = read_low_latency_mask(buffer.get());
        return py::make_tuple(bits.masked, bits.masked_by_timeout);
      },
      py::arg("buffer"), "(masked, masked_by_timeout) bit sets, read now (host-synchronous)");
}

}  // namespace

void bind_runtime(py::module_& m) {
  bind_buffer(m);
  bind_event(m);
  bind_normal(m);
  bind_low_latency(m);
}

}  // namespace epx::python
