// epx-link-bench: how fast a budget of SMs moves rows to a peer GPU over NVLink, by each way a kernel can
// write or read peer memory, beside the copy engine. It answers what the normal-mode kernels can reach at a
// given SM budget (issue: normal mode toward the NVLink limit): the wire's rate per method and SM count, one
// direction or both at once (a dispatch between 2 ranks writes both ways).
//
//   epx-link-bench [--mb 64] [--row-bytes 14336] [--sms 4,8,12,16,24,32] [--iters 20]
//
// Methods (every warp of every block copies whole rows; warp w takes rows w, w + W, ...):
//   warp-store  16-byte loads of the local row, stores to the peer (warp_copy: what the dispatch senders do)
//   tma-store   bulk copies: local row -> shared memory -> the peer (TmaRowCopier, one lane drives)
//   tma-pull    bulk copies: the peer's row -> shared memory -> local memory (the receiver reads)
//   warp-local  warp_copy within one GPU (what a receiver's copy out of its queue and the own rows' copy do):
//               the SMs' own copy rate, the ceiling of a receiver that copies what the peer wrote
//   tma-local   bulk copies within one GPU
//   copy-engine cudaMemcpyPeerAsync of the same bytes (no SMs)
// Each line: method, SMs, direction, median µs, GB/s per direction (bytes one GPU sends / time; the local
// methods: bytes copied / time, "one" GPU 0 alone, "both" both GPUs at once).
//
// Then the traffic of a within-node dispatch between 2 ranks, both GPUs at once, with no queue protocol (the
// bytes only; GB/s = what a rank receives, its own rows and the peer's, / time, as epx-bench counts):
//   queue       today's design: half the blocks send (12 warps store rows into the peer's queue, 4 copy own
//               rows), half receive (4 warps copy own rows, 12 copy the peer's rows out of the queue)
//   direct-P    senders store straight into the peer's output (no queue, no copy out): in every block P warps
//               store to the peer, the other 16 - P copy own rows
// The gap between the two is what writing into the receiver's output would buy at that SM budget.
//
// Then a within-node combine between 2 ranks with the copy engine carrying the rows that cross (both GPUs at
// once; GB/s = rows received by the dispatch it undoes, its own and the peer's, / time, as epx-bench counts a
// combine): each GPU's copy engine moves the rows it returns to the peer (contiguous, as a combine's input
// holds them per source) into the peer's staging rows in K chunks, and a kernel on another stream raises a
// flag in the peer after each chunk lands; `sms` blocks on the peer sum each token's own row and its staged
// row into the output (BF16 widened, added in float, rounded once), a warp waiting for a chunk's flag before
// its rows.
//   ce-combine-K   that pipeline with K chunks (-nap: the waiting warps sleep 0.5 µs between polls)
//   ce-alone-K     the copy engine's K chunks alone (no reduce kernel)
//   reduce-alone   the reduce kernel alone, every row already staged
//   ce-local-K     the copy engine's K chunks beside an unrelated bulk copy of as many rows within the GPU on
//                  `sms` SMs (no flags waited for): whether the two slow each other without any dependency
// It tells whether a combine whose crossing rows take no SM could run at the copy engine's rate (~380 GB/s
// per direction) with the SMs only reducing.
//
// Then a dispatch's rows moved by the copy engine alone, gathered row by row (cudaMemcpyBatchAsync, one copy
// per run of R rows; source runs in a scattered order, as a dispatch picks tokens, destination runs in order,
// as a receiver's output holds them), both GPUs at once, no SM (GB/s = the rows the copy engine brings a
// rank, the peer's and with "both" its own, / time; "host us": the host time of the call that queues the
// peer's batch, median):
//   ce-rows-peer-R   every row to the peer
//   ce-rows-both-R   the peer's rows on one stream, the own rows (gathered within the GPU) on another
// It tells whether a dispatch could leave its rows to the copy engine (a few SMs, or none, for the rest), and
// what a batch of thousands of copies costs the host. The rows are checked after the timed runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "device/ptx.cuh"
#include "formats/bf16.hpp"
#include "kernels/bf16x8.cuh"
#include "kernels/tma_copy.cuh"
#include "kernels/warp_copy.cuh"

