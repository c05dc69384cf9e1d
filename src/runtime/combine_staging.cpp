#include "runtime/combine_staging.hpp"

#include <cstdint>
#include <vector>

#include "core/env.hpp"
#include "gpu/cuda_check.hpp"
#include "kernels/normal_kernels.hpp"
#include "runtime/buffer_access.hpp"

namespace epx {

namespace {

// The largest SM budget whose combines take the staging area by default: on 2 x H200 at 4,096 tokens the
// staged combine took 519 us at 8 SMs against the queues' 637-641, but 303 / 297 at 20 / 24 against 285 /
// 239 (docs/BENCHMARKS.md): with more SMs their stores move the rows faster than the copy engine.
constexpr int kStagingMaxSms = 16;

// Whether a combine of `num_sms` SMs (2 per channel) takes the staging area: EPX_COMBINE_STAGING=1 at any
// budget, 0 never (to compare the two ways on one Buffer), unset up to kStagingMaxSms. Read once.
bool staging_wanted(int num_sms) {
  static const int requested = env_count("EPX_COMBINE_STAGING");
  return requested < 0 ? num_sms <= kStagingMaxSms : requested == 1;
}

}  // namespace

CombineStagingMap combine_staging_map(const Buffer& buffer, const DispatchHandle::State& state, int hidden,
                                      int num_topk) {
  CombineStagingMap map;
  map.num_ranks = buffer.num_ranks();
  map.row_bytes = hidden * 2;
  map.num_topk = num_topk;
  if (buffer.num_ranks() < 2 || state.num_worst_tokens > 0 || state.num_nodes > 1 ||
      !staging_wanted(2 * state.num_channels) ||
      state.num_recv_per_rank.size() != static_cast<size_t>(buffer.num_ranks()))
    return map;
  map.offset = buffer.nvl_staging_offset();
  map.bytes = buffer.num_nvl_staging_bytes();
  return map;
}

bool start_staged_copies(Buffer& buffer, const kernels::PeerContext& peers,
                         const DispatchHandle::State& state, const CombineInput& in,
                         const CombineStagingMap& map) {
  if (!map.enabled()) return false;
  const int rank = buffer.rank();
  const int num_ranks = buffer.num_ranks();
  // Rows this rank returns to each peer that takes them from its staging area: x's rows from that source.
  struct Peer {
    int rank, first, rows;
  };
  std::vector<Peer> staged;
  unsigned mask = 0;
  int first = 0;
  for (int r = 0; r < num_ranks; ++r) {
    const int rows = state.num_recv_per_rank[r];
    if (r != rank && rows > 0 && map.fits(rows)) {
      staged.push_back({r, first, rows});
      mask |= 1u << r;
    }
    first += rows;
  }
  if (staged.empty()) return false;
  const cudaStream_t comm = buffer.comm_stream();
  const cudaStream_t copies = BufferAccess::staging_stream(buffer, 0);
  const cudaStream_t flagging = BufferAccess::staging_stream(buffer, 1);
  kernels::launch_staging_gate({peers, mask}, comm);
  const cudaEvent_t fork = BufferAccess::staging_event(buffer, 0);
  EPX_CUDA_CHECK(cudaEventRecord(fork, comm));
  EPX_CUDA_CHECK(cudaStreamWaitEvent(copies, fork));
  const std::vector<void*>& bases = BufferAccess::nvl_peer_bases(buffer);
  const auto* x = static_cast<const char*>(in.x);
  // The weights first: the first chunk's flag covers them.
  if (map.num_topk > 0 && in.topk_weights != nullptr) {
    for (const Peer& p : staged) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(map.weights(bases[p.rank], rank, p.rank),
                                     in.topk_weights + static_cast<size_t>(p.first) * map.num_topk,
                                     sizeof(float) * map.num_topk * static_cast<size_t>(p.rows),
                                     cudaMemcpyDeviceToDevice, copies));
    }
  }
  const int* staging_call = &NormalBufferMap::control(buffer.nvl_buffer())->staging_call;
  for (int chunk = 0; chunk < kStagingChunks; ++chunk) {
    kernels::StagingFlagArgs flags{};
    flags.staging_call = staging_call;
    for (const Peer& p : staged) {
      const int per_chunk = CombineStagingMap::chunk_rows(p.rows);
      const int begin = chunk * per_chunk;
      if (begin >= p.rows) continue;
      const int rows = std::min(per_chunk, p.rows - begin);
      const size_t row_bytes = static_cast<size_t>(map.row_bytes);
      EPX_CUDA_CHECK(cudaMemcpyAsync(map.rows(bases[p.rank], rank, p.rank) + begin * row_bytes,
                                     x + (static_cast<size_t>(p.first) + begin) * row_bytes, rows * row_bytes,
                                     cudaMemcpyDeviceToDevice, copies));
      flags.flags[flags.count++] = map.flag(bases[p.rank], rank, chunk);
    }
    if (flags.count == 0) continue;
    // The flags go on their own stream behind an event: the copy engine goes on with the next chunk.
    const cudaEvent_t copied = BufferAccess::staging_event(buffer, 2 + chunk);
    EPX_CUDA_CHECK(cudaEventRecord(copied, copies));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(flagging, copied));
    kernels::launch_staging_flags(flags, flagging);
  }
  return true;
}

void join_staged_copies(Buffer& buffer) {
  // The flag stream waited for every chunk's copy, so its end is the end of both.
  const cudaEvent_t join = BufferAccess::staging_event(buffer, 1);
  EPX_CUDA_CHECK(cudaEventRecord(join, BufferAccess::staging_stream(buffer, 1)));
  EPX_CUDA_CHECK(cudaStreamWaitEvent(buffer.comm_stream(), join));
}

}  // namespace epx
