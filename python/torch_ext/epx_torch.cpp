// epx._epx_torch: the per-call work of epx.Buffer's hot calls in C++, against torch's C++ API: the tensor
// checks (as booleans), the outputs from torch's caching allocator, torch's current stream, then the EPX call
// through `_epx`'s table (python/src/native_calls.hpp). An eager low-latency step spent most of its host time
// in the Python of those steps (a torch.empty is 2-4 us from Python, well under 1 us here).
//
// Each call returns None when an argument is not the plain case it handles (a check fails, int32 ids to
// widen, a tensor on another device): the Python caller then takes its own path, which raises the error with
// its argument, value and rule, or handles the case. So the rules live in one place (python/epx), and this
// file only has to be right about which inputs are plain.
//
// It links no EPX library and uses no CUDA runtime call of its own; it is built only where torch is installed
// (python/CMakeLists.txt) and loaded only where it matches the `_epx` beside it (python/epx/_ext.py).

#include <ATen/cuda/MemPool.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "core/first_fit_ranges.hpp"
#include "native_calls.hpp"

namespace {

namespace py = pybind11;
using epx::python::NativeCalls;

const NativeCalls* native = nullptr;  // set at import

// A tensor the call may use as it is: CUDA on `device`, of `dtype` and `dim`, contiguous.
bool plain(const at::Tensor& tensor, int device, at::ScalarType dtype, int64_t dim) {
  return tensor.is_cuda() && tensor.get_device() == device && tensor.scalar_type() == dtype &&
         tensor.dim() == dim && tensor.is_contiguous();
}
bool plain_or_none(const std::optional<at::Tensor>& tensor, int device, at::ScalarType dtype, int64_t dim) {
  return !tensor || plain(*tensor, device, dtype, dim);
}
bool fits_int(int64_t value) {
  return value >= INT_MIN && value <= INT_MAX;
}
template <typename Pointer>
Pointer pointer_of(const std::optional<at::Tensor>& tensor) {
  return tensor ? static_cast<Pointer>(tensor->data_ptr()) : nullptr;
}

epx::StreamOrder current_order(int device, bool async_finish) {
  return {c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), nullptr,
          async_finish};
}

epx::StreamOrder current_order(int device, uintptr_t previous_event, bool async_finish) {
  epx::StreamOrder order = current_order(device, async_finish);
  order.previous_event = reinterpret_cast<cudaEvent_t>(previous_event);  // NOLINT(performance-no-int-to-ptr)
  return order;
}

bool shaped(const at::Tensor& tensor, std::initializer_list<int64_t> shape) {
  return tensor.sizes() == c10::IntArrayRef(shape);
}

// What epx.Buffer._finish does for a normal-mode call: with async_finish the comm stream still uses the
// inputs and outputs after the call returns; with allocate_on_comm_stream (outputs made on the comm stream)
// the caller's stream uses the outputs. `output_blocks`: outputs given as their storages (a dispatch's
// blocks). Tensor.record_stream records its storage's block with the caching allocator; this records it
// directly (no dispatcher round trip), once per block.
void record_uses(int device, uintptr_t comm_stream, bool async_finish, bool allocate_on_comm_stream,
                 std::initializer_list<const std::optional<at::Tensor>*> inputs,
                 std::initializer_list<const std::optional<at::Tensor>*> outputs,
                 std::initializer_list<const c10::Storage*> output_blocks = {}) {
  const auto record = [](const c10::Storage& storage, const c10::cuda::CUDAStream& stream) {
    if (storage && storage.data_ptr().get() != nullptr)
      c10::cuda::CUDACachingAllocator::recordStream(storage.data_ptr(), stream);
  };
  const auto record_all = [&](const c10::cuda::CUDAStream& stream, bool with_inputs) {
    if (with_inputs) {
      for (const auto* tensor : inputs)
        if (*tensor) record((*tensor)->storage(), stream);
    }
    for (const auto* tensor : outputs)
      if (*tensor) record((*tensor)->storage(), stream);
    for (const auto* block : output_blocks) record(*block, stream);
  };
  if (async_finish) {
    record_all(c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(comm_stream),  // NOLINT
                                                static_cast<c10::DeviceIndex>(device)),
               true);
  }
  if (allocate_on_comm_stream) {
    record_all(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)), false);
  }
}

// Where a normal-mode call's outputs are allocated: the comm stream with allocate_on_comm_stream (DeepEP's
// rule: only with previous_event and async_finish, which the caller checked), else the current stream.
std::optional<c10::cuda::CUDAStreamGuard> allocation_stream(int device, uintptr_t comm_stream,
                                                            bool allocate_on_comm_stream) {
  if (!allocate_on_comm_stream) return std::nullopt;
  return std::optional<c10::cuda::CUDAStreamGuard>(
      std::in_place, c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(comm_stream),  // NOLINT
                                                      static_cast<c10::DeviceIndex>(device)));
}

// ---- Tensors made in place ----
// at::empty goes through the dispatcher and at::from_blob asks the driver which device a pointer is on
// (cudaPointerGetAttributes) unless told: a dispatch made ten such tensors. These make the TensorImpl over a
// storage directly, as at::empty does underneath (at::detail::empty_generic), with the same dtype, contiguous
// sizes and strides; a tensor at an offset into a shared storage is at a 256-byte boundary, as cudaMalloc's
// addresses are.

constexpr int64_t kOutputAlignment = 256;

int64_t aligned(int64_t bytes) {
  return (bytes + kOutputAlignment - 1) / kOutputAlignment * kOutputAlignment;
}

