// epx-bench: normal and low-latency dispatch/combine on every visible GPU (one process per GPU), with the
// NCCL all-to-all baseline moving the same bytes in the same run; the CPU reference run where no GPU exists.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_options.hpp"
#include "bench_report.hpp"
#include "buffer_map/normal_buffer_map.hpp"
#include "cpu_reference_run.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "formats/fp8.hpp"

#if defined(EPX_WITH_CUDA)
#include <cuda_runtime.h>

#include "epx/local_launcher.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/device_info.hpp"
#include "low_latency_bench.hpp"
#include "normal_bench.hpp"
#endif

namespace {

using epx::bench::BenchOptions;
using epx::bench::validate_options;

void print_help() {
  std::printf(
      "usage: epx-bench [options]   (--flag value or --flag=value)\n"
      "  --mode normal|low-latency|all   what to run (default all)\n"
      "  --ranks N                       GPUs to use (default: all visible)\n"
      "  --tokens T --hidden H --topk K --experts E   normal-mode shape (default 4096 7168 8 256)\n"
      "  --num-sms a,b,c                 SM budgets of the normal kernels (default 24)\n"
      "  --ranks-per-node N              normal-mode ranks per node: fewer than --ranks makes virtual nodes, "
      "so\n"
      "                                  dispatch/combine take the path across nodes (NVSHMEM between "
      "them);\n"
      "                                  must divide --ranks (default: one node)\n"
      "  --nvl-chunk N --nvl-queue N     normal mode in one node: tokens per NVLink send chunk and per "
      "queue\n"
      "                                  (default 0: DeepEP's recommended config for the rank count, as\n"
      "                                  deep_ep callers get it; dispatch and combine each their own)\n"
      "  --staging                       normal mode in one node: a combine staging area for every row\n"
      "                                  (peers' copy engines return the rows; num_nvl_staging_bytes)\n"
      "  --rdma-chunk N --rdma-queue N   normal mode across nodes: tokens per network send chunk and per\n"
      "                                  queue (default 0: the Buffer's first config across nodes, 32 and\n"
      "                                  256)\n"
      "  --tune                          normal mode in one node: time the cached dispatch and the combine\n"
      "                                  at every NVLink send chunk and queue size of a sweep, per SM "
      "budget,\n"
      "                                  and print the fastest config of each (for this machine and shape)\n"
      "  --ll-tokens T --ll-experts E    low-latency shape (default 128 288; hidden and top-k shared)\n"
      "  --ll-ranks-per-node N           low-latency ranks per node: fewer than --ranks makes virtual nodes\n"
      "                                  whose traffic between them goes through NVSHMEM (default: one "
      "node)\n"
      "  --ranks-per-gpu N               ranks sharing each GPU (default 1): checks the logic of larger "
      "groups\n"
      "                                  (virtual nodes on one GPU); times are not speeds, NCCL is skipped\n"
      "  --warmup N --iters N            untimed and timed runs per number (default 5 30; median reported)\n"
      "  --seed N                        seed of the random inputs and routing (default 1; GPU runs)\n"
      "  --launch-ahead-us US            python -m epx_tools.bench's GPU spin before each timed call;\n"
      "                                  epx-bench has no Python host time to hide and takes only 0\n"
      "  --json                          JSON lines on stdout instead of tables\n"
      "  --json-file PATH                also write the JSON lines to PATH\n"
      "Bytes: normal = rows received x (2H BF16 | H + 4H/128 FP8), combine as BF16 dispatch; across nodes\n"
      "also network bytes = each token once per other node it goes to x the same row bytes;\n"
      "low latency = valid (token, expert) selections x (H + H/32 + 16 FP8 | 2H BF16 | 1.25H + H/32 "
      "LogFMT).\n"
      "Method, bytes and JSON fields: docs/BENCHMARKS.md. Plots of --json-file F:\n"
      "python -m epx_tools.plot F (GB/s figures), python -m epx_tools.bench_plot F --out F.svg (per op EPX\n"
      "beside NCCL)\n");
}

// `text` read whole by `convert` (std::stoi, std::stod), else epx::Error naming the flag and `rule`.
template <typename Value>
Value parse_whole(const std::string& flag, const std::string& text,
                  Value (*convert)(const std::string&, size_t*), const char* rule) {
  size_t used = 0;
  Value value{};
  try {
    value = convert(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  EPX_CHECK(used > 0 && used == text.size(), flag.c_str(), text, rule);
  return value;
}

// An integer flag value; the error names the flag.
int parse_int(const std::string& flag, const std::string& text) {
  return parse_whole<int>(
      flag, text, [](const std::string& t, size_t* used) { return std::stoi(t, used); },
      "must be an integer");
}

std::vector<int> parse_list(const std::string& flag, const std::string& text) {
  std::vector<int> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) values.push_back(parse_int(flag, item));
  EPX_CHECK(!values.empty(), flag.c_str(), text, "must list at least one value");
  return values;
}

// A finite number flag value (--launch-ahead-us); the error names the flag.
double parse_number(const std::string& flag, const std::string& text) {
  const double value = parse_whole<double>(
      flag, text, [](const std::string& t, size_t* used) { return std::stod(t, used); }, "must be a number");
  EPX_CHECK(std::isfinite(value), flag.c_str(), text, "must be a number");
  return value;
}

// Returns false when the program should stop (help printed). python -m epx_tools.bench parses the same flags
// with the same rules and messages (tests/python/cpu/test_bench.py compares the two).
bool parse(int argc, char** argv, BenchOptions& o, std::string& json_file) {
  for (int i = 1; i < argc; ++i) {
    // --flag value, or --flag=value.
    std::string flag = argv[i];
    std::string inline_value;
    bool has_inline_value = false;
    const size_t equals = flag.find('=');
    if (flag.rfind("--", 0) == 0 && equals != std::string::npos) {
      inline_value = flag.substr(equals + 1);
      flag.resize(equals);
      has_inline_value = true;
    }
    auto value = [&]() -> std::string {
      if (has_inline_value) {
        has_inline_value = false;
        return inline_value;
      }
      if (i + 1 >= argc) EPX_FAIL(flag, " needs a value (see --help)");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      print_help();
      return false;
    } else if (flag == "--mode") {
      o.mode = value();
      EPX_CHECK(o.mode == "normal" || o.mode == "low-latency" || o.mode == "all", "--mode", o.mode,
                "must be normal, low-latency or all");
    } else if (flag == "--ranks") {
      o.num_ranks = parse_int(flag, value());
      EPX_CHECK(o.num_ranks >= 1, "--ranks", o.num_ranks, "must be >= 1");
    } else if (flag == "--tokens") {
      o.num_tokens = parse_int(flag, value());
    } else if (flag == "--hidden") {
      o.hidden = parse_int(flag, value());
    } else if (flag == "--topk") {
      o.num_topk = parse_int(flag, value());
    } else if (flag == "--experts") {
      o.num_experts = parse_int(flag, value());
    } else if (flag == "--num-sms") {
      o.num_sms = parse_list(flag, value());
    } else if (flag == "--ranks-per-node") {
      o.ranks_per_node = parse_int(flag, value());
    } else if (flag == "--nvl-chunk") {
      o.nvl_send_chunk = parse_int(flag, value());
    } else if (flag == "--nvl-queue") {
      o.nvl_queue_tokens = parse_int(flag, value());
    } else if (flag == "--staging") {
      o.staging = true;
    } else if (flag == "--ll-tokens") {
      o.ll_num_tokens = parse_int(flag, value());
    } else if (flag == "--ll-experts") {
      o.ll_num_experts = parse_int(flag, value());
    } else if (flag == "--ll-ranks-per-node") {
      o.ll_ranks_per_node = parse_int(flag, value());
    } else if (flag == "--ranks-per-gpu") {
      o.ranks_per_gpu = parse_int(flag, value());
    } else if (flag == "--warmup") {
      o.warmup = parse_int(flag, value());
    } else if (flag == "--iters") {
      o.iters = parse_int(flag, value());
    } else if (flag == "--rdma-chunk") {
      o.rdma_send_chunk = parse_int(flag, value());
    } else if (flag == "--rdma-queue") {
      o.rdma_queue_tokens = parse_int(flag, value());
    } else if (flag == "--seed") {
      const int seed = parse_int(flag, value());
      EPX_CHECK(seed >= 0, "--seed", seed, "must be >= 0");
      o.seed = static_cast<unsigned>(seed);
    } else if (flag == "--launch-ahead-us") {
      // python -m epx_tools.bench's flag (it hides Python's host time): accepted here only as the timing
      // epx-bench does anyway, so one command line serves both benches.
      const double us = parse_number(flag, value());
      EPX_CHECK(us >= 0, "--launch-ahead-us", us, "must be >= 0");
      EPX_CHECK(
          us == 0, "--launch-ahead-us", us,
          "must be 0 in epx-bench (its times include the host's launch; the GPU spin that hides Python's "
          "host time is python -m epx_tools.bench's)");
    } else if (flag == "--tune") {
      o.tune = true;
      o.mode = "normal";
    } else if (flag == "--json") {
      o.json = true;
    } else if (flag == "--json-file") {
      json_file = value();
    } else {
      EPX_FAIL("unknown flag ", flag, " (see --help)");
    }
    if (has_inline_value) EPX_FAIL(flag, " takes no value (see --help)");
  }
  validate_options(o);
  return true;
}

int run_cpu_reference(const BenchOptions& o, const std::string& json_path) {
  const std::vector<std::string> ignored = epx::bench::gpu_only_flags_set(o);
  if (!ignored.empty()) {
    std::string list;
    for (const std::string& flag : ignored) list += (list.empty() ? "" : ", ") + flag;
    std::fprintf(stderr, "epx-bench: no GPU: %s %s GPU runs only; the CPU reference run ignores %s\n",
                 list.c_str(), ignored.size() == 1 ? "applies to" : "apply to",
                 ignored.size() == 1 ? "it" : "them");
  }
  epx::reference::CpuReferenceBenchShape shape;
  shape.with_normal = o.mode != "low-latency";
  shape.with_low_latency = o.mode != "normal";
  if (o.num_ranks > 0) shape.num_ranks = o.num_ranks;
  shape.num_tokens = o.num_tokens;
  shape.hidden = o.hidden;
  shape.num_topk = o.num_topk;
  shape.num_experts = o.num_experts;
  shape.ll_num_tokens = o.ll_num_tokens;
  shape.ll_num_experts = o.ll_num_experts;
  std::ofstream json_file;
  if (!json_path.empty()) {
    json_file.open(json_path);
    EPX_CHECK(json_file.good(), "--json-file", json_path, "must be a writable path");
  }
  return epx::reference::run_cpu_reference_bench(shape, o.json, std::cout, std::cerr,
                                                 json_path.empty() ? nullptr : &json_file);
}

#if defined(EPX_WITH_CUDA)
// Rows of every rank, gathered: rank_rows[r][i] is rank r's row i (times and bytes differ per rank).
std::vector<std::vector<epx::bench::BenchRow>> gather_rows(epx::Bootstrap& bootstrap,
                                                           const std::vector<epx::bench::BenchRow>& mine) {
  constexpr size_t kValuesPerRow = 3;
  std::vector<double> values;
  for (const auto& row : mine) {
    values.push_back(row.time_us);
    values.push_back(row.bytes);
    values.push_back(row.network_bytes);
  }
  const std::vector<std::byte> gathered = bootstrap.all_gather(values.data(), sizeof(double) * values.size());
  std::vector<std::vector<epx::bench::BenchRow>> all(bootstrap.num_ranks(), mine);
  for (int r = 0; r < bootstrap.num_ranks(); ++r) {
    const auto* theirs = reinterpret_cast<const double*>(gathered.data()) + r * values.size();
    for (size_t i = 0; i < mine.size(); ++i) {
      all[r][i].time_us = theirs[kValuesPerRow * i];
      all[r][i].bytes = theirs[kValuesPerRow * i + 1];
      all[r][i].network_bytes = theirs[kValuesPerRow * i + 2];
    }
  }
  return all;
}

// Prints one mode's rows (and writes them to the JSON file).
void report(const std::vector<std::vector<epx::bench::BenchRow>>& rows, const BenchOptions& o,
            std::FILE* json_file, const std::string& header, const std::string& mode) {
  epx::bench::print_rows(rows, stdout, o.json, header, mode);
  if (json_file != nullptr) epx::bench::print_rows(rows, json_file, true, header, mode);
}

int run_gpus(const BenchOptions& o, int num_gpus, const std::string& json_path) {
  const int num_ranks = o.num_ranks > 0 ? o.num_ranks : num_gpus;
  EPX_CHECK(num_ranks <= num_gpus * o.ranks_per_gpu, "--ranks", num_ranks,
            "must be <= the number of visible GPUs times --ranks-per-gpu");
  if (o.num_ranks == 0) {
    epx::bench::check_ranks_per_node("--ranks-per-node", o.ranks_per_node, num_ranks, "the visible GPUs");
    epx::bench::check_ranks_per_node("--ll-ranks-per-node", o.ll_ranks_per_node, num_ranks,
                                     "the visible GPUs");
  }
  epx::LocalLaunchOptions launch;
  launch.num_ranks = num_ranks;
  launch.timeout = std::chrono::milliseconds(600000);
  const epx::LocalLaunchResult result = epx::launch_local(launch, [&](epx::Bootstrap& bootstrap) {
    EPX_CUDA_CHECK(cudaSetDevice(bootstrap.rank() % num_gpus));
    std::FILE* json_file = nullptr;
    cudaDeviceProp prop{};  // rank 0's GPU: the header's name and SMs, --tune's GPU kind
    if (bootstrap.rank() == 0) {
      cudaGetDeviceProperties(&prop, 0);
      if (!o.json) {
        std::printf(
            "epx-bench on %d x %s (%d SMs each), one process per GPU; medians of %s after %d warm-up\n",
            num_ranks, prop.name, prop.multiProcessorCount,
            epx::bench::count_of(o.iters, "run", "runs").c_str(), o.warmup);
        if (o.ranks_per_gpu > 1) {
          std::printf("%d ranks share each GPU: the times below check the logic, they are not speeds\n",
                      o.ranks_per_gpu);
        }
      }
      if (!json_path.empty()) json_file = std::fopen(json_path.c_str(), "w");
    }
    if (o.mode != "low-latency") {
      const auto rows = gather_rows(bootstrap, epx::bench::run_normal_bench(bootstrap, o));
      const std::string header = epx::bench::normal_header(o, num_ranks);
      if (bootstrap.rank() == 0) report(rows, o, json_file, header, "normal");
      if (bootstrap.rank() == 0 && o.tune) {
        // Beside each best, the default a call without a config runs on this GPU kind (recommended_config).
        const epx::GpuKind kind = epx::gpu_kind_of(prop.name);
        std::printf(
            "\nfastest config per op and SM budget (Config(num_sms, send chunk, queue tokens, ...)),\n"
            "beside the default on this GPU kind (%s):\n",
            epx::gpu_kind_name(kind));
        const auto summaries = epx::bench::summarize_rows(rows);
        for (const epx::bench::TunedConfig& best : epx::bench::fastest_tuned_configs(summaries)) {
          const bool combine = best.op.rfind("combine", 0) == 0;
          const epx::Config def = epx::recommended_config(
              combine ? epx::ConfigFor::kCombine : epx::ConfigFor::kDispatch, num_ranks, best.num_sms, kind);
          const double def_us =
              epx::bench::tuned_row_us(summaries, best.op, best.num_sms, def.num_max_nvl_chunked_send_tokens,
                                       def.num_max_nvl_chunked_recv_tokens);
          std::printf("  %-22s %3d SMs: chunk %3d, queue %4d  %8.1f us;  default chunk %3d, queue %4d: ",
                      best.op.c_str(), best.num_sms, best.send_chunk, best.queue_tokens, best.mean_us,
                      def.num_max_nvl_chunked_send_tokens, def.num_max_nvl_chunked_recv_tokens);
          if (def_us > 0) {
            std::printf("%8.1f us (+%.1f %%)\n", def_us, 100.0 * (def_us / best.mean_us - 1.0));
          } else {
            std::printf("not in the sweep\n");
          }
        }
      }
    }
    if (o.mode != "normal") {
      const auto rows = gather_rows(bootstrap, epx::bench::run_low_latency_bench(bootstrap, o));
      const std::string header = epx::bench::low_latency_header(o, num_ranks);
      if (bootstrap.rank() == 0) report(rows, o, json_file, header, "low-latency");
    }
    if (json_file != nullptr) std::fclose(json_file);
    return 0;
  });
  if (!result.ok()) {
    std::fprintf(stderr, "epx-bench failed: %s\n", result.summary().c_str());
    return 1;
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  try {
    BenchOptions options;
    std::string json_file;
    if (!parse(argc, argv, options, json_file)) return 0;
#if defined(EPX_WITH_CUDA)
    const int num_gpus = epx::visible_gpu_count();
    if (num_gpus > 0) return run_gpus(options, num_gpus, json_file);
#endif
    return run_cpu_reference(options, json_file);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-bench: %s\n", e.what());
    return 2;
  }
}
