#pragma once

// The calls `epx._epx` lends to the torch extension `epx._epx_torch` (python/torch_ext), as a table of plain
// function pointers in the capsule `epx._epx._native_calls`.
//
// Why a table: the torch extension allocates outputs with torch's caching allocator and reads torch's current
// stream in C++ (the per-call Python work it saves is most of an eager call's host time), but the EPX runtime
// must exist once per process: the kernels use NVSHMEM's device state, which is set up for the module that
// initialized NVSHMEM. So the extension links no EPX library; it fills the plain input/output structs of the
// C++ API (epx/low_latency.hpp, epx/normal.hpp: the same compiler and headers give the same layout, which
// `sizes` lets it check) and calls through here. Every call takes the Python objects `_epx` made (its Buffer,
// a low-latency handle) and returns a new reference to what the `_epx` function of the same name returns, or
// nullptr with a Python error set (EpxError for EPX's errors). Each needs the GIL; each releases it around
// the C++ call as `_epx` does.

#include <Python.h>

#include <cstdint>

#include "epx/event.hpp"
#include "epx/low_latency.hpp"
#include "epx/normal.hpp"

namespace epx::python {

struct NativeCallSizes {
  uint32_t table;
  uint32_t stream_order;
  uint32_t low_latency_dispatch_input;
  uint32_t low_latency_dispatch_output;
  uint32_t low_latency_dispatch_sizes;
  uint32_t low_latency_combine_input;
  uint32_t dispatch_input;
  uint32_t dispatch_output;
  uint32_t combine_input;
  uint32_t combine_output;
  uint32_t dispatch_output_guess;
  uint32_t dispatch_handle_arrays;
  uint32_t dispatch_layout_output;
  friend bool operator==(const NativeCallSizes&, const NativeCallSizes&) = default;
};

// Where a dispatch's handle keeps what DeepEP's handle tuple shows (the extension views them as tensors, so
// deep_ep makes its tuple without a view call per array). Within one node; across nodes deep_ep_matrices is
// null (that tuple is made on the comm stream instead).
struct DispatchHandleArrays {
  const int*
      deep_ep_matrices;     // [R * R + 2 * R * C]: rank prefix [R, R], channel prefix, recv channel prefix
  const int* recv_src_idx;  // [rows]
  const uint8_t* is_token_in_rank;  // [T, R]
  const int* send_head;             // [T, R]
  int num_channels;                 // C
};

struct NativeCalls {
  NativeCallSizes sizes;
  // 0, or -1 with a Python error set.
  int (*low_latency_dispatch_sizes)(PyObject* buffer, const LowLatencyDispatchInput& input,
                                    LowLatencyDispatchSizes* sizes);
  PyObject* (*low_latency_dispatch)(PyObject* buffer, const LowLatencyDispatchInput& input,
                                    const LowLatencyDispatchOutput& output, const StreamOrder& order);
  PyObject* (*low_latency_combine)(PyObject* buffer, PyObject* handle, const LowLatencyCombineInput& input,
                                   void* combined_x, const StreamOrder& order);
  // A dispatch with a cached `handle` (an `_epx.DispatchHandle`): the count exchange, then the receive into
  // `output`, allocated by the caller for `rows` rows (the handle's). Returns the `_epx.Event`.
  PyObject* (*dispatch_cached)(PyObject* buffer, PyObject* handle, const DispatchInput& input,
                               const DispatchOutput& output, int rows, const StreamOrder& order);
  PyObject* (*combine)(PyObject* buffer, PyObject* handle, const CombineInput& input,
                       const CombineOutput& output, const StreamOrder& order);
  // A dispatch that is not cached: the count exchange with `overlap` and `guess` (null: none), then, unless
  // the launched receive wrote into the guess, `allocate(context, rows, &outputs)` (with the GIL; false: it
  // failed and keeps its own error, the call then cancels the receive and returns nullptr with no Python
  // error set), then the receive. Returns (`_epx.DispatchHandle`, rows, [rows per local expert],
  // rows_in_guess, `_epx.Event`), and fills `arrays` with the handle's.
  PyObject* (*dispatch)(PyObject* buffer, const DispatchInput& input, const StreamOrder& order,
                        DispatchOverlap overlap, const DispatchOutputGuess* guess,
                        bool (*allocate)(void* context, int rows, DispatchOutput* outputs), void* context,
                        DispatchHandleArrays* arrays);
  // get_dispatch_layout of `num_tokens` x `num_topk` int64 ids into `output`. Returns the `_epx.Event`.
  PyObject* (*get_dispatch_layout)(PyObject* buffer, const int64_t* topk_idx, int num_tokens, int num_topk,
                                   int num_experts, const DispatchLayoutOutput& output,
                                   const StreamOrder& order);
};

// What this build's headers say; the extension compares it with the table's before using any call.
inline constexpr NativeCallSizes native_call_sizes() {
  return {sizeof(NativeCalls),
          sizeof(StreamOrder),
          sizeof(LowLatencyDispatchInput),
          sizeof(LowLatencyDispatchOutput),
          sizeof(LowLatencyDispatchSizes),
          sizeof(LowLatencyCombineInput),
          sizeof(DispatchInput),
          sizeof(DispatchOutput),
          sizeof(CombineInput),
          sizeof(CombineOutput),
          sizeof(DispatchOutputGuess),
          sizeof(DispatchHandleArrays),
          sizeof(DispatchLayoutOutput)};
}

inline constexpr const char* kNativeCallsCapsule = "epx._epx._native_calls";

}  // namespace epx::python