// `bytes` from torch's caching allocator on the current device and its current stream (where at::empty
// allocates), resizable as at::empty's storage is.
c10::Storage allocate_storage(int64_t bytes) {
  c10::Allocator* allocator = c10::cuda::CUDACachingAllocator::get();
  return {c10::Storage::use_byte_size_t(), c10::SymInt(bytes), allocator, /*resizable=*/true};
}

// A contiguous tensor of `shape` and `dtype` at `offset_bytes` into `storage` (a multiple of the dtype's
// size).
at::Tensor tensor_over(const c10::Storage& storage, int64_t offset_bytes, at::IntArrayRef shape,
                       at::ScalarType dtype) {
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::scalarTypeToTypeMeta(dtype));
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(shape);
  if (offset_bytes != 0)
    impl->set_storage_offset(offset_bytes / static_cast<int64_t>(c10::elementSize(dtype)));
  return tensor;
}

// A tensor of `shape` with `strides` (elements) at `offset_bytes` into `storage`.
at::Tensor strided_tensor_over(const c10::Storage& storage, int64_t offset_bytes, at::IntArrayRef shape,
                               at::IntArrayRef strides, at::ScalarType dtype) {
  at::Tensor tensor = tensor_over(storage, offset_bytes, shape, dtype);
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(
      shape, strides, offset_bytes / static_cast<int64_t>(c10::elementSize(dtype)));
  return tensor;
}

// at::empty(shape, dtype on `device`) on the current stream, without the dispatcher.
at::Tensor empty_on(int device, at::IntArrayRef shape, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int64_t bytes = c10::multiply_integers(shape) * static_cast<int64_t>(c10::elementSize(dtype));
  return tensor_over(allocate_storage(bytes), 0, shape, dtype);
}

char* address_in(const c10::Storage& storage, int64_t offset_bytes) {
  char* base = static_cast<char*>(storage.data_ptr().get());
  return base == nullptr ? nullptr : base + offset_bytes;
}

void release_owner(void* owner) {
  if (!Py_IsInitialized()) return;  // at exit: the interpreter (and the handle) is gone already
  const py::gil_scoped_acquire gil;
  Py_DECREF(static_cast<PyObject*>(owner));
}

