#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "epx/bootstrap.hpp"
#include "epx/config.hpp"

namespace epx {

struct BufferOptions {
  size_t num_nvl_bytes = 0;  // normal-mode NVLink buffer per rank (see Config::get_nvl_buffer_size_hint)
  // Of num_nvl_bytes, the last this many (or up to 127 more) form the output window (every rank the same):
  // a rank whose dispatch outputs all lie there has them written by the sources straight over NVLink, with
  // no queue and no copy out of one (within one node); a rank whose outputs are elsewhere receives through
  // its queues, whatever its peers do. The queues use the rest.
  size_t num_nvl_output_bytes = 0;
  // Of num_nvl_bytes, this many just before the output window form the combine's staging area (every rank
  // the same; 0: none): within one node, the copy engine returns each peer's rows into it, so a combine's SMs
  // only reduce (kernels at 8 or 16 SMs run at the link's rate). A pair of ranks uses it when the rows one
  // returns to the other fit a slot of (bytes - 128) / (ranks - 1) bytes, each row hidden * 2 bytes plus
  // its top-k weights; other pairs go through the queues. The queues use what is left.
  size_t num_nvl_staging_bytes = 0;
  // Symmetric (low-latency) buffer per rank: get_low_latency_rdma_size_hint; normal mode across nodes will
  // need Config::get_rdma_buffer_size_hint (take the larger when one Buffer serves both).
  size_t num_rdma_bytes = 0;
  int num_sms = 20;              // SM budget of the normal-mode kernels (DeepEP's Buffer.num_sms default)
  double wait_timeout_s = 30.0;  // bound of every device-side wait (env EPX_WAIT_TIMEOUT_S overrides)
  // Ranks per NVLink node; 0 = detect: ranks on one host whose GPUs reach each other (NVLink / P2P) form a
  // node (every rank, when the group runs on one host). Nodes must be equal blocks of consecutive ranks, at
  // most 8 ranks when there are several; every rank must end up with the same value (checked: all raise the
  // same error otherwise). Several nodes: low-latency traffic to other nodes goes through NVSHMEM (needs the
  // NVSHMEM transport). A value below the detected node size makes virtual nodes (e.g. 4 GPUs of one host as
  // 2 x 2), which is how the multi-node path is tested without a NIC. Env EPX_RANKS_PER_NODE overrides.
  int ranks_per_node = 0;
  // The stream the Buffer's calls run on, borrowed (it must outlive the Buffer and every call's outputs), or
  // nullptr: the Buffer makes its own. Frameworks pass a stream of their own pool (epx.Buffer passes
  // torch's), so tensors recorded on it stay safe to free after destroy().
  cudaStream_t comm_stream = nullptr;
  // Low-latency mode (DeepEP's enable_shrink): a device wait that times out on a peer masks that peer (see
  // low_latency_update_mask_buffer) and the call completes without its traffic, instead of aborting the
  // group. Without it a timeout aborts the group (docs/RELIABILITY.md). Normal mode is not affected.
  bool enable_shrink = false;
};

// One per rank, constructed collectively by all ranks of a node on the current CUDA device.
// Owns the communication memory (mapped into every peer with CUDA IPC), a device table of the peers'
// addresses, the communication stream, host-mapped memory the kernels report through, and the SM budget.
class Buffer {
 public:
  Buffer(Bootstrap& bootstrap, const BufferOptions& options);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Frees everything now (collective: every rank must call it). Calls after destroy() throw. An aborted
  // Buffer (or one whose abort word is set) leaves without the teardown barrier and without the collective
  // free of memory reached through NVSHMEM (kept until the process ends), so a missing peer cannot hang it.
  void destroy();
  // Frees this rank's resources without meeting any peer, as destroy() does for an aborted Buffer: no
  // barrier, and memory reached through NVSHMEM (only a collective can free it) stays until the process ends.
  // Peers' mappings keep this rank's NVLink memory alive while they still use it. For finalizers and other
  // paths that cannot know whether the peers are alive or tearing down too; a no-op after destroy().
  void release() noexcept;
  bool is_destroyed() const;

  int rank() const;
  int num_ranks() const;
  int device() const;
  int num_device_sms() const;  // SMs of the GPU
  cudaStream_t comm_stream() const;

