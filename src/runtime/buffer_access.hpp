#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "buffer_map/layout_board_map.hpp"
#include "core/abort_word.hpp"
#include "core/block_recycler.hpp"
#include "core/exclusive_use.hpp"
#include "epx/buffer.hpp"

namespace epx {

struct LowLatencyState;
struct FailureRecord;

// What the runtime's free functions need of a Buffer beyond its public API: state and device tables they
// share with the Buffer but that users never touch. Only src/runtime includes this header; Buffer names it
// its friend, so these reach the Buffer's private state (and throw after destroy(), as the API does).
struct BufferAccess {
  // Host-mapped scratch the kernels publish small results into (e.g. received counts), readable by the host
  // without a copy once the stream reached that point: kHostScratchInts ints, its host address and the same
  // memory as the device sees it. Carved by normal_host_scratch.hpp.
  static constexpr int kHostScratchInts = 16384;
  static int* host_scratch(const Buffer& buffer);
  static int* host_scratch_device(const Buffer& buffer);
  // Normal mode on one node: the layout board (src/buffer_map/layout_board_map.hpp) as the host and the
  // device see it. Null where the group spans nodes, has no NVLink buffer, or could not map the shared
  // memory.
  struct LayoutBoard {
    uint64_t* host = nullptr;
    uint64_t* device = nullptr;
    LayoutBoardMap map{1};
  };
  static LayoutBoard layout_board(const Buffer& buffer);
  // The layout kernel's device scratch of layout_scratch_bytes(num_ranks), zero between launches.
  static int* layout_scratch(const Buffer& buffer);
  // Where a device wait that gives up writes its record (host-mapped), as the device sees it.
  static FailureRecord* failure_record_device(const Buffer& buffer);
  // Shares ownership of the comm stream, for objects (handles) that may outlive the Buffer and free memory on
  // it.
  static std::shared_ptr<CUstream_st> comm_stream_shared(const Buffer& buffer);
  // Memory pool of the handles' device arrays (allocated and freed on the comm stream; keeps freed memory).
  // Every allocation holds it: it is destroyed after the last one is freed, never with allocations out.
  static std::shared_ptr<CUmemPoolHandle_st> handle_memory_pool(const Buffer& buffer);
  // The pool's blocks dead handles gave back, kept for the next handles' arrays on the comm stream.
  static const std::shared_ptr<BlockRecycler>& handle_blocks(const Buffer& buffer);
  // The host side of the low-latency protocol (which half the next call uses, pending hooks). Created with
  // the Buffer and dropped by destroy(), so a new Buffer, even at the same address, starts afresh.
  static std::shared_ptr<LowLatencyState> low_latency_state(const Buffer& buffer);
  // Device array [kMaxLowLatencyRanks] of every rank's low-latency buffer as seen from this GPU (nullptr for
  // ranks outside this rank's node: NVSHMEM puts reach those).
  static void* const* symmetric_peer_bases_device(const Buffer& buffer);
  // Three events the Buffer re-records to order the comm stream against callers' streams (0: the start of a
  // call, 1: its end when no event is returned, 2: behind a low-latency call launched straight on the
  // caller's stream), so a call creates no event. A stream wait captures the
  // event as recorded at that moment, so re-recording it later is safe.
  static cudaEvent_t ordering_event(const Buffer& buffer, int which);
  // The abort words kernels poll and raise (core/abort_word.hpp), device pointers.
  static AbortWords abort_words(const Buffer& buffer);
  // The rank mask of low-latency mode: device words [0] masked ranks, [1] ranks masked by a timed-out wait
  // (enable_shrink). Zero after construction and reset().
  static unsigned long long* rank_mask_words(const Buffer& buffer);
  // A private stream with nothing queued behind other work: host-synchronous small steps (check()'s read of
  // the abort word, allocations a running kernel must see complete) go there.
  static cudaStream_t private_stream(const Buffer& buffer);
  // The combine's staging copies (BufferOptions::num_nvl_staging_bytes; null without): the streams of the
  // copies (0) and of the flags after them (1), and their events (0: forks them from the comm stream, 1:
  // joins them back, 2 + k: chunk k copied).
  static cudaStream_t staging_stream(const Buffer& buffer, int which);
  static cudaEvent_t staging_event(const Buffer& buffer, int which);
  // [num_ranks]: every rank's NVLink buffer as the host addresses it on this GPU (own included).
  static const std::vector<void*>& nvl_peer_bases(const Buffer& buffer);
  // The start of every call: refuses an aborted Buffer (check_timeout), then claims the Buffer for this
  // thread until the returned claim ends (core/exclusive_use.hpp); `call` names the call in errors.
  static ExclusiveUse::Claim enter_call(const Buffer& buffer, const char* call);
};

}  // namespace epx