// A storage of `bytes` over device memory the Python object `owner` keeps alive (the storage holds a
// reference to it until it is freed, from whichever thread frees it).
c10::Storage borrowed_storage(const void* address, int64_t bytes, int device, PyObject* owner) {
  Py_INCREF(owner);
  c10::DataPtr data(const_cast<void*>(address), owner,  // NOLINT(cppcoreguidelines-pro-type-const-cast)
                    &release_owner, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
  return {c10::Storage::use_byte_size_t(), static_cast<size_t>(bytes), std::move(data), nullptr, false};
}

// A tensor of `shape` over device memory `owner` keeps alive.
at::Tensor view_of(const void* address, at::IntArrayRef shape, at::ScalarType dtype, int device,
                   PyObject* owner) {
  const int64_t bytes = c10::multiply_integers(shape) * static_cast<int64_t>(c10::elementSize(dtype));
  return tensor_over(borrowed_storage(address, bytes, device, owner), 0, shape, dtype);
}

// Within one node, DeepEP's handle tuple's arrays of a dispatch's `handle` (an `_epx.DispatchHandle`), as
// deep_ep returns them: (rank_prefix_matrix [R, R], channel_prefix_matrix [R, C], recv_channel_prefix_matrix
// [R, C], recv_src_idx [rows], is_token_in_rank bool [T, R], send_head [T, R]), then rank_prefix_matrix again
// as a second tensor object, which the handle tuple's first element is: it carries the Python handle, so the
// handle must not hold it (a reference cycle). None across nodes.
py::object deep_ep_views(const epx::python::DispatchHandleArrays& arrays, PyObject* handle, int device,
                         int64_t num_ranks, int64_t num_tokens, int64_t rows) {
  if (arrays.deep_ep_matrices == nullptr) return py::none();
  const int64_t channels = arrays.num_channels, cells = num_ranks * channels;
  const int64_t square_bytes = num_ranks * num_ranks * static_cast<int64_t>(sizeof(int));
  const int64_t cells_bytes = cells * static_cast<int64_t>(sizeof(int));
  const c10::Storage matrices =
      borrowed_storage(arrays.deep_ep_matrices, square_bytes + 2 * cells_bytes, device, handle);
  return py::make_tuple(tensor_over(matrices, 0, {num_ranks, num_ranks}, at::kInt),
                        tensor_over(matrices, square_bytes, {num_ranks, channels}, at::kInt),
                        tensor_over(matrices, square_bytes + cells_bytes, {num_ranks, channels}, at::kInt),
                        view_of(arrays.recv_src_idx, {rows}, at::kInt, device, handle),
                        view_of(arrays.is_token_in_rank, {num_tokens, num_ranks}, at::kBool, device, handle),
                        view_of(arrays.send_head, {num_tokens, num_ranks}, at::kInt, device, handle),
                        tensor_over(matrices, 0, {num_ranks, num_ranks}, at::kInt));
}

py::object adopt(PyObject* result) {
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

// (recv_x, recv_x_scales or None, recv_count, recv_src_info, recv_topk_pos, recv_layout_range,
//  recv_token_listings or None, the `_epx.LowLatencyDispatchResult`), or None (see the top of the file).
py::object low_latency_dispatch(py::handle buffer, int device, int num_ranks, const at::Tensor& x,
                                const at::Tensor& topk_idx, int64_t num_max_dispatch_tokens_per_rank,
                                int64_t num_experts, const std::optional<at::Tensor>& cumulative_stats,
                                const std::optional<at::Tensor>& wait_stats, bool use_fp8, bool round_scale,
                                bool use_ue8m0, bool async_finish, bool return_recv_hook,
                                const std::optional<at::Tensor>& topk_weights) {
  if (!plain(x, device, at::kBFloat16, 2) || !plain(topk_idx, device, at::kLong, 2) ||
      topk_idx.size(0) != x.size(0) || !plain_or_none(topk_weights, device, at::kFloat, 2) ||
      !plain_or_none(cumulative_stats, device, at::kInt, 1) ||
      !plain_or_none(wait_stats, device, at::kLong, 1) || !fits_int(x.size(1)) ||
      !fits_int(num_max_dispatch_tokens_per_rank) || !fits_int(num_experts)) {
    return py::none();
  }
  const int64_t num_tokens = x.size(0), hidden = x.size(1), num_topk = topk_idx.size(1);
  if (topk_weights && (topk_weights->size(0) != num_tokens || topk_weights->size(1) != num_topk))
    return py::none();
  if (wait_stats && wait_stats->size(0) != num_ranks) return py::none();

  epx::LowLatencyDispatchInput in;
  in.x = x.data_ptr();
  in.topk_idx = topk_idx.data_ptr<int64_t>();
  in.num_tokens = static_cast<int>(num_tokens);
  in.num_topk = static_cast<int>(num_topk);
  in.hidden = static_cast<int>(hidden);
  in.num_max_dispatch_tokens_per_rank = static_cast<int>(num_max_dispatch_tokens_per_rank);
  in.num_experts = static_cast<int>(num_experts);
  in.use_fp8 = use_fp8;
  in.round_scale = round_scale;
  in.use_ue8m0 = use_ue8m0;
  in.return_recv_hook = return_recv_hook;
  in.cumulative_local_expert_recv_stats = pointer_of<int*>(cumulative_stats);
  in.dispatch_wait_recv_cost_stats = pointer_of<int64_t*>(wait_stats);
  in.topk_weights = pointer_of<const float*>(topk_weights);
  epx::LowLatencyDispatchSizes sizes;
  if (native->low_latency_dispatch_sizes(buffer.ptr(), in, &sizes) != 0) throw py::error_already_set();
  const int64_t num_local = sizes.num_local_experts, num_rows = sizes.num_rows_per_expert;
  const int64_t num_columns = sizes.num_scale_columns;
  if (cumulative_stats && cumulative_stats->size(0) != num_local) return py::none();

  // Two blocks from the caching allocator instead of a tensor each: the rows (recv_x and, with FP8, its
  // scales), and the small outputs, which the handle keeps until combine (in the rows' block they would keep
  // the rows alive as long). Each tensor at a 256-byte boundary.
  const at::ScalarType x_dtype = use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16;
  const at::ScalarType scales_dtype = use_ue8m0 ? at::kInt : at::kFloat;
  const int64_t row_cells = num_local * num_rows;
  const int64_t scales_offset = aligned(row_cells * hidden * static_cast<int64_t>(c10::elementSize(x_dtype)));
  const int64_t rows_bytes = scales_offset + (use_fp8 ? row_cells * num_columns * 4 : 0);
  const int64_t src_info_offset = aligned(num_local * 4);
  const int64_t topk_pos_offset = src_info_offset + aligned(row_cells * 4);
  const int64_t range_offset = topk_pos_offset + aligned(row_cells * 4);
  const int64_t listings_offset = range_offset + aligned(num_local * num_ranks * 8);
  const int64_t listings_count =
      topk_weights ? num_ranks * num_max_dispatch_tokens_per_rank * num_topk * 2 : 0;
  c10::Storage rows_block, small_block;
  {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    rows_block = allocate_storage(rows_bytes);
    small_block = allocate_storage(listings_offset + listings_count * 4);
  }
  at::Tensor recv_x = tensor_over(rows_block, 0, {num_local, num_rows, hidden}, x_dtype);
  std::optional<at::Tensor> recv_scales;
  if (use_fp8) {
    // [L, R*M, columns], column-major in the last two dimensions (the memory of [L, columns, R*M]).
    recv_scales = strided_tensor_over(rows_block, scales_offset, {num_local, num_rows, num_columns},
                                      {num_columns * num_rows, 1, num_rows}, scales_dtype);
  }
  at::Tensor recv_count = tensor_over(small_block, 0, {num_local}, at::kInt);
  at::Tensor src_info = tensor_over(small_block, src_info_offset, {num_local, num_rows}, at::kInt);
  at::Tensor topk_pos = tensor_over(small_block, topk_pos_offset, {num_local, num_rows}, at::kInt);
  at::Tensor layout_range = tensor_over(small_block, range_offset, {num_local, num_ranks}, at::kLong);
  std::optional<at::Tensor> listings;
  if (topk_weights) {
    listings = tensor_over(small_block, listings_offset,
                           {num_ranks, num_max_dispatch_tokens_per_rank, num_topk, 2}, at::kInt);
  }

  epx::LowLatencyDispatchOutput out;
  out.recv_x = recv_x.data_ptr();
  out.recv_x_scales = pointer_of<void*>(recv_scales);
  out.recv_count = recv_count.data_ptr<int>();
  out.recv_src_info = src_info.data_ptr<int>();
  out.recv_topk_pos = topk_pos.data_ptr<int>();
  out.recv_layout_range = static_cast<epx::LowLatencyRange*>(layout_range.data_ptr());
  out.recv_token_listings = pointer_of<epx::LowLatencyListing*>(listings);
  py::object result =
      adopt(native->low_latency_dispatch(buffer.ptr(), in, out, current_order(device, async_finish)));
  return py::make_tuple(std::move(recv_x), std::move(recv_scales), std::move(recv_count), std::move(src_info),
                        std::move(topk_pos), std::move(layout_range), std::move(listings), std::move(result));
}

// (combined_x, the `_epx.LowLatencyCombineResult`), or None (see the top of the file). x_rows is the expected
// [L, R*M] of x; out is the caller's or None (allocated here).
py::object low_latency_combine(py::handle buffer, int device, py::handle handle,
                               const std::optional<at::Tensor>& x, int64_t x_experts, int64_t x_rows,
                               const at::Tensor& topk_idx, const std::optional<at::Tensor>& topk_weights,
                               int64_t num_tokens, int64_t hidden, int64_t num_topk, int num_ranks,
                               const std::optional<at::Tensor>& wait_stats,
                               const std::optional<at::Tensor>& out, bool use_logfmt, bool logfmt_within_node,
                               bool pre_reduce, bool zero_copy, bool async_finish, bool return_recv_hook) {
  if ((x && !(plain(*x, device, at::kBFloat16, 3) && shaped(*x, {x_experts, x_rows, hidden}))) ||
      (!x && !zero_copy) || !plain(topk_idx, device, at::kLong, 2) ||
      !shaped(topk_idx, {num_tokens, num_topk}) || (!topk_weights && !pre_reduce) ||
      (topk_weights &&
       !(plain(*topk_weights, device, at::kFloat, 2) && shaped(*topk_weights, {num_tokens, num_topk}))) ||
      (wait_stats && !(plain(*wait_stats, device, at::kLong, 1) && shaped(*wait_stats, {num_ranks}))) ||
      (out && !(plain(*out, device, at::kBFloat16, 2) && shaped(*out, {num_tokens, hidden})))) {
    return py::none();
  }
  epx::LowLatencyCombineInput in;
  in.x = zero_copy ? nullptr : x->data_ptr();
  in.topk_idx = topk_idx.data_ptr<int64_t>();
  in.topk_weights = pointer_of<const float*>(topk_weights);
  in.num_tokens = static_cast<int>(num_tokens);
  in.num_topk = static_cast<int>(num_topk);
  in.use_logfmt = use_logfmt;
  in.logfmt_within_node = logfmt_within_node;
  in.pre_reduce = pre_reduce;
  in.zero_copy = zero_copy;
  in.return_recv_hook = return_recv_hook;
  in.combine_wait_recv_cost_stats = pointer_of<int64_t*>(wait_stats);
  at::Tensor combined = out ? *out : empty_on(device, {num_tokens, hidden}, at::kBFloat16);
  py::object result = adopt(native->low_latency_combine(buffer.ptr(), handle.ptr(), in, combined.data_ptr(),
                                                        current_order(device, async_finish)));
  return py::make_tuple(std::move(combined), std::move(result));
}

// A dispatch's tokens as the kernels move them, when they are the plain case: x BF16 [T, H], or 1-byte FP8
// rows with x_scales (float32 or int32 words [T, S], S >= 1), contiguous on `device`, rows a multiple of 16
// bytes. The input's token fields are filled; nullopt otherwise.
std::optional<epx::DispatchInput> token_input(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                                              int device) {
  const bool fp8 = x_scales.has_value();
  if (!x.is_cuda() || x.get_device() != device || x.dim() != 2 || !x.is_contiguous() ||
      (fp8 ? x.element_size() != 1 : x.scalar_type() != at::kBFloat16) ||
      (x.size(1) * x.element_size()) % 16 != 0 || !fits_int(x.size(0)) || !fits_int(x.size(1))) {
    return std::nullopt;
  }
  if (fp8 && !((plain(*x_scales, device, at::kFloat, 2) || plain(*x_scales, device, at::kInt, 2)) &&
               x_scales->size(0) == x.size(0) && x_scales->size(1) >= 1 && fits_int(x_scales->size(1)))) {
    return std::nullopt;
  }
  epx::DispatchInput in;
  in.x = x.data_ptr();
  in.format = fp8 ? epx::TokenFormat::kFp8 : epx::TokenFormat::kBf16;
  in.x_scales = pointer_of<const float*>(x_scales);
  in.num_scales = fp8 ? static_cast<int>(x_scales->size(1)) : 0;
  in.num_tokens = static_cast<int>(x.size(0));
  in.hidden = static_cast<int>(x.size(1));
  return in;
}

// A dispatch's outputs (recv_x, scales with FP8, top-k ids and weights with top-k) for up to `capacity` rows,
// from torch's caching allocator on the allocation stream, in two blocks: recv_x alone, and the scales, ids
// and weights together. recv_x is most of the bytes and callers free it apart from the others (a DeepEP
// caller keeps the top-k weights until combine, or for backward): in a block shared with them it would live
// as long as they do. The small outputs share one block, each at a 256-byte boundary; sharing it keeps each
// alive as long as the others, a few hundred bytes per row at most.
struct DispatchOutputs {
  c10::Storage rows_block, extras_block;
  at::ScalarType x_dtype = at::kBFloat16, scales_dtype = at::kFloat;
  int64_t hidden = 0, num_scales = 0, num_topk = 0;
  bool with_scales = false;
  int64_t idx_offset = 0, weights_offset = 0;  // bytes into extras_block (the scales start it)
  int device = 0;

  static DispatchOutputs make(int64_t capacity, int device, const at::Tensor& x,
                              const std::optional<at::Tensor>& x_scales, int64_t num_topk) {
    DispatchOutputs made;
    made.x_dtype = x.scalar_type();
    made.hidden = x.size(1);
    made.with_scales = x_scales.has_value();
    if (made.with_scales) {
      made.scales_dtype = x_scales->scalar_type();
      made.num_scales = x_scales->size(1);
    }
    made.num_topk = num_topk;
    made.device = device;
    const int64_t scales_bytes =
        made.with_scales
            ? capacity * made.num_scales * static_cast<int64_t>(c10::elementSize(made.scales_dtype))
            : 0;
    made.idx_offset = aligned(scales_bytes);
    made.weights_offset =
        made.idx_offset + aligned(capacity * num_topk * static_cast<int64_t>(sizeof(int64_t)));
    const int64_t extras_bytes =
        made.weights_offset + capacity * num_topk * static_cast<int64_t>(sizeof(float));
    // The allocator allocates on the current device (at::empty guards the tensor's device the same way).
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    made.rows_block = allocate_storage(capacity * made.hidden * x.element_size());
    if (made.with_scales || num_topk > 0) made.extras_block = allocate_storage(extras_bytes);
    return made;
  }
  epx::DispatchOutput native() const {
    epx::DispatchOutput out;
    out.recv_x = address_in(rows_block, 0);
    if (with_scales) out.recv_x_scales = reinterpret_cast<float*>(address_in(extras_block, 0));
    if (num_topk > 0) {
      out.recv_topk_idx = reinterpret_cast<int64_t*>(address_in(extras_block, idx_offset));
      out.recv_topk_weights = reinterpret_cast<float*>(address_in(extras_block, weights_offset));
    }
    return out;
  }
  // The tensors of the first `rows` rows (<= capacity): recv_x, and each of the others or None where not
  // made. No rows: tensors over no memory, so a result of none keeps no block alive (a guess made for more
  // rows, say in the output window, which destroy() would then name as still referenced).
  std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
  tensors(int64_t rows) const {
    const auto over = [&](const c10::Storage& block, int64_t offset, at::IntArrayRef shape,
                          at::ScalarType dtype) {
      return rows == 0 ? empty_on(device, shape, dtype) : tensor_over(block, offset, shape, dtype);
    };
    std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
        made{over(rows_block, 0, {rows, hidden}, x_dtype), std::nullopt, std::nullopt, std::nullopt};
    if (with_scales) std::get<1>(made) = over(extras_block, 0, {rows, num_scales}, scales_dtype);
    if (num_topk > 0) {
      std::get<2>(made) = over(extras_block, idx_offset, {rows, num_topk}, at::kLong);
      std::get<3>(made) = over(extras_block, weights_offset, {rows, num_topk}, at::kFloat);
    }
    return made;
  }
};

// ---- A Buffer's output window as a torch memory pool ----
// Dispatch outputs placed in the window (BufferOptions::num_nvl_output_bytes) are stored straight into by the
// sources. torch's caching allocator hands them out from a pool whose segments are the window's, so they are
// ordinary tensors under torch's stream rules (record_stream included); when the window has no room, torch
// raises its out-of-memory error and the outputs come from the usual allocator (the rank then receives
// through its queues while its peers still take rows into their windows).

// Where the pool's segments start: torch splits a segment into blocks at multiples of 512 bytes from its
// start, as it would a cudaMalloc'd one (whose addresses are at least that aligned).
constexpr int64_t kSegmentAlignment = 512;

struct WindowPool {
  int device;
  std::shared_ptr<epx::FirstFitRanges> ranges;
  std::unique_ptr<at::cuda::MemPool> pool;
  // torch refused the pool once for another reason than room (some releases refuse custom-allocator pools
  // under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): every later call allocates as usual.
  bool refused = false;
};

// The pool over `bytes` at `base` (a Buffer's output window) on `device`, as a capsule epx.Buffer keeps.
py::object window_pool(int device, uintptr_t base, int64_t bytes) {
  auto made = std::make_unique<WindowPool>();
  const uintptr_t start = (base + kSegmentAlignment - 1) / kSegmentAlignment * kSegmentAlignment;
  char* window = reinterpret_cast<char*>(start);  // NOLINT(performance-no-int-to-ptr)
  made->device = device;
  made->ranges = std::make_shared<epx::FirstFitRanges>(
      std::max<int64_t>(bytes - static_cast<int64_t>(start - base), 0), kSegmentAlignment);
  const auto ranges = made->ranges;
  auto allocator = torch::cuda::CUDAPluggableAllocator::createCustomAllocator(
      [ranges, window](size_t size, int, cudaStream_t) -> void* {
        const int64_t offset = ranges->take(static_cast<int64_t>(size));
        return offset < 0 ? nullptr : window + offset;
      },
      [ranges, window](void* ptr, size_t, int, cudaStream_t) {
        ranges->give_back(static_cast<char*>(ptr) - window);
      });
  {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    made->pool = std::make_unique<at::cuda::MemPool>(allocator);
  }
  return py::capsule(made.release(), "epx.WindowPool",
                     [](void* pool) { delete static_cast<WindowPool*>(pool); });
}

// Ends the pool of a window capsule before its Buffer's memory goes. Returns the bytes of tensors from the
// window that are still alive (they would point at freed memory once the Buffer is destroyed).
int64_t window_release(const py::object& window) {
  auto* pool = static_cast<WindowPool*>(window.cast<py::capsule>().get_pointer());
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(pool->device));
  // Bytes of the pool's live blocks (outputs still referenced). Not the window's ranges torch holds: it keeps
  // the pool's free segments cached past the pool's end (emptyCache of the pool does not return them either).
  int64_t live = 0;
  if (pool->pool) {
    const auto id = pool->pool->id();
    for (const auto& segment : c10::cuda::CUDACachingAllocator::snapshot().segments) {
      if (segment.device == pool->device && segment.owner_private_pool_id == id) {
        live += static_cast<int64_t>(segment.active_size);
      }
    }
  }
  pool->pool.reset();
  return live;
}

// torch's allocations on `stream` go to `pool` while this lives.
class AllocatingToPool {
 public:
  AllocatingToPool(c10::DeviceIndex device, at::cuda::MemPool& pool, cudaStream_t stream)
      : device_(device), id_(pool.id()) {
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(device_, id_,
                                                         [stream](cudaStream_t s) { return s == stream; });
  }
  ~AllocatingToPool() { c10::cuda::CUDACachingAllocator::endAllocateToPool(device_, id_); }
  AllocatingToPool(const AllocatingToPool&) = delete;
  AllocatingToPool& operator=(const AllocatingToPool&) = delete;

 private:
  c10::DeviceIndex device_;
  at::cuda::MempoolId_t id_;
};

// `make()` with torch's allocations on the current stream routed into the window's pool (`window`: the
// capsule, or None). Returns what it made and whether it came from the window; without room there, made as
// usual.
template <typename Make>
auto made_in_window(const py::object& window, int device, Make make) -> std::pair<decltype(make()), bool> {
  if (window.is_none()) return {make(), false};
  auto* pool = static_cast<WindowPool*>(window.cast<py::capsule>().get_pointer());
  if (pool->refused || !pool->pool) return {make(), false};
  const auto index = static_cast<c10::DeviceIndex>(device);
  std::optional<std::string> refusal;  // torch's error when it refused the pool for another reason than room
  {
    const AllocatingToPool routed(index, *pool->pool, c10::cuda::getCurrentCUDAStream(index).stream());
    try {
      return {make(), true};
    } catch (const c10::OutOfMemoryError&) {
    } catch (const c10::Error& error) {
      refusal = error.what_without_backtrace();
    }
  }
  if (refusal) {
    pool->refused = true;
    const py::gil_scoped_acquire gil;
    const std::string message =
        "epx: torch refused the output window's memory pool (" + *refusal +
        "); dispatch outputs come from torch's allocator and rows go through the queues";
    if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) != 0) PyErr_Clear();
  }
  return {make(), false};
}

