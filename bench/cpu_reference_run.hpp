#pragma once

#include <ostream>

namespace epx::reference {

// Shape of the CPU reference run: by default the benchmark's normal-mode case (4 ranks x 4096 tokens x 7168
// hidden, top-8 of 256) and its low-latency case (128 tokens per rank, top-8 of 288).
struct CpuReferenceBenchShape {
  bool with_normal = true;       // run the normal-mode part (--mode normal or all)
  bool with_low_latency = true;  // run the low-latency part (--mode low-latency or all)
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
// Writes a labelled report with the benchmark's byte counts (the times are CPU times of the reference and say
// nothing about GPU performance), or with json only one line {"mode":"cpu-reference", ...}; that line also
// goes to `json_copy` when given. Failures are reported on `err`. Returns 0 when every check passed, 1 when
// one failed, 2 when the run threw.
int run_cpu_reference_bench(const CpuReferenceBenchShape& shape, bool json, std::ostream& out,
                            std::ostream& err, std::ostream* json_copy = nullptr);

}  // namespace epx::reference
