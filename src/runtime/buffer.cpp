#include "epx/buffer.hpp"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bootstrap/topology.hpp"
#include "buffer_map/combine_staging_map.hpp"
#include "buffer_map/internode_buffer_map.hpp"
#include "buffer_map/layout_board_map.hpp"
#include "buffer_map/low_latency_buffer_map.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "buffer_map/normal_nodes.hpp"
#include "core/abort_state.hpp"
#include "core/abort_word.hpp"
#include "core/block_recycler.hpp"
#include "core/direct_ranks.hpp"
#include "core/env.hpp"
#include "core/wait_record.hpp"
#include "core/wait_timeout.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/device_info.hpp"
#include "kernels/low_latency_kernels.hpp"
#include "kernels/normal_kernels.hpp"
#include "kernels/preload.hpp"
#include "runtime/buffer_access.hpp"
#include "runtime/low_latency_state.hpp"
#include "runtime/remote_memory.hpp"
#include "transport/cuda_ipc/ipc_memory.hpp"
#include "transport/shared_host/shared_host_memory.hpp"

namespace epx {

namespace {

// The low-latency kernels' peer table across nodes: every rank this one stores into. They store straight into
// every rank the transport maps both ways (other nodes' ranks too, over an NVLink fabric or P2P), and put to
// the others; EPX_INTERNODE_PUTS=1, the same on every rank (checked), keeps puts for every rank of another
// node, as over a NIC (direct_ranks says why both sides must choose alike).
std::vector<void*> low_latency_store_table(Bootstrap& bootstrap, const RemoteMemory& memory) {
  const int num_ranks = bootstrap.num_ranks();
  if (num_ranks > 64) return memory.bases;
  struct Reach {
    uint64_t maps = 0, node = 0;
    int puts_only = 0;
  } mine;
  for (int r = 0; r < num_ranks; ++r) {
    if (memory.reachable[r] != nullptr) mine.maps |= uint64_t{1} << r;
    if (memory.bases[r] != nullptr) mine.node |= uint64_t{1} << r;
  }
  mine.puts_only = env_equals("EPX_INTERNODE_PUTS", "1") ? 1 : 0;
  const std::vector<Reach> all = all_gather_value(bootstrap, mine);
  std::vector<uint64_t> maps;
  for (int r = 0; r < num_ranks; ++r) {
    EPX_CHECK(all[r].puts_only == mine.puts_only, "EPX_INTERNODE_PUTS", mine.puts_only == 1 ? "1" : "unset",
              detail::concat("must be the same on every rank (rank ", r, " has ",
                             all[r].puts_only == 1 ? "1" : "another value", ")")
                  .c_str());
    maps.push_back(all[r].maps);
  }
  const uint64_t direct = direct_ranks(maps, bootstrap.rank(), mine.node, mine.puts_only == 1);
  std::vector<void*> table(num_ranks, nullptr);
  for (int r = 0; r < num_ranks; ++r) {
    if (((direct >> r) & 1u) != 0) table[r] = memory.reachable[r];
  }
  return table;
}

// The node size every rank agrees on (bootstrap/topology.hpp): EPX_RANKS_PER_NODE, else `option`, else (0)
// the ranks of this host whose GPUs reach each other. A rank that cannot prepare its part (a malformed
// variable) still joins the exchange, so every rank raises the same error.
int agreed_ranks_per_node(Bootstrap& bootstrap, int option, int device) {
  TopologyRequest request;
  request.ranks_per_node = option;
  try {
    const char* text = std::getenv("EPX_RANKS_PER_NODE");
    if (text != nullptr && *text != '\0') {
      request.source = "EPX_RANKS_PER_NODE";
      char* end = nullptr;
      const long value = std::strtol(text, &end, 10);
      EPX_CHECK(end != text && *end == '\0', "EPX_RANKS_PER_NODE", text, "must be an integer");
      request.ranks_per_node = static_cast<int>(value);
    }
    request.location = local_rank_location(device_pci_bus_id(device));
  } catch (const Error& error) {
    request.error = error.message();
  }
  request.can_reach = [device](const RankLocation& peer) { return device_reaches(device, peer.device_id); };
  return agree_ranks_per_node(bootstrap, request);
}

// A device table of the peers' bases, with room for the largest group (unused entries are nullptr).
void* const* upload_table(const std::vector<void*>& bases) {
  void** table = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&table, sizeof(void*) * kMaxLowLatencyRanks));
  EPX_CUDA_CHECK(cudaMemset(table, 0, sizeof(void*) * kMaxLowLatencyRanks));
  if (!bases.empty()) {
    EPX_CUDA_CHECK(cudaMemcpy(table, bases.data(), sizeof(void*) * bases.size(), cudaMemcpyHostToDevice));
  }
  return table;
}

