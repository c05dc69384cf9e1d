#pragma once

#include <cstdint>
#include <vector>

// Seeded test inputs shared by the CPU and GPU tests. Every generator is a pure function of its arguments
// (own PRNG, no std:: distributions), so the same seed gives the same data on every platform.
namespace epx::reference {

// splitmix64: tiny, fast, and good enough for test data.
class TestRng {
 public:
  explicit TestRng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64();
  uint32_t uniform_int(uint32_t bound);  // [0, bound), bound >= 1
  float uniform_float();                 // [0, 1), multiples of 2^-24
  bool bernoulli(double probability);

 private:
  uint64_t state_;
};

// ---- Routing ([T, K] int64, -1 = none) ----

// Each token picks num_topk distinct experts uniformly from [0, num_experts) (entries past num_experts are
// -1).
std::vector<int64_t> random_topk_idx(uint64_t seed, int num_tokens, int num_topk, int num_experts);

struct RoutingSpec {
  int num_tokens = 0;
  int num_topk = 0;
  int num_experts = 0;
  int num_ranks = 1;  // only used by excluded_ranks
  std::vector<int>
      hot_experts;  // picked with probability hot_probability per pick (while unused ones remain)
  double hot_probability = 0.0;
  std::vector<int> excluded_experts;  // never picked (experts that receive no tokens)
  std::vector<int> excluded_ranks;    // no expert living on these ranks is picked
  double drop_probability = 0.0;      // each entry independently becomes -1
};

// Distinct experts per token (a token runs out of allowed experts -> the rest are -1).
std::vector<int64_t> make_topk_idx(const RoutingSpec& spec, uint64_t seed);

// Per-rank routing that hits the corners at once (num_ranks >= 2): source rank num_ranks-1 routes every token
// nowhere (all -1); no token picks an expert of rank 0 (it receives nothing); experts L and L+1 (rank 1) are
// hot (60% of picks); expert num_experts-1 is never picked; 10% of the other entries are -1. With one rank
// only the hot / cold / -1 parts apply.
std::vector<std::vector<int64_t>> make_unbalanced_routing(uint64_t seed, const std::vector<int>& num_tokens,
                                                          int num_topk, int num_experts, int num_ranks);

// Every rank's top-k ids: make_unbalanced_routing when `unbalanced`, else random_topk_idx per rank (seeded
// with seed * 100 + rank).
std::vector<std::vector<int64_t>> make_routing(uint64_t seed, const std::vector<int>& num_tokens,
                                               int num_topk, int num_experts, int num_ranks, bool unbalanced);

// Weights [T, K]: multiples of 1/16 in [1/16, 1] (so weighted sums of small integers are exact in float),
// given for every entry including -1 ones (receivers must zero those).
std::vector<float> random_topk_weights(uint64_t seed, int num_tokens, int num_topk);

// ---- Tokens ----

enum class TokenValues {
  kSmallIntegers,  // integers in [-8, 8]: sums of up to 8 copies (and of 1/16-multiple weights) are exact
  kUniform,        // uniform in [-1, 1) times a power of two in [2^-6, 1] per 128-channel group
};

// Stamp: when stamp is true and hidden >= kStampChannels, the first channels hold where the row came from:
//   channel 0 = src_rank + 1, channels 1..4 = token_idx in base 16, most significant digit first
// (all small integers, exact in BF16). A row is therefore never all zeros. Token indices >= 65536 wrap.
constexpr int kStampChannels = 5;

std::vector<uint16_t> random_bf16_tokens(uint64_t seed, int num_tokens, int hidden, int src_rank,
                                         TokenValues values = TokenValues::kSmallIntegers, bool stamp = true);

struct Stamp {
  int src_rank = -1;
  int token_idx = -1;
};
// Reads the stamp of a BF16 row; {-1, -1} when hidden < kStampChannels or the channels are not a stamp.
Stamp read_stamp(const uint16_t* row, int hidden);

struct Fp8Tokens {
  std::vector<uint8_t> x;     // [T, H] e4m3
  std::vector<float> scales;  // [T, H / 128]
};
// random_bf16_tokens(seed, ..., kUniform, stamp) quantized with quantize_fp8_row(round_scale). The stamp
// survives only approximately (FP8 has 3 mantissa bits). hidden must be a multiple of 128.
Fp8Tokens random_fp8_tokens(uint64_t seed, int num_tokens, int hidden, int src_rank, bool round_scale = false,
                            bool stamp = true);

}  // namespace epx::reference
