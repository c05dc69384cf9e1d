#pragma once

#include <ostream>

namespace epx::reference {

// Shape of the CPU reference run: the normal-mode case of TARGETS.md (4 ranks x 4096 tokens x 7168 hidden,
// top-8 of 256) and its low-latency case (128 tokens per rank, top-8 of 288).
struct CpuReferenceBenchShape {
  int num_ranks = 4;
  int num_tokens = 4096;
  int hidden = 7168;
  int num_topk = 8;
  int num_experts = 256;
  int ll_num_tokens = 128;
  int ll_num_experts = 288;
};

// What epx-bench runs when no GPU is present: the CPU reference of normal dispatch (BF16 and FP8) + combine
// and low-latency dispatch (FP8) + combine (BF16) on simulated ranks, each result checked against invariants.
// Writes a labelled report with the byte counts of TARGETS.md (the times are CPU times of the reference and
// say nothing about GPU performance); with json, a last line holding {"mode":"cpu-reference", ...}.
// Returns 0 when every check passed, 1 when one failed, 2 when the run threw.
int run_cpu_reference_bench(const CpuReferenceBenchShape& shape, bool json, std::ostream& out);

}  // namespace epx::reference