// Bytes of the abort-word allocation: the word and the shape fingerprints (AbortWordsMap).
constexpr size_t kAbortBytes = AbortWordsMap::kBytes;
static_assert(AbortWordsMap::kMaxRanks == kMaxLowLatencyRanks, "one fingerprint slot per rank");

}  // namespace

struct Buffer::State {
  Bootstrap* bootstrap = nullptr;
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  int num_device_sms = 0;
  GpuKind gpu_kind = GpuKind::kOther;
  Config config;
  // Whether a caller set the config (set_config): then the combine sends in its chunks too; else in
  // recommended_config's combine chunks for the group, the SM budget and the GPU kind.
  bool config_from_caller = false;
  int ranks_per_node = 0;
  uint64_t wait_timeout_ns = 0;
  bool enable_shrink = false;
  size_t num_nvl_output_bytes = 0;   // BufferOptions'
  size_t num_nvl_staging_bytes = 0;  // BufferOptions'
  // The combine's staging copies (combine_staging.cpp): two streams beside the comm stream (the copies, and
  // the flags after each chunk, so the copy engine never waits for a flag kernel), and the events that fork
  // them from the comm stream (0), join them back (1) and mark each chunk copied (2 ...).
  cudaStream_t staging_streams[2] = {nullptr, nullptr};
  cudaEvent_t staging_events[2 + kStagingChunks] = {};
  unsigned long long* rank_mask = nullptr;  // device [2]: BufferAccess::rank_mask_words
  cudaStream_t comm_stream = nullptr;
  std::shared_ptr<CUstream_st> comm_stream_owner;
  cudaEvent_t ordering_events[3] = {nullptr, nullptr, nullptr};  // BufferAccess::ordering_event
  // The handles' memory pool, shared by every allocation from it: destroyed only once the last handle array
  // is freed and the comm stream has run that free. (Destroying it with allocations still out, which CUDA
  // documents as deferred, left the driver's pool state broken: the next cudaMemPoolDestroy of the process,
  // NCCL's at ncclCommDestroy, crashed.)
  std::shared_ptr<CUmemPoolHandle_st> handle_pool;
  // Blocks of the pool that dead handles gave back, for the next handles (core/block_recycler.hpp). Handles
  // share it, so it may outlive the Buffer; closed (its blocks freed) when the Buffer frees its memory.
  std::shared_ptr<BlockRecycler> handle_blocks = std::make_shared<BlockRecycler>();
  std::optional<IpcMemory> nvl;
  std::optional<IpcMemory> symmetric;            // low-latency memory of a one-node group
  std::optional<RemoteMemory> symmetric_remote;  // ... of a group spanning nodes
  void* const* nvl_table = nullptr;
  void* const* symmetric_table = nullptr;
  FailureRecord* failure_record = nullptr;  // host-mapped
  FailureRecord* failure_record_device = nullptr;
  int* host_scratch = nullptr;  // host-mapped
  int* host_scratch_device = nullptr;
  // Normal mode on one node: where get_dispatch_layout posts the counts each rank's host reads
  // (src/buffer_map/layout_board_map.hpp).
  std::optional<SharedHostMemory> layout_board;
  // The layout kernel's device scratch, zero between launches (kernels::LayoutArgs): its count of finished
  // blocks, then the counts its blocks add up.
  int* layout_scratch = nullptr;
  std::shared_ptr<LowLatencyState> low_latency;  // hooks share it, so it may outlive the Buffer
  std::optional<IpcMemory> abort_memory;         // this rank's abort word, mapped into the node's ranks
  void* const* abort_table = nullptr;   // device [kMaxLowLatencyRanks]: every rank's word (nullptr: off node)
  cudaStream_t probe_stream = nullptr;  // check() reads the abort word on it, behind nothing else
  mutable AbortState abort_state;
  mutable ExclusiveUse exclusive_use;