  // The config of the normal-mode calls (SM budget and queue sizes). It starts as BufferOptions::num_sms
  // with, within one node, recommended_config's chunks for the group size and this GPU's kind
  // (ConfigFor::kDispatch), across nodes across_nodes_config's.
  const Config& config() const;
  void set_config(const Config& config);  // num_sms >= 1 and <= the GPU's SM count
  int num_sms() const { return config().num_sms; }
  // >= 1 and <= the GPU's SM count. Until a caller sets a config, the dispatch's send chunk follows the
  // recommended one for the new budget too.
  void set_num_sms(int num_sms);
  GpuKind gpu_kind() const;  // of this rank's GPU (its device name)
  // The NVLink send chunk of a combine within one node: the config's once a caller set one (set_config),
  // else recommended_config's combine chunk for the group size, the SM budget and the GPU kind (the
  // dispatch's and the combine's best chunks differ: docs/BENCHMARKS.md).
  int combine_send_chunk() const;
  uint64_t wait_timeout_ns() const;
  bool enable_shrink() const;  // BufferOptions::enable_shrink

  // Normal-mode NVLink memory: this rank's base and a device array [num_ranks] of every rank's base as seen
  // from this GPU (own included).
  void* nvl_buffer() const;
  size_t num_nvl_bytes() const;
  // The output window (BufferOptions::num_nvl_output_bytes): its first byte (128-byte aligned) and size; the
  // queues' part of the buffer ends where it begins.
  void* nvl_output_window() const;
  size_t num_nvl_output_bytes() const;
  size_t num_nvl_queue_bytes() const;
  // The combine's staging area (BufferOptions::num_nvl_staging_bytes): its offset from nvl_buffer() (where
  // the queues end, 128-byte aligned) and size (0: none).
  size_t nvl_staging_offset() const;
  size_t num_nvl_staging_bytes() const;
  void* const* nvl_peer_bases_device() const;

  // Ranks per NVLink node (num_ranks for one node), the same on every rank; the low-latency buffer reaches
  // other nodes by NVSHMEM.
  int ranks_per_node() const;
  bool spans_nodes() const;

  // The symmetric buffer of this rank (low-latency calls; across nodes also normal mode's network queues),
  // and its size (BufferOptions::num_rdma_bytes, DeepEP's name, although within one node no RDMA is used).
  void* symmetric_buffer() const;
  size_t num_rdma_bytes() const;

  // ---- Failures (docs/RELIABILITY.md) ----
  // A device wait that gives up writes a record into host-mapped memory, raises the group's abort word (so
  // every wait of every rank stops) and returns; the CUDA context survives. Once the host sees a record or
  // the abort word, the Buffer is aborted: every call throws epx::Error with the same message (rank, peer,
  // phase, expected and seen values) until reset() or destroy().
  // Throws epx::Error when the Buffer is aborted or a record was written (cheap: reads host memory). Every
  // entry point calls it.
  void check_timeout() const;
  // check_timeout(), and also this rank's abort word (a peer's failure that no wait of this rank saw yet);
  // call it after a torch or event sync. Takes a small device-to-host copy on a private stream.
  void check() const;
  bool is_aborted() const;
  // Collective (every rank calls it), bounded: waits for this rank's kernels (every wait returns once the
  // group is aborted), meets every rank, clears the abort words, the record and the protocol state of both
  // buffers (queue counters, barrier and low-latency signals), and meets again. The Buffer then runs calls
  // again; receive hooks of earlier low-latency calls become stale. Throws if the CUDA context is lost.
  void reset();
  // Synchronizes `stream`, then throws epx::Error with the timeout record if any, else the CUDA error.
  void synchronize(cudaStream_t stream) const;

  Bootstrap& bootstrap() const;

 private:
  friend struct BufferAccess;  // the runtime's internal access (src/runtime/buffer_access.hpp)
  struct State;
  std::unique_ptr<State> state_;
  const State& live() const;
  void apply_config(const Config& config);  // set_config without marking the config the caller's
  // Whether the send chunks are still recommended_config's: no caller set a config, and one node.
  bool chunks_follow_recommended() const;
  int32_t read_abort_word() const;  // this rank's abort word (a device-to-host copy)
  bool group_aborted() const;       // aborted, a record written, or the abort word set
  void
  stop_local_work() noexcept;  // destroy()'s and release()'s first step: hooks off, this rank's kernels end
  void free_without_peers() noexcept;  // frees this rank's resources, meeting no peer (NVSHMEM memory kept)
};

}  // namespace epx