// (recv_x, recv_x_scales or None, the `_epx.Event`) of a dispatch with a cached handle, or None. x is BF16
// [T, H], or 1-byte FP8 rows with x_scales (float32 or int32 words [T, S]); rows and num_tokens are the
// handle's.
py::object dispatch_cached(py::handle buffer, int device, py::handle handle, const at::Tensor& x,
                           const std::optional<at::Tensor>& x_scales, int64_t num_tokens, int64_t rows,
                           int64_t num_experts, int64_t expert_alignment, uintptr_t previous_event,
                           bool async_finish, bool allocate_on_comm_stream, uintptr_t comm_stream,
                           const py::object& window) {
  std::optional<epx::DispatchInput> tokens = token_input(x, x_scales, device);
  if (!tokens || x.size(0) != num_tokens || !fits_int(expert_alignment) || !fits_int(rows) ||
      (allocate_on_comm_stream && (previous_event == 0 || !async_finish))) {
    return py::none();
  }
  epx::DispatchInput& in = *tokens;
  in.num_experts = static_cast<int>(num_experts);
  in.expert_alignment = static_cast<int>(expert_alignment);
  DispatchOutputs outputs;  // no top-k outputs: a cached dispatch routes by its handle
  {
    const auto guard = allocation_stream(device, comm_stream, allocate_on_comm_stream);
    outputs = made_in_window(window, device, [&] {
                return DispatchOutputs::make(rows, device, x, x_scales, 0);
              }).first;
  }
  py::object event =
      adopt(native->dispatch_cached(buffer.ptr(), handle.ptr(), in, outputs.native(), static_cast<int>(rows),
                                    current_order(device, previous_event, async_finish)));
  const std::optional<at::Tensor> input(x);
  record_uses(device, comm_stream, async_finish, allocate_on_comm_stream, {&input, &x_scales}, {},
              {&outputs.rows_block, &outputs.extras_block});
  auto [recv_x, recv_scales, recv_idx, recv_weights] = outputs.tensors(rows);
  return py::make_tuple(std::move(recv_x), std::move(recv_scales), std::move(event));
}