  // Frees this rank's resources. `collective`: also the memory whose free is collective (NVSHMEM); without
  // it (an aborted group, whose peers may never come) that memory is kept until the process ends.
  void free_local(bool collective = true) noexcept {
    if (comm_stream != nullptr) cudaStreamSynchronize(comm_stream);
    if (nvl) nvl->release();
    if (symmetric) symmetric->release();
    if (abort_memory) abort_memory->release();
    if (symmetric_remote && !collective)
      new std::shared_ptr<void>(std::move(symmetric_remote->owner));  // kept
    symmetric_remote.reset();  // collective free of the NVSHMEM allocation (unless kept above)
    if (nvl_table != nullptr) cudaFree(const_cast<void**>(nvl_table));
    if (symmetric_table != nullptr) cudaFree(const_cast<void**>(symmetric_table));
    if (abort_table != nullptr) cudaFree(const_cast<void**>(abort_table));
    if (rank_mask != nullptr) cudaFree(rank_mask);
    rank_mask = nullptr;
    if (layout_board) layout_board->release();
    if (layout_scratch != nullptr) cudaFree(layout_scratch);
    layout_scratch = nullptr;
    if (probe_stream != nullptr) cudaStreamDestroy(probe_stream);
    for (cudaStream_t& stream : staging_streams) {
      if (stream != nullptr) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
      stream = nullptr;
    }
    for (cudaEvent_t& event : staging_events) {
      if (event != nullptr) cudaEventDestroy(event);
      event = nullptr;
    }
    if (failure_record != nullptr) cudaFreeHost(failure_record);
    if (host_scratch != nullptr) cudaFreeHost(host_scratch);
    // Handles still alive keep the pool (and the comm stream) until their arrays are freed; the kept blocks
    // go back to the pool now, before the Buffer gives up its share of it.
    for (const BlockRecycler::Block& block : handle_blocks->close()) {
      if (comm_stream != nullptr) cudaFreeAsync(block.address, comm_stream);
    }
    handle_pool.reset();
    for (cudaEvent_t& event : ordering_events) {
      if (event != nullptr) cudaEventDestroy(event);
      event = nullptr;
    }
    comm_stream_owner.reset();  // destroyed once no handle holds it any more
    nvl_table = symmetric_table = abort_table = nullptr;
    probe_stream = nullptr;
    failure_record = nullptr;
    host_scratch = nullptr;
    comm_stream = nullptr;
  }
};

