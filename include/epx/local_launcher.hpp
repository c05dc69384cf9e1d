#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "epx/bootstrap.hpp"

namespace epx {

// The local launcher runs one process per rank on this host, joined by a shared-memory Bootstrap. It is
// how the C++ tests, examples and the benchmark start a multi-GPU group without MPI or torch.
//
// Rank-to-GPU convention: the launcher reads no environment variables and picks no device. A worker uses
// its rank as the CUDA device index (cudaSetDevice(bootstrap.rank())); restrict the visible GPUs with
// CUDA_VISIBLE_DEVICES before launching if needed.
//
// CUDA must NOT be initialised in the calling process before launch_local: the children are fork()ed, and
// a CUDA context does not survive a fork (any CUDA call in a child of an initialised parent fails). Do all
// CUDA work inside `worker`. Only the calling thread is copied into the children, so the caller should not
// hold locks other threads may need.
struct LocalLaunchOptions {
  int num_ranks = 1;  // in [1, 64]
  // Bound on any single collective wait; a rank that waits longer fails with an epx::Error naming the
  // collective, how many ranks had arrived and which were missing.
  std::chrono::milliseconds timeout{60000};
  // Largest all_gather payload per rank. The shared segment reserves 2 * num_ranks * max_gather_bytes
  // (mapped lazily, so untouched pages cost nothing).
  size_t max_gather_bytes = 1 << 20;
  // Once a rank has failed, ranks still running this long afterwards are killed with SIGKILL (peers blocked
  // in a collective fail on their own well before: they are told which rank died).
  std::chrono::milliseconds kill_grace{10000};
};

struct LocalLaunchResult {
  // Per rank: the worker's return value, 1 when it threw, or -signal when the process was killed.
  std::vector<int> exit_codes;
  // One line per failed rank, in the order the launcher saw them fail (the root cause usually first):
  // "rank 2: exited with code 1: <what() of the exception>", "rank 1: killed by signal 11 (...)".
  std::vector<std::string> failures;

  bool ok() const;
  // "all 4 ranks succeeded" or "2 of 4 ranks failed:" followed by the failure lines.
  std::string summary() const;
};

// Forks options.num_ranks processes; child r runs worker(bootstrap) with bootstrap.rank() == r and ends
// with _exit (it never returns into the caller's code). An exception escaping the worker becomes exit
// code 1 with its what() in `failures`; a worker should report errors by throwing or returning non-zero,
// since anything else it records in its own process (e.g. GoogleTest assertions) is lost.
// Waits for every child and returns their outcome; throws epx::Error only for invalid options or when the
// processes cannot be created.
LocalLaunchResult launch_local(const LocalLaunchOptions& options,
                               const std::function<int(Bootstrap&)>& worker);

}  // namespace epx