// What the dispatch's allocate callback needs, and what it leaves.
struct AllocateContext {
  const at::Tensor* x;
  const std::optional<at::Tensor>* x_scales;
  int64_t num_topk;
  int device;
  uintptr_t comm_stream;
  bool allocate_on_comm_stream;
  const py::object* window;  // the output window's pool, or None
  DispatchOutputs outputs;
  std::exception_ptr error;
};

bool allocate_dispatch_outputs(void* raw, int rows, epx::DispatchOutput* out) {
  auto& context = *static_cast<AllocateContext*>(raw);
  try {
    const auto guard =
        allocation_stream(context.device, context.comm_stream, context.allocate_on_comm_stream);
    context.outputs =
        made_in_window(*context.window, context.device, [&] {
          return DispatchOutputs::make(rows, context.device, *context.x, *context.x_scales, context.num_topk);
        }).first;
    *out = context.outputs.native();
    return true;
  } catch (...) {
    context.error = std::current_exception();
    return false;
  }
}

// (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights (each None where not made), the
// `_epx.DispatchHandle`, rows, [rows per local expert], the `_epx.Event`, deep_ep_views of the handle) of a
// dispatch that is not cached, with the layout given, or None. guess_rows > 0: outputs for that many rows go
// with a launched receive (DispatchOutputGuess).
py::object dispatch(py::handle buffer, int device, int num_ranks, const at::Tensor& x,
                    const std::optional<at::Tensor>& x_scales, const std::optional<at::Tensor>& topk_idx,
                    const std::optional<at::Tensor>& topk_weights, const at::Tensor& is_token_in_rank,
                    const at::Tensor& num_tokens_per_expert,
                    const std::optional<at::Tensor>& num_tokens_per_rank, int64_t expert_alignment,
                    int64_t num_worst_tokens, bool launch_receive, int64_t guess_rows,
                    uintptr_t previous_event, bool async_finish, bool allocate_on_comm_stream,
                    uintptr_t comm_stream, const py::object& window) {
  std::optional<epx::DispatchInput> tokens = token_input(x, x_scales, device);
  if (!tokens || !fits_int(expert_alignment) || !fits_int(num_worst_tokens) || !fits_int(guess_rows)) {
    return py::none();
  }
  const int64_t num_tokens = x.size(0);
  // Top-k ids and weights come together (int64 [T, K], float32 [T, K]) or not at all.
  if (topk_idx.has_value() != topk_weights.has_value() ||
      (topk_idx && !(plain(*topk_idx, device, at::kLong, 2) && topk_idx->size(0) == num_tokens &&
                     plain(*topk_weights, device, at::kFloat, 2) &&
                     shaped(*topk_weights, {num_tokens, topk_idx->size(1)})))) {
    return py::none();
  }
  if (!(plain(is_token_in_rank, device, at::kBool, 2) && shaped(is_token_in_rank, {num_tokens, num_ranks})) ||
      !plain(num_tokens_per_expert, device, at::kInt, 1) || !fits_int(num_tokens_per_expert.numel()) ||
      (num_tokens_per_rank &&
       !(plain(*num_tokens_per_rank, device, at::kInt, 1) && shaped(*num_tokens_per_rank, {num_ranks})))) {
    return py::none();
  }
  if (allocate_on_comm_stream && (previous_event == 0 || !async_finish)) return py::none();
  const int64_t num_topk = topk_idx ? topk_idx->size(1) : 0;
  epx::DispatchInput& in = *tokens;
  in.topk_idx = pointer_of<const int64_t*>(topk_idx);
  in.topk_weights = pointer_of<const float*>(topk_weights);
  in.num_topk = static_cast<int>(num_topk);
  in.num_experts = static_cast<int>(num_tokens_per_expert.numel());
  in.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  in.num_tokens_per_expert = num_tokens_per_expert.data_ptr<int>();
  in.num_tokens_per_rank = pointer_of<const int*>(num_tokens_per_rank);
  in.expert_alignment = static_cast<int>(expert_alignment);
  in.num_worst_tokens = static_cast<int>(num_worst_tokens);

  AllocateContext context{&x,      &x_scales, num_topk, device, comm_stream, allocate_on_comm_stream,
                          &window, {},        nullptr};
  epx::python::DispatchHandleArrays arrays{};
  std::optional<epx::DispatchOutputGuess> guess;
  DispatchOutputs guessed;
  if (guess_rows > 0) {
    const auto guard = allocation_stream(device, comm_stream, allocate_on_comm_stream);
    // In the output window when it has room: the receive launched before the counts takes the rows
    // straight into it when they fit.
    guessed = made_in_window(window, device, [&] {
                return DispatchOutputs::make(guess_rows, device, x, x_scales, num_topk);
              }).first;
    guess.emplace();
    guess->outputs = guessed.native();
    guess->rows = static_cast<int>(guess_rows);
  }
  PyObject* made =
      native->dispatch(buffer.ptr(), in, current_order(device, previous_event, async_finish),
                       launch_receive ? epx::DispatchOverlap::kLaunchReceive : epx::DispatchOverlap::kNone,
                       guess ? &*guess : nullptr, &allocate_dispatch_outputs, &context, &arrays);
  if (made == nullptr) {
    if (context.error) std::rethrow_exception(context.error);
    throw py::error_already_set();
  }
  const py::tuple plan =
      py::reinterpret_steal<py::tuple>(made);  // (handle, rows, per expert, in guess, event)
  const int64_t rows = plan[1].cast<int64_t>();
  // With the rows in the guess its blocks are the outputs (made for more rows: the tensors take the first).
  const DispatchOutputs& outputs = plan[3].cast<bool>() ? guessed : context.outputs;
  if (async_finish || allocate_on_comm_stream) {
    const std::optional<at::Tensor> x_input(x), in_rank(is_token_in_rank), per_expert(num_tokens_per_expert);
    record_uses(device, comm_stream, async_finish, allocate_on_comm_stream,
                {&x_input, &x_scales, &topk_idx, &topk_weights, &in_rank, &per_expert}, {},
                {&outputs.rows_block, &outputs.extras_block});
  }
  py::object views = deep_ep_views(arrays, plan[0].ptr(), device, num_ranks, num_tokens, rows);
  auto [recv_x, recv_scales, recv_idx, recv_weights] = outputs.tensors(rows);
  return py::make_tuple(std::move(recv_x), std::move(recv_scales), std::move(recv_idx),
                        std::move(recv_weights), plan[0], rows, plan[2], plan[4], std::move(views));
}