Buffer::Buffer(Bootstrap& bootstrap, const BufferOptions& options) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.bootstrap = &bootstrap;
  s.rank = bootstrap.rank();
  s.num_ranks = bootstrap.num_ranks();
  EPX_CHECK(s.num_ranks >= 1, "num_ranks", s.num_ranks, "must be >= 1");
  EPX_CHECK(s.num_ranks <= kMaxLowLatencyRanks, "num_ranks", s.num_ranks, "must be <= 64");
  EPX_CUDA_CHECK(cudaGetDevice(&s.device));
  s.ranks_per_node = agreed_ranks_per_node(bootstrap, options.ranks_per_node, s.device);
  // Normal mode (an NVLink buffer) runs on one node of up to 8 ranks or on up to 15 such nodes: refused
  // here, before anything is allocated.
  if (options.num_nvl_bytes > 0) check_normal_node_layout(s.num_ranks, s.ranks_per_node);
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&s.num_device_sms, cudaDevAttrMultiProcessorCount, s.device));
  s.gpu_kind = gpu_kind_of(device_name(s.device));
  s.wait_timeout_ns = wait_timeout_ns_from_seconds(
      wait_timeout_seconds_from_text(std::getenv("EPX_WAIT_TIMEOUT_S"), options.wait_timeout_s));
  s.enable_shrink = options.enable_shrink;
  EPX_CHECK(options.num_nvl_output_bytes <= options.num_nvl_bytes, "num_nvl_output_bytes",
            options.num_nvl_output_bytes, "must be <= num_nvl_bytes (the window is the buffer's tail)");
  s.num_nvl_output_bytes = options.num_nvl_output_bytes;
  EPX_CHECK(options.num_nvl_staging_bytes <= options.num_nvl_bytes - options.num_nvl_output_bytes,
            "num_nvl_staging_bytes", options.num_nvl_staging_bytes,
            "must be <= num_nvl_bytes - num_nvl_output_bytes (the area lies before the window)");
  s.num_nvl_staging_bytes = options.num_nvl_staging_bytes;
  try {
    EPX_CUDA_CHECK(cudaMalloc(&s.rank_mask, sizeof(unsigned long long) * 2));
    EPX_CUDA_CHECK(cudaMemset(s.rank_mask, 0, sizeof(unsigned long long) * 2));
    // Within one node, normal-mode calls start with DeepEP's recommended chunks for the group size (at 2
    // ranks a send chunk of 24 tokens, not Config's 6: 302 against 462 us per cached BF16 dispatch on 2 x
    // H100 at 24 SMs, docs/BENCHMARKS.md); the queues, and so the buffer size, are Config's up to 8 ranks.
    // Across nodes across_nodes_config: Config's queues (they size the network queues), a larger send chunk.
    apply_config(s.ranks_per_node == s.num_ranks
                     ? recommended_config(ConfigFor::kDispatch, s.num_ranks, options.num_sms, s.gpu_kind)
                     : across_nodes_config(options.num_sms));
    s.low_latency = std::make_shared<LowLatencyState>();
    EPX_CUDA_CHECK(cudaDeviceGetAttribute(&s.low_latency->max_smem_bytes,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, s.device));
    if (const char* stamps = std::getenv("EPX_LL_PHASE_STAMPS"); stamps != nullptr && stamps[0] == '1') {
      const size_t bytes = sizeof(uint64_t) * kernels::kMaxPhaseStampBlocks * kernels::kNumPhaseStamps;
      void* memory = nullptr;
      EPX_CUDA_CHECK(cudaMalloc(&memory, bytes));
      EPX_CUDA_CHECK(cudaMemset(memory, 0, bytes));
      s.low_latency->phase_stamps.reset(static_cast<uint64_t*>(memory), [](uint64_t* p) { cudaFree(p); });
    }
    kernels::preload_all_kernels();
    const bool own_stream = options.comm_stream == nullptr;
    if (own_stream) {
      EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s.comm_stream, cudaStreamNonBlocking));
    } else {
      s.comm_stream = options.comm_stream;
    }
    for (cudaEvent_t& event : s.ordering_events)
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    if (options.num_nvl_staging_bytes > 0) {
      for (cudaStream_t& stream : s.staging_streams)
        EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      for (cudaEvent_t& event : s.staging_events)
        EPX_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    }
    s.comm_stream_owner = std::shared_ptr<CUstream_st>(s.comm_stream, [own_stream](cudaStream_t stream) {
      cudaStreamSynchronize(stream);
      if (own_stream) cudaStreamDestroy(stream);
    });
    // Handles allocate their arrays from this pool on the comm stream. It keeps freed memory instead of
    // returning it at every synchronisation (the default pool's threshold is 0), so a call's allocations do
    // not map memory again each time.
    cudaMemPoolProps pool_props{};
    pool_props.allocType = cudaMemAllocationTypePinned;
    pool_props.location.type = cudaMemLocationTypeDevice;
    pool_props.location.id = s.device;
    cudaMemPool_t pool = nullptr;
    EPX_CUDA_CHECK(cudaMemPoolCreate(&pool, &pool_props));
    s.handle_pool =
        std::shared_ptr<CUmemPoolHandle_st>(pool, [stream = s.comm_stream_owner](cudaMemPool_t p) {
          cudaStreamSynchronize(stream.get());  // the frees queued on it have run
          cudaMemPoolDestroy(p);
        });
    uint64_t keep_all = UINT64_MAX;
    EPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
    // An allocation on the private stream (allocate_rows of a receive already launched) must never wait for
    // the comm stream, whose kernel may be waiting for that very allocation.
    int no_internal_dependencies = 0;
    EPX_CUDA_CHECK(
        cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no_internal_dependencies));
    EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.failure_record), sizeof(FailureRecord),
                                 cudaHostAllocMapped));
    *s.failure_record = FailureRecord{};
    EPX_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.failure_record_device), s.failure_record, 0));
    EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.host_scratch),
                                 sizeof(int) * BufferAccess::kHostScratchInts, cudaHostAllocMapped));
    std::fill_n(s.host_scratch, BufferAccess::kHostScratchInts, 0);
    EPX_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.host_scratch_device), s.host_scratch, 0));
    s.low_latency->buffer = this;
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s.probe_stream, cudaStreamNonBlocking));
    s.abort_memory.emplace(bootstrap, kAbortBytes, "abort words", s.ranks_per_node);
    s.abort_table = upload_table(s.abort_memory->bases());
    s.nvl.emplace(bootstrap, options.num_nvl_bytes, "NVLink buffer", s.ranks_per_node);
    s.nvl_table = upload_table(s.nvl->bases());
    // Every rank has the same NVLink buffer size (checked just above), so every rank joins or none does.
    if (options.num_nvl_bytes > 0 && s.ranks_per_node == s.num_ranks) {
      s.layout_board.emplace(bootstrap, LayoutBoardMap{s.num_ranks}.num_bytes());
    }
    EPX_CUDA_CHECK(cudaMalloc(&s.layout_scratch, kernels::layout_scratch_bytes(s.num_ranks)));
    EPX_CUDA_CHECK(cudaMemset(s.layout_scratch, 0, kernels::layout_scratch_bytes(s.num_ranks)));
    if (s.ranks_per_node < s.num_ranks && options.num_rdma_bytes > 0) {
      s.symmetric_remote = allocate_remote_memory(bootstrap, options.num_rdma_bytes, s.ranks_per_node);
      s.symmetric_table = upload_table(low_latency_store_table(bootstrap, *s.symmetric_remote));
    } else {
      s.symmetric.emplace(bootstrap, options.num_rdma_bytes, "low-latency buffer");
      s.symmetric_table = upload_table(s.symmetric->bases());
    }
    bootstrap.barrier();
  } catch (...) {
    s.free_local();
    throw;
  }
}