namespace {

#define CHECK(call)                                                                \
  do {                                                                             \
    const cudaError_t status_ = (call);                                            \
    if (status_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(status_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Bigger pieces than the dispatch receiver's (3 KiB): one row of 14 KiB in fewer bulk copies.
using Stage = epx::kernels::TmaStage<3, 4096>;
using Copier = epx::kernels::TmaRowCopier<Stage>;

enum class Method { kWarpStore, kTmaStore, kTmaPull, kWarpLocal, kTmaLocal };

// One GPU's share of the dispatch pattern: `num_rows` rows each of the peer's (stored from src into the
// peer's out), its own (src into own), and, with a queue, the peer's again (queue into out).
struct PatternArgs {
  char* peer_out;
  const char* src;
  char* own;
  const char* queue;  // null: the direct pattern
  char* out;
  int num_rows;
  int row_bytes;
  int peer_warps;  // direct: warps of each block storing to the peer
};

// Warp `warp` of block `block`: its class (0: peer stores, 1: own rows, 2: copy out of the queue) and its
// index among the grid's workers of that class.
__device__ void pattern_role(const PatternArgs& a, int block, int warp, int& role, int& index, int& workers) {
  const int blocks = gridDim.x;
  if (a.queue == nullptr) {
    role = warp < a.peer_warps ? 0 : 1;
    const int per_block = role == 0 ? a.peer_warps : kWarps - a.peer_warps;
    index = block * per_block + (role == 0 ? warp : warp - a.peer_warps);
    workers = blocks * per_block;
    return;
  }
  const int senders = (blocks + 1) / 2;  // the receivers are the rest (at least one with 2 SMs or more)
  const bool sender = block < senders;
  constexpr int kOwnWarps = 4;
  role = sender ? (warp < kWarps - kOwnWarps ? 0 : 1) : (warp < kOwnWarps ? 1 : 2);
  if (role == 1) {  // every block has kOwnWarps own-row warps
    index = block * kOwnWarps + (sender ? warp - (kWarps - kOwnWarps) : warp);
    workers = blocks * kOwnWarps;
  } else {
    index = (sender ? block : block - senders) * (kWarps - kOwnWarps) + (sender ? warp : warp - kOwnWarps);
    workers = (sender ? senders : blocks - senders) * (kWarps - kOwnWarps);
  }
}

__global__ void __launch_bounds__(kThreads, 1) pattern_rows(const PatternArgs a) {
  extern __shared__ Stage stages[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  int role = 0, index = 0, workers = 1;
  pattern_role(a, blockIdx.x, warp, role, index, workers);
  if (workers <= 0) return;
  if (role == 0) {  // the senders' warp stores, as the dispatch's
    for (int row = index; row < a.num_rows; row += workers) {
      epx::kernels::warp_copy<false>(a.peer_out + static_cast<size_t>(row) * a.row_bytes,
                                     a.src + static_cast<size_t>(row) * a.row_bytes, a.row_bytes, lane);
    }
    return;
  }
  // Own rows and the copy out of the queue: bulk copies, as the dispatch's.
  char* dst = role == 1 ? a.own : a.out;
  const char* src = role == 1 ? a.src : a.queue;
  Copier copier(&stages[warp], lane == 0);
  if (copier.driver()) {
    for (int row = index; row < a.num_rows; row += workers) {
      copier.copy(dst + static_cast<size_t>(row) * a.row_bytes, src + static_cast<size_t>(row) * a.row_bytes,
                  a.row_bytes);
    }
  }
  copier.finish();
}

__global__ void __launch_bounds__(kThreads, 1)
    copy_rows(char* dst, const char* src, int num_rows, int row_bytes, Method method) {
  extern __shared__ Stage stages[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int worker = blockIdx.x * kWarps + warp;
  const int num_workers = gridDim.x * kWarps;
  if (method == Method::kWarpStore || method == Method::kWarpLocal) {
    for (int row = worker; row < num_rows; row += num_workers) {
      epx::kernels::warp_copy<false>(dst + static_cast<size_t>(row) * row_bytes,
                                     src + static_cast<size_t>(row) * row_bytes, row_bytes, lane);
    }
    return;
  }
  Copier copier(&stages[warp], lane == 0);
  if (copier.driver()) {
    for (int row = worker; row < num_rows; row += num_workers) {
      copier.copy(dst + static_cast<size_t>(row) * row_bytes, src + static_cast<size_t>(row) * row_bytes,
                  row_bytes);
    }
  }
  copier.finish();
}

// The copy engine's chunk `chunk` of this call (`epoch`) has landed in the peer's staging rows: raised in the
// peer's flags by one thread, after the copy completed in stream order.
__global__ void raise_flag(int* peer_flags, int chunk, int epoch) {
  __threadfence_system();
  epx::device::st_release_sys(peer_flags + chunk, epoch);
}

// Row r of `rows` (words of 4 bytes) holds (tag << 24) | r in every word: the batched copies' check tells
// rows apart.
__global__ void tag_rows(uint32_t* rows, int num_rows, int row_words, uint32_t tag) {
  const size_t total = static_cast<size_t>(num_rows) * row_words;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x)
    rows[i] = (tag << 24) | static_cast<uint32_t>(i / row_words);
}

// cudaMemcpyBatchAsync of `count` copies on `stream`, each read in stream order.
cudaError_t batch_copy(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                       cudaStream_t stream) {
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attrs_index = 0;
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attrs, &attrs_index, 1, stream);
}

// A multiplier coprime with n (n >= 1): (a * i) % n visits every i < n once, in a scattered order.
int coprime_step(int n) {
  for (int a = n / 2 + 1; a > 1; --a) {
    if (std::gcd(a, n) == 1) return a;
  }
  return 1;
}

// out[t] = own[t] + staged[t] for every row t (BF16 values summed in float, rounded once), warp w of the grid
// taking rows w, w + warps, ...; before a row a warp waits until the flag of its chunk (rows_per_chunk rows
// each) reads `epoch`, sleeping `sleep_ns` between polls (0: spinning). Each lane keeps 4 16-byte pieces of
// both rows in flight.
__global__ void __launch_bounds__(kThreads, 1)
    reduce_staged_rows(char* out, const char* own, const char* staged, const int* flags, int epoch,
                       int num_rows, int row_bytes, int rows_per_chunk, int sleep_ns) {
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  const int num_warps_total = gridDim.x * kWarps;
  const int pieces = row_bytes / 16;
  for (int row = warp; row < num_rows; row += num_warps_total) {
    if (lane == 0) {
      const int* flag = flags + row / rows_per_chunk;
      while (epx::device::ld_acquire_sys(flag) < epoch) {
        if (sleep_ns > 0) __nanosleep(sleep_ns);
      }
    }
    __syncwarp();
    const auto* a = reinterpret_cast<const int4*>(own + static_cast<size_t>(row) * row_bytes);
    const auto* b = reinterpret_cast<const int4*>(staged + static_cast<size_t>(row) * row_bytes);
    auto* c = reinterpret_cast<int4*>(out + static_cast<size_t>(row) * row_bytes);
    for (int first = lane; first < pieces; first += 32 * kUnroll) {
      int4 va[kUnroll], vb[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = first + 32 * u;
        if (i < pieces) {
          va[u] = a[i];
          vb[u] = b[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = first + 32 * u;
        if (i < pieces) {
          float acc[8];
          epx::kernels::start_sum(acc);
          epx::kernels::add_bf16x8(acc, va[u]);
          epx::kernels::add_bf16x8(acc, vb[u]);
          c[i] = epx::kernels::round_bf16x8(acc);
        }
      }
    }
  }
}

struct Options {
  size_t bytes = size_t(64) << 20;
  int row_bytes = 14336;
  std::vector<int> sms = {4, 8, 12, 16, 24, 32};
  int iters = 20;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--mb") {
      o.bytes = size_t(std::atoi(value)) << 20;
    } else if (flag == "--row-bytes") {
      o.row_bytes = std::atoi(value);
    } else if (flag == "--iters") {
      o.iters = std::atoi(value);
    } else if (flag == "--sms") {
      o.sms.clear();
      for (const char* p = value; *p != '\0';) {
        o.sms.push_back(std::atoi(p));
        while (*p != '\0' && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "epx-link-bench: unknown flag %s (see the file's head)\n", flag.c_str());
      std::exit(2);
    }
  }
  if (o.row_bytes <= 0 || o.row_bytes % 16 != 0 || o.iters < 1) {
    std::fprintf(stderr, "epx-link-bench: --row-bytes must be a positive multiple of 16, --iters >= 1\n");
    std::exit(2);
  }
  return o;
}

// Per GPU g: a local source and a destination its peer writes into (both of `bytes`), a stream, events.
struct Gpu {
  char* src = nullptr;
  char* dst = nullptr;
  char* own = nullptr;  // the dispatch pattern's own rows and output
  char* out = nullptr;
  int* flags = nullptr;  // ce-combine: one per chunk, raised by the peer
  cudaStream_t stream{};
  cudaStream_t copy_stream{}, flag_stream{};  // ce-combine: the copy engine's chunks, the flags after them
  cudaEvent_t start{}, stop{};
  std::vector<cudaEvent_t> landed;  // ce-combine: chunk k copied
  char* tagged = nullptr;           // ce-rows: rows tagged by index (tag_rows), the gathered sources
  char* gathered_in = nullptr;      // ce-rows: the peer's rows land here
  char* gathered_own = nullptr;     // ce-rows: the own rows land here
};

constexpr int kMaxChunks = 64;

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int num_gpus = 0;
  CHECK(cudaGetDeviceCount(&num_gpus));
  if (num_gpus < 2) {
    std::fprintf(stderr, "epx-link-bench: needs 2 GPUs, %d present\n", num_gpus);
    return 2;
  }
  const int num_rows = static_cast<int>(o.bytes / o.row_bytes);
  const size_t bytes = static_cast<size_t>(num_rows) * o.row_bytes;
  Gpu gpus[2];
  for (int g = 0; g < 2; ++g) {
    CHECK(cudaSetDevice(g));
    CHECK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CHECK(cudaMalloc(&gpus[g].src, bytes));
    CHECK(cudaMalloc(&gpus[g].dst, bytes));
    CHECK(cudaMalloc(&gpus[g].own, bytes));
    CHECK(cudaMalloc(&gpus[g].out, bytes));
    CHECK(cudaMemset(gpus[g].src, g + 1, bytes));
    CHECK(cudaStreamCreateWithFlags(&gpus[g].stream, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&gpus[g].copy_stream, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&gpus[g].flag_stream, cudaStreamNonBlocking));
    CHECK(cudaMalloc(&gpus[g].flags, kMaxChunks * sizeof(int)));
    CHECK(cudaMemset(gpus[g].flags, 0, kMaxChunks * sizeof(int)));
    gpus[g].landed.resize(kMaxChunks);
    for (cudaEvent_t& event : gpus[g].landed) CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    CHECK(cudaEventCreate(&gpus[g].start));
    CHECK(cudaEventCreate(&gpus[g].stop));
    CHECK(cudaMalloc(&gpus[g].tagged, bytes));
    CHECK(cudaMalloc(&gpus[g].gathered_in, bytes));
    CHECK(cudaMalloc(&gpus[g].gathered_own, bytes));
    tag_rows<<<264, 512>>>(reinterpret_cast<uint32_t*>(gpus[g].tagged), num_rows, o.row_bytes / 4,
                           static_cast<uint32_t>(g + 1));
    CHECK(cudaGetLastError());
    CHECK(cudaFuncSetAttribute(copy_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(sizeof(Stage) * kWarps)));
    CHECK(cudaFuncSetAttribute(pattern_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(sizeof(Stage) * kWarps)));
  }
  std::printf("rows of %d bytes, %.1f MB per direction, %d timed runs (median)\n", o.row_bytes, bytes / 1e6,
              o.iters);
  std::printf("%-12s %4s %-6s %10s %10s\n", "method", "SMs", "ways", "us", "GB/s/dir");
  // GPU g runs: writes (warp/tma store) from its src into the peer's dst; pulls from the peer's src.
  const auto launch = [&](int g, const char* method, int sms) {
    Gpu& me = gpus[g];
    Gpu& peer = gpus[1 - g];
    if (std::strcmp(method, "copy-engine") == 0) {
      CHECK(cudaMemcpyPeerAsync(peer.dst, 1 - g, me.src, g, bytes, me.stream));
      return;
    }
    const Method m = std::strcmp(method, "warp-store") == 0   ? Method::kWarpStore
                     : std::strcmp(method, "tma-store") == 0  ? Method::kTmaStore
                     : std::strcmp(method, "warp-local") == 0 ? Method::kWarpLocal
                     : std::strcmp(method, "tma-local") == 0  ? Method::kTmaLocal
                                                              : Method::kTmaPull;
    const bool local = m == Method::kWarpLocal || m == Method::kTmaLocal;
    char* dst = m == Method::kTmaPull || local ? me.dst : peer.dst;
    const char* src = m == Method::kTmaPull ? peer.src : me.src;
    copy_rows<<<sms, kThreads, sizeof(Stage) * kWarps, me.stream>>>(dst, src, num_rows, o.row_bytes, m);
  };
  // Median µs over o.iters runs (after 2 warm-up) of `launch_on`(g) on GPUs 0 .. ways - 1 at once: the slower
  // GPU's event time of each run.
  const auto median_us = [&](int ways, const std::function<void(int)>& launch_on) {
    std::vector<float> times;
    for (int it = 0; it < o.iters + 2; ++it) {
      for (int g = 0; g < 2; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaDeviceSynchronize());
      }
      for (int g = 0; g < ways; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaEventRecord(gpus[g].start, gpus[g].stream));
        launch_on(g);
        CHECK(cudaEventRecord(gpus[g].stop, gpus[g].stream));
      }
      float worst = 0;
      for (int g = 0; g < ways; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaEventSynchronize(gpus[g].stop));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, gpus[g].start, gpus[g].stop));
        worst = std::max(worst, ms);
      }
      if (it >= 2) times.push_back(worst);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2] * 1e3;
  };
  const char* methods[] = {"warp-store", "tma-store", "tma-pull", "warp-local", "tma-local", "copy-engine"};
  for (const char* method : methods) {
    const bool engine = std::strcmp(method, "copy-engine") == 0;
    for (const int sms : engine ? std::vector<int>{0} : o.sms) {
      for (const int ways : {1, 2}) {
        const double us = median_us(ways, [&](int g) { launch(g, method, sms); });
        std::printf("%-12s %4d %-6s %10.1f %10.1f\n", method, sms, ways == 1 ? "one" : "both", us,
                    bytes / us / 1e3);
      }
    }
  }
  // The dispatch's traffic, both GPUs at once. The queue is the peer-written dst (what the senders stored).
  std::printf("%-12s %4s %-6s %10s %10s\n", "pattern", "SMs", "ways", "us", "GB/s recv");
  const auto time_pattern = [&](int peer_warps, bool queue, int sms) {
    return median_us(2, [&](int g) {
      const PatternArgs args{gpus[1 - g].dst, gpus[g].src, gpus[g].own, queue ? gpus[g].dst : nullptr,
                             gpus[g].out,     num_rows,    o.row_bytes, peer_warps};
      pattern_rows<<<sms, kThreads, sizeof(Stage) * kWarps, gpus[g].stream>>>(args);
    });
  };
  for (const int sms : o.sms) {
    if (sms < 2) continue;
    const double us = time_pattern(0, true, sms);
    std::printf("%-12s %4d %-6s %10.1f %10.1f\n", "queue", sms, "both", us, 2.0 * bytes / us / 1e3);
    for (const int peer_warps : {6, 8, 10, 12}) {
      const double direct_us = time_pattern(peer_warps, false, sms);
      const std::string name = "direct-" + std::to_string(peer_warps);
      std::printf("%-12s %4d %-6s %10.1f %10.1f\n", name.c_str(), sms, "both", direct_us,
                  2.0 * bytes / direct_us / 1e3);
    }
  }
  // The combine with the copy engine carrying the crossing rows (see the file's head). Every launch raises
  // the flags to a new epoch, so they are never reset.
  int epoch = 0;
  enum class Beside { kNothing, kReduce, kLocalCopy };  // the SMs' work on the peer-side stream
  const auto time_ce_combine = [&](int chunks, int sms, bool copy, Beside beside, int sleep_ns) {
    const int rows_per_chunk = (num_rows + chunks - 1) / chunks;
    return median_us(2, [&](int g) {
      Gpu& me = gpus[g];
      Gpu& peer = gpus[1 - g];
      if (g == 0) ++epoch;
      if (copy) {
        CHECK(cudaStreamWaitEvent(me.copy_stream, me.start));
        CHECK(cudaStreamWaitEvent(me.flag_stream, me.start));
        for (int k = 0; k < chunks; ++k) {
          const size_t first = static_cast<size_t>(k) * rows_per_chunk * o.row_bytes;
          if (first >= bytes) break;
          const size_t chunk_bytes =
              std::min(bytes - first, static_cast<size_t>(rows_per_chunk) * o.row_bytes);
          CHECK(cudaMemcpyPeerAsync(peer.dst + first, 1 - g, me.src + first, g, chunk_bytes, me.copy_stream));
          CHECK(cudaEventRecord(me.landed[k], me.copy_stream));
          CHECK(cudaStreamWaitEvent(me.flag_stream, me.landed[k]));
          raise_flag<<<1, 1, 0, me.flag_stream>>>(peer.flags, k, epoch);
        }
      }
      if (beside == Beside::kLocalCopy) {  // into `own`: `out` keeps the last pipeline's sums
        copy_rows<<<sms, kThreads, sizeof(Stage) * kWarps, me.stream>>>(me.own, me.src, num_rows, o.row_bytes,
                                                                        Method::kTmaLocal);
      } else if (beside == Beside::kReduce) {
        // Alone, every row counts as staged: the flags wait for epoch 0.
        reduce_staged_rows<<<sms, kThreads, 0, me.stream>>>(me.out, me.src, me.dst, me.flags,
                                                            copy ? epoch : 0, num_rows, o.row_bytes,
                                                            rows_per_chunk, sleep_ns);
      }
      if (copy) {
        cudaEvent_t flags_done = me.landed[kMaxChunks - 1];
        CHECK(cudaEventRecord(flags_done, me.flag_stream));
        CHECK(cudaStreamWaitEvent(me.stream, flags_done));
      }
    });
  };
  // One row of the combine table: both GPUs at once, GB/s as epx-bench counts a combine.
  const auto print_combine_row = [&](const std::string& name, int sms, double us) {
    std::printf("%-16s %4d %-6s %10.1f %10.1f\n", name.c_str(), sms, "both", us, 2.0 * bytes / us / 1e3);
  };
  std::printf("%-16s %4s %-6s %10s %10s\n", "combine", "SMs", "ways", "us", "GB/s recv");
  for (const int chunks : {1, 2, 4, 8, 16, 32}) {
    print_combine_row("ce-alone-" + std::to_string(chunks), 0,
                      time_ce_combine(chunks, 0, true, Beside::kNothing, 0));
  }
  for (const int sms : o.sms) {
    print_combine_row("reduce-alone", sms, time_ce_combine(1, sms, false, Beside::kReduce, 0));
    for (const int sleep_ns : {0, 500}) {
      for (const int chunks : {2, 4, 8, 16}) {
        print_combine_row("ce-combine-" + std::to_string(chunks) + (sleep_ns > 0 ? "-nap" : ""), sms,
                          time_ce_combine(chunks, sms, true, Beside::kReduce, sleep_ns));
      }
    }
    for (const int chunks : {1, 4}) {
      print_combine_row("ce-local-" + std::to_string(chunks), sms,
                        time_ce_combine(chunks, sms, true, Beside::kLocalCopy, 0));
    }
  }
  // A dispatch's rows by the copy engine alone (see the file's head): run j of R rows goes from source run
  // (step * j) % runs to destination run j.
  std::printf("%-16s %4s %-6s %10s %10s %10s\n", "rows by ce", "SMs", "ways", "us", "GB/s recv", "host us");
  const auto time_ce_rows = [&](int run_rows, bool own_too, double* host_us) {
    const int runs = num_rows / run_rows;
    const int step = coprime_step(runs);
    const size_t run_bytes = static_cast<size_t>(run_rows) * o.row_bytes;
    // Per GPU: the batch to the peer and the one within the GPU.
    std::vector<std::vector<void*>> dsts(4);
    std::vector<std::vector<const void*>> srcs(4);
    for (int g = 0; g < 2; ++g) {
      for (int j = 0; j < runs; ++j) {
        const char* from =
            gpus[g].tagged + static_cast<size_t>((static_cast<long long>(step) * j) % runs) * run_bytes;
        dsts[2 * g].push_back(gpus[1 - g].gathered_in + j * run_bytes);
        srcs[2 * g].push_back(from);
        dsts[2 * g + 1].push_back(gpus[g].gathered_own + j * run_bytes);
        srcs[2 * g + 1].push_back(from);
      }
    }
    const std::vector<size_t> sizes(runs, run_bytes);
    std::vector<double> host;
    const double us = median_us(2, [&](int g) {
      Gpu& me = gpus[g];
      CHECK(cudaStreamWaitEvent(me.copy_stream, me.start));
      const auto begin = std::chrono::steady_clock::now();
      CHECK(batch_copy(dsts[2 * g].data(), srcs[2 * g].data(), sizes.data(), runs, me.copy_stream));
      host.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count());
      if (own_too) {
        CHECK(batch_copy(dsts[2 * g + 1].data(), srcs[2 * g + 1].data(), sizes.data(), runs, me.stream));
      }
      cudaEvent_t copied = me.landed[kMaxChunks - 1];
      CHECK(cudaEventRecord(copied, me.copy_stream));
      CHECK(cudaStreamWaitEvent(me.stream, copied));
    });
    std::sort(host.begin(), host.end());
    *host_us = host[host.size() / 2];
    // Rows of GPU 0's gathered_in (written by GPU 1) and, with own_too, its gathered_own: run j holds source
    // run (step * j) % runs of GPU 1's (tag 2) / GPU 0's (tag 1) rows.
    bool ok = true;
    for (const int j : {0, runs / 2, runs - 1}) {
      const int from_row = static_cast<int>((static_cast<long long>(step) * j) % runs) * run_rows;
      for (int which = 0; which < (own_too ? 2 : 1); ++which) {
        uint32_t word = 0;
        CHECK(cudaSetDevice(0));
        const char* row = (which == 0 ? gpus[0].gathered_in : gpus[0].gathered_own) + j * run_bytes;
        CHECK(cudaMemcpy(&word, row + o.row_bytes - 4, 4, cudaMemcpyDeviceToHost));
        const uint32_t want =
            (static_cast<uint32_t>(which == 0 ? 2 : 1) << 24) | static_cast<uint32_t>(from_row);
        ok = ok && word == want;
      }
    }
    if (!ok) std::printf("ce-rows-%d: rows DIFFER from the sources\n", run_rows);
    return us;
  };
  // One copy first, alone: a driver without batched copies skips the table rather than end the run.
  const bool batches_work = [&] {
    CHECK(cudaSetDevice(0));
    void* dst = gpus[0].gathered_own;
    const void* src = gpus[0].tagged;
    const size_t size = o.row_bytes;
    const cudaError_t status = batch_copy(&dst, &src, &size, 1, gpus[0].stream);
    if (status != cudaSuccess) {
      std::printf("rows by ce: skipped (cudaMemcpyBatchAsync: %s)\n", cudaGetErrorString(status));
      cudaGetLastError();
    }
    CHECK(cudaStreamSynchronize(gpus[0].stream));
    return status == cudaSuccess;
  }();
  for (const int run_rows : {1, 4, 16}) {
    if (!batches_work || num_rows % run_rows != 0) continue;
    for (const bool own_too : {false, true}) {
      double host_us = 0;
      const double us = time_ce_rows(run_rows, own_too, &host_us);
      const std::string name =
          std::string(own_too ? "ce-rows-both-" : "ce-rows-peer-") + std::to_string(run_rows);
      std::printf("%-16s %4d %-6s %10.1f %10.1f %10.1f\n", name.c_str(), 0, "both", us,
                  (own_too ? 2.0 : 1.0) * bytes / us / 1e3, host_us);
    }
  }
  // The last pipeline's sums, checked on GPU 0 against the host (both rows hold bytes g + 1 everywhere).
  {
    std::vector<uint16_t> got(o.row_bytes / 2);
    CHECK(cudaSetDevice(0));
    CHECK(cudaMemcpy(got.data(), gpus[0].out + bytes - o.row_bytes, o.row_bytes, cudaMemcpyDeviceToHost));
    const uint16_t want = epx::float_to_bf16(epx::bf16_to_float(0x0101) + epx::bf16_to_float(0x0202));
    const bool ok = std::all_of(got.begin(), got.end(), [&](uint16_t v) { return v == want; });
    std::printf("ce-combine sums %s (last row, GPU 0: want 0x%04x, got 0x%04x)\n", ok ? "match" : "DIFFER",
                want, got[0]);
  }
  return 0;
}