// (combined_x, combined_topk_weights or None, the `_epx.Event`), or None. x is BF16 [rows, H'] (H' may differ
// from the dispatch's), topk_weights float32 [rows, K], biases BF16 [T, H'].
py::object combine(py::handle buffer, int device, py::handle handle, const at::Tensor& x, int64_t rows,
                   int64_t num_tokens, const std::optional<at::Tensor>& topk_weights,
                   const std::optional<at::Tensor>& bias0, const std::optional<at::Tensor>& bias1,
                   uintptr_t previous_event, bool async_finish, bool allocate_on_comm_stream,
                   uintptr_t comm_stream) {
  if (!plain(x, device, at::kBFloat16, 2) || x.size(0) != rows || !fits_int(x.size(1))) return py::none();
  const int64_t hidden = x.size(1);
  if (topk_weights && !(plain(*topk_weights, device, at::kFloat, 2) && topk_weights->size(0) == rows &&
                        fits_int(topk_weights->size(1)))) {
    return py::none();
  }
  for (const auto* bias : {&bias0, &bias1}) {
    if (*bias && !(plain(**bias, device, at::kBFloat16, 2) && shaped(**bias, {num_tokens, hidden}))) {
      return py::none();
    }
  }
  if (allocate_on_comm_stream && (previous_event == 0 || !async_finish)) return py::none();
  std::optional<at::Tensor> combined, combined_weights;
  {
    const auto guard = allocation_stream(device, comm_stream, allocate_on_comm_stream);
    combined = empty_on(device, {num_tokens, hidden}, at::kBFloat16);
    if (topk_weights) combined_weights = empty_on(device, {num_tokens, topk_weights->size(1)}, at::kFloat);
  }
  epx::CombineInput in;
  in.x = x.data_ptr();
  in.topk_weights = pointer_of<const float*>(topk_weights);
  in.num_topk = topk_weights ? static_cast<int>(topk_weights->size(1)) : 0;
  in.hidden = static_cast<int>(hidden);
  in.bias0 = pointer_of<const void*>(bias0);
  in.bias1 = pointer_of<const void*>(bias1);
  epx::CombineOutput out;
  out.combined_x = combined->data_ptr();
  out.combined_topk_weights = pointer_of<float*>(combined_weights);
  py::object event = adopt(native->combine(buffer.ptr(), handle.ptr(), in, out,
                                           current_order(device, previous_event, async_finish)));
  const std::optional<at::Tensor> input(x);
  record_uses(device, comm_stream, async_finish, allocate_on_comm_stream,
              {&input, &topk_weights, &bias0, &bias1}, {&combined, &combined_weights});
  return py::make_tuple(std::move(*combined), std::move(combined_weights), std::move(event));
}