Buffer::~Buffer() {
  if (state_ == nullptr) return;
  try {
    destroy();
  } catch (...) {
    // A destructor must not throw; destroy() already freed the local resources before any barrier error.
  }
}

void Buffer::stop_local_work() noexcept {
  // Hooks still held run no more (they would launch on freed memory).
  if (state_->low_latency) state_->low_latency->buffer = nullptr;
  // This rank's kernels end (every wait is bounded, and stops at once in an aborted group).
  cudaStreamSynchronize(state_->comm_stream);
  cudaDeviceSynchronize();
}

void Buffer::free_without_peers() noexcept {
  // Peers that still run kernels map this rank's memory through their own IPC mappings, which keep it alive
  // until they unmap.
  std::unique_ptr<State> state = std::move(state_);
  state->free_local(false);
}

void Buffer::destroy() {
  if (state_ == nullptr) return;
  stop_local_work();
  // Peers may be gone or may never call destroy: no barrier, no collective free.
  if (group_aborted()) {
    free_without_peers();
    return;
  }
  std::unique_ptr<State> state = std::move(state_);
  // Every rank must be done touching peers' memory before anyone unmaps or frees it.
  std::string barrier_error;
  try {
    state->bootstrap->barrier();
  } catch (const std::exception& error) {
    barrier_error = error.what();
  }
  // Peers that missed the barrier would never join the collective free of NVSHMEM memory either: without
  // them it stays allocated until the process ends.
  state->free_local(barrier_error.empty());
  if (!barrier_error.empty())
    EPX_FAIL("Buffer::destroy: peers did not reach the teardown barrier: ", barrier_error);
}

void Buffer::release() noexcept {
  if (state_ == nullptr) return;
  stop_local_work();
  free_without_peers();
}

bool Buffer::is_destroyed() const {
  return state_ == nullptr;
}

const Buffer::State& Buffer::live() const {
  if (state_ == nullptr) EPX_FAIL("epx::Buffer used after destroy()");
  return *state_;
}

int Buffer::rank() const {
  return live().rank;
}
int Buffer::num_ranks() const {
  return live().num_ranks;
}
int Buffer::device() const {
  return live().device;
}
int Buffer::num_device_sms() const {
  return live().num_device_sms;
}
cudaStream_t Buffer::comm_stream() const {
  return live().comm_stream;
}
const Config& Buffer::config() const {
  return live().config;
}
uint64_t Buffer::wait_timeout_ns() const {
  return live().wait_timeout_ns;
}
bool Buffer::enable_shrink() const {
  return live().enable_shrink;
}

GpuKind Buffer::gpu_kind() const {
  return live().gpu_kind;
}

bool Buffer::chunks_follow_recommended() const {
  const State& s = live();
  return !s.config_from_caller && s.ranks_per_node == s.num_ranks;
}

int Buffer::combine_send_chunk() const {
  const State& s = live();
  if (!chunks_follow_recommended()) return s.config.num_max_nvl_chunked_send_tokens;
  return recommended_config(ConfigFor::kCombine, s.num_ranks, s.config.num_sms, s.gpu_kind)
      .num_max_nvl_chunked_send_tokens;
}

void Buffer::apply_config(const Config& config) {
  State& s = const_cast<State&>(live());
  validate_config(config);
  EPX_CHECK(config.num_sms <= s.num_device_sms, "num_sms", config.num_sms, "must be <= the GPU's SM count");
  s.config = config;
}

void Buffer::set_config(const Config& config) {
  apply_config(config);
  const_cast<State&>(live()).config_from_caller = true;
}

void Buffer::set_num_sms(int num_sms) {
  const State& s = live();
  Config config = s.config;
  config.num_sms = num_sms;
  // A config no caller set keeps following the recommended dispatch chunk for the budget, as the combine's.
  if (chunks_follow_recommended()) {
    config.num_max_nvl_chunked_send_tokens =
        recommended_config(ConfigFor::kDispatch, s.num_ranks, num_sms, s.gpu_kind)
            .num_max_nvl_chunked_send_tokens;
  }
  apply_config(config);
}