// (num_tokens_per_rank, num_tokens_per_rdma_rank or None within one node, num_tokens_per_expert,
// is_token_in_rank, the `_epx.Event`) of get_dispatch_layout, or None. topk_idx is int64 [T, K]. The four
// outputs share one block (a few KB: the token-in-rank map is T x R bytes), each at a 256-byte boundary.
py::object get_dispatch_layout(py::handle buffer, int device, int64_t num_ranks, int64_t num_nodes,
                               const at::Tensor& topk_idx, int64_t num_experts, uintptr_t previous_event,
                               bool async_finish, bool allocate_on_comm_stream, uintptr_t comm_stream) {
  if (!plain(topk_idx, device, at::kLong, 2) || !fits_int(topk_idx.size(0)) || !fits_int(topk_idx.size(1)) ||
      num_experts <= 0 || !fits_int(num_experts) ||
      (allocate_on_comm_stream && (previous_event == 0 || !async_finish))) {
    return py::none();
  }
  const int64_t num_tokens = topk_idx.size(0);
  const int64_t int_bytes = static_cast<int64_t>(sizeof(int));
  const int64_t expert_offset = aligned(num_ranks * int_bytes);
  const int64_t node_offset = expert_offset + aligned(num_experts * int_bytes);
  const int64_t in_rank_offset = node_offset + (num_nodes > 1 ? aligned(num_nodes * int_bytes) : 0);
  c10::Storage block;
  {
    const auto guard = allocation_stream(device, comm_stream, allocate_on_comm_stream);
    const c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
    block = allocate_storage(in_rank_offset + num_tokens * num_ranks);
  }
  epx::DispatchLayoutOutput out;
  out.num_tokens_per_rank = reinterpret_cast<int*>(address_in(block, 0));
  out.num_tokens_per_expert = reinterpret_cast<int*>(address_in(block, expert_offset));
  out.is_token_in_rank = reinterpret_cast<bool*>(address_in(block, in_rank_offset));
  out.num_tokens_per_rdma_rank =
      num_nodes > 1 ? reinterpret_cast<int*>(address_in(block, node_offset)) : nullptr;
  py::object event = adopt(
      native->get_dispatch_layout(buffer.ptr(), topk_idx.data_ptr<int64_t>(), static_cast<int>(num_tokens),
                                  static_cast<int>(topk_idx.size(1)), static_cast<int>(num_experts), out,
                                  current_order(device, previous_event, async_finish)));
  const std::optional<at::Tensor> input(topk_idx);
  record_uses(device, comm_stream, async_finish, allocate_on_comm_stream, {&input}, {}, {&block});
  py::object per_node =
      num_nodes > 1 ? py::cast(tensor_over(block, node_offset, {num_nodes}, at::kInt)) : py::none();
  return py::make_tuple(tensor_over(block, 0, {num_ranks}, at::kInt), std::move(per_node),
                        tensor_over(block, expert_offset, {num_experts}, at::kInt),
                        tensor_over(block, in_rank_offset, {num_tokens, num_ranks}, at::kBool),
                        std::move(event));
}

}  // namespace

PYBIND11_MODULE(_epx_torch, m) {
  m.doc() = "epx.Buffer's hot calls on torch tensors (internal: use epx.Buffer or deep_ep.Buffer)";
  // The table of the `_epx` beside this module; a table of other sizes (another build) is not used.
  py::object capsule = py::module_::import("epx._epx").attr("_native_calls");
  const auto* table =
      static_cast<const NativeCalls*>(PyCapsule_GetPointer(capsule.ptr(), epx::python::kNativeCallsCapsule));
  if (table == nullptr) throw py::error_already_set();
  if (!(table->sizes == epx::python::native_call_sizes())) {
    throw py::import_error("epx._epx_torch: built against other EPX headers than epx._epx");
  }
  native = table;
  m.def("low_latency_dispatch", &low_latency_dispatch);
  m.def("low_latency_combine", &low_latency_combine);
  m.def("window_pool", &window_pool);
  m.def("window_release", &window_release);
  m.def("dispatch_cached", &dispatch_cached);
  m.def("dispatch", &dispatch);
  m.def("combine", &combine);
  m.def("get_dispatch_layout", &get_dispatch_layout);
}