void* Buffer::nvl_buffer() const {
  return live().nvl->local();
}
size_t Buffer::num_nvl_bytes() const {
  return live().nvl->bytes();
}
void* Buffer::nvl_output_window() const {
  return static_cast<char*>(nvl_buffer()) + num_nvl_queue_bytes() + num_nvl_staging_bytes();
}
size_t Buffer::num_nvl_output_bytes() const {
  return num_nvl_bytes() - num_nvl_queue_bytes() - num_nvl_staging_bytes();
}
size_t Buffer::num_nvl_queue_bytes() const {
  return nvl_staging_offset();
}
size_t Buffer::nvl_staging_offset() const {
  // The window and the staging area start 128-byte aligned, so the window may hold a little more than asked
  // for, and the area exactly its bytes rounded down.
  const State& s = live();
  const size_t window = (num_nvl_bytes() - s.num_nvl_output_bytes) / kNormalAlign * kNormalAlign;
  return window - num_nvl_staging_bytes();
}
size_t Buffer::num_nvl_staging_bytes() const {
  return live().num_nvl_staging_bytes / kNormalAlign * kNormalAlign;
}
void* const* Buffer::nvl_peer_bases_device() const {
  return live().nvl_table;
}
int Buffer::ranks_per_node() const {
  return live().ranks_per_node;
}
bool Buffer::spans_nodes() const {
  return live().ranks_per_node < live().num_ranks;
}
void* Buffer::symmetric_buffer() const {
  const State& s = live();
  return s.symmetric_remote ? s.symmetric_remote->local : s.symmetric->local();
}
size_t Buffer::num_rdma_bytes() const {
  const State& s = live();
  return s.symmetric_remote ? s.symmetric_remote->bytes : s.symmetric->bytes();
}
Bootstrap& Buffer::bootstrap() const {
  return *live().bootstrap;
}

int* BufferAccess::host_scratch(const Buffer& buffer) {
  return buffer.live().host_scratch;
}
int* BufferAccess::host_scratch_device(const Buffer& buffer) {
  return buffer.live().host_scratch_device;
}
FailureRecord* BufferAccess::failure_record_device(const Buffer& buffer) {
  return buffer.live().failure_record_device;
}
std::shared_ptr<CUstream_st> BufferAccess::comm_stream_shared(const Buffer& buffer) {
  return buffer.live().comm_stream_owner;
}
std::shared_ptr<CUmemPoolHandle_st> BufferAccess::handle_memory_pool(const Buffer& buffer) {
  return buffer.live().handle_pool;
}
const std::shared_ptr<BlockRecycler>& BufferAccess::handle_blocks(const Buffer& buffer) {
  return buffer.live().handle_blocks;
}
std::shared_ptr<LowLatencyState> BufferAccess::low_latency_state(const Buffer& buffer) {
  return buffer.live().low_latency;
}
void* const* BufferAccess::symmetric_peer_bases_device(const Buffer& buffer) {
  return buffer.live().symmetric_table;
}
cudaEvent_t BufferAccess::ordering_event(const Buffer& buffer, int which) {
  return buffer.live().ordering_events[which];
}
ExclusiveUse::Claim BufferAccess::enter_call(const Buffer& buffer, const char* call) {
  const Buffer::State& s = buffer.live();
  buffer.check_timeout();  // an aborted Buffer refuses every call until reset()
  return s.exclusive_use.claim(call, s.rank);
}

BufferAccess::LayoutBoard BufferAccess::layout_board(const Buffer& buffer) {
  const Buffer::State& s = buffer.live();
  if (!s.layout_board || !s.layout_board->valid()) return {};
  return {static_cast<uint64_t*>(s.layout_board->host()), static_cast<uint64_t*>(s.layout_board->device()),
          LayoutBoardMap{s.num_ranks}};
}

int* BufferAccess::layout_scratch(const Buffer& buffer) {
  return buffer.live().layout_scratch;
}

cudaStream_t BufferAccess::private_stream(const Buffer& buffer) {
  return buffer.live().probe_stream;
}

cudaStream_t BufferAccess::staging_stream(const Buffer& buffer, int which) {
  return buffer.live().staging_streams[which];
}

cudaEvent_t BufferAccess::staging_event(const Buffer& buffer, int which) {
  return buffer.live().staging_events[which];
}

const std::vector<void*>& BufferAccess::nvl_peer_bases(const Buffer& buffer) {
  return buffer.live().nvl->bases();
}

AbortWords BufferAccess::abort_words(const Buffer& buffer) {
  const Buffer::State& s = buffer.live();
  return AbortWords{static_cast<int*>(s.abort_memory->local()), reinterpret_cast<int* const*>(s.abort_table),
                    s.num_ranks};
}

unsigned long long* BufferAccess::rank_mask_words(const Buffer& buffer) {
  return buffer.live().rank_mask;
}

int32_t Buffer::read_abort_word() const {
  const State& s = live();
  int32_t word = 0;
  EPX_CUDA_CHECK(
      cudaMemcpyAsync(&word, s.abort_memory->local(), sizeof(word), cudaMemcpyDeviceToHost, s.probe_stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(s.probe_stream));
  return word;
}

bool Buffer::group_aborted() const {
  const State& s = live();
  if (s.abort_state.aborted() || snapshot_failure_record(*s.failure_record).flag == 1) return true;
  try {
    return abort_word_is_set(read_abort_word());
  } catch (const Error&) {
    return true;  // the device can not even be read: do nothing collective
  }
}

void Buffer::check_timeout() const {
  const State& s = live();
  s.abort_state.observe_record(snapshot_failure_record(*s.failure_record));
}

void Buffer::check() const {
  check_timeout();
  live().abort_state.observe_abort_word(rank(), read_abort_word());
}

bool Buffer::is_aborted() const {
  return live().abort_state.aborted();
}

void Buffer::reset() {
  live();  // throws after destroy()
  State& s = *state_;
  // 1. This rank's kernels end: every wait is bounded and stops at once in an aborted group.
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  // 2. Every rank's kernels ended, so nobody writes into a peer's buffer any more.
  s.bootstrap->barrier();
  // 3. This rank's protocol state from scratch, as after construction: abort word, both buffers (queue
  //    counters, barrier and done signals, low-latency flags and counts), the record, the host's half index.
  EPX_CUDA_CHECK(cudaMemset(s.abort_memory->local(), 0, kAbortBytes));
  EPX_CUDA_CHECK(cudaMemset(s.rank_mask, 0, sizeof(unsigned long long) * 2));  // no rank masked
  if (s.nvl->bytes() > 0) EPX_CUDA_CHECK(cudaMemset(s.nvl->local(), 0, s.nvl->bytes()));
  if (num_rdma_bytes() > 0) EPX_CUDA_CHECK(cudaMemset(symmetric_buffer(), 0, num_rdma_bytes()));
  EPX_CUDA_CHECK(cudaMemset(s.layout_scratch, 0, kernels::layout_scratch_bytes(s.num_ranks)));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  // This rank's row of the layout board: the notify sequence restarts below, and a count posted before the
  // reset must not pass for one posted after it.
  if (s.layout_board && s.layout_board->valid()) {
    const LayoutBoardMap map{s.num_ranks};
    std::fill_n(static_cast<uint64_t*>(s.layout_board->host()) + map.row(s.rank, 0), map.row_words(), 0);
  }
  *s.failure_record = FailureRecord{};
  // The host scratch too: normal mode's notify sequence restarts at the same value on every rank (a rank that
  // skipped a notify is one behind the others otherwise), with no receive pending.
  std::fill_n(s.host_scratch, BufferAccess::kHostScratchInts, 0);
  restart_low_latency_calls(*s.low_latency);  // the symmetric buffer was zeroed above
  // 4. No rank starts a call before every rank is clean.
  s.bootstrap->barrier();
  s.abort_state.reset();
}

void Buffer::synchronize(cudaStream_t stream) const {
  const cudaError_t status = cudaStreamSynchronize(stream);
  check_timeout();
  if (status == cudaSuccess) return;
  EPX_FAIL("rank ", rank(), ": a communication kernel failed: ", cudaGetErrorName(status), ": ",
           cudaGetErrorString(status));
}

}  // namespace epx
