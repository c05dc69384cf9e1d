#include "reference/test_data.hpp"

#include <algorithm>
#include <cstddef>

#include "epx/error.hpp"
#include "formats/bf16.hpp"
#include "formats/fp8.hpp"

namespace epx::reference {

uint64_t TestRng::next_u64() {
  state_ += 0x9E3779B97F4A7C15ull;
  uint64_t z = state_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint32_t TestRng::uniform_int(uint32_t bound) {
  // Multiply-shift: a bias below 2^-32 does not matter for test data.
  return static_cast<uint32_t>(((next_u64() >> 32) * static_cast<uint64_t>(bound)) >> 32);
}

float TestRng::uniform_float() {
  return static_cast<float>(next_u64() >> 40) * 5.9604644775390625e-8f;
}

bool TestRng::bernoulli(double probability) {
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53 < probability;
}

namespace {

uint64_t mix_seed(uint64_t seed, uint64_t stream) {
  TestRng rng(seed ^ (stream * 0xD1B54A32D192ED03ull));
  return rng.next_u64();
}

bool contains(const int64_t* ids, int count, int64_t expert) {
  for (int j = 0; j < count; ++j) {
    if (ids[j] == expert) return true;
  }
  return false;
}

// Uniform pick from `pool` that the token has not chosen yet; -1 when none is left.
int64_t pick_unchosen(TestRng& rng, const std::vector<int>& pool, const int64_t* chosen, int num_chosen) {
  int num_free = 0;
  for (int expert : pool) num_free += contains(chosen, num_chosen, expert) ? 0 : 1;
  if (num_free == 0) return -1;
  uint32_t skip = rng.uniform_int(static_cast<uint32_t>(num_free));
  for (int expert : pool) {
    if (contains(chosen, num_chosen, expert)) continue;
    if (skip-- == 0) return expert;
  }
  return -1;
}

// Rejection sampling for the common case of a large pool; falls back to the exact scan.
int64_t pick_from_pool(TestRng& rng, const std::vector<int>& pool, const int64_t* chosen, int num_chosen) {
  if (pool.empty()) return -1;
  for (int attempt = 0; attempt < 32; ++attempt) {
    const int expert = pool[rng.uniform_int(static_cast<uint32_t>(pool.size()))];
    if (!contains(chosen, num_chosen, expert)) return expert;
  }
  return pick_unchosen(rng, pool, chosen, num_chosen);
}

}  // namespace

std::vector<int64_t> make_topk_idx(const RoutingSpec& spec, uint64_t seed) {
  EPX_CHECK(spec.num_tokens >= 0, "num_tokens", spec.num_tokens, "must be >= 0");
  EPX_CHECK(spec.num_topk >= 0, "num_topk", spec.num_topk, "must be >= 0");
  EPX_CHECK(spec.num_experts >= 1, "num_experts", spec.num_experts, "must be >= 1");
  EPX_CHECK(spec.num_ranks >= 1, "num_ranks", spec.num_ranks, "must be >= 1");
  EPX_CHECK(spec.num_experts % spec.num_ranks == 0, "num_experts", spec.num_experts,
            "must be a multiple of num_ranks");
  const int experts_per_rank = spec.num_experts / spec.num_ranks;
  std::vector<uint8_t> allowed(spec.num_experts, 1);
  for (int expert : spec.excluded_experts) {
    if (expert >= 0 && expert < spec.num_experts) allowed[expert] = 0;
  }
  for (int rank : spec.excluded_ranks) {
    for (int e = 0; e < experts_per_rank; ++e) {
      if (rank >= 0 && rank < spec.num_ranks) allowed[rank * experts_per_rank + e] = 0;
    }
  }
  std::vector<int> pool;
  for (int e = 0; e < spec.num_experts; ++e) {
    if (allowed[e]) pool.push_back(e);
  }
  std::vector<int> hot_pool;
  for (int expert : spec.hot_experts) {
    const bool valid = expert >= 0 && expert < spec.num_experts && allowed[expert];
    if (valid && std::find(hot_pool.begin(), hot_pool.end(), expert) == hot_pool.end())
      hot_pool.push_back(expert);
  }

  TestRng rng(seed);
  std::vector<int64_t> ids(static_cast<size_t>(spec.num_tokens) * spec.num_topk, -1);
  for (int t = 0; t < spec.num_tokens; ++t) {
    int64_t* row = ids.data() + static_cast<size_t>(t) * spec.num_topk;
    for (int k = 0; k < spec.num_topk; ++k) {
      if (spec.drop_probability > 0.0 && rng.bernoulli(spec.drop_probability)) continue;
      int64_t expert = -1;
      if (!hot_pool.empty() && rng.bernoulli(spec.hot_probability))
        expert = pick_unchosen(rng, hot_pool, row, k);
      if (expert < 0) expert = pick_from_pool(rng, pool, row, k);
      row[k] = expert;
    }
  }
  return ids;
}

std::vector<int64_t> random_topk_idx(uint64_t seed, int num_tokens, int num_topk, int num_experts) {
  RoutingSpec spec;
  spec.num_tokens = num_tokens;
  spec.num_topk = num_topk;
  spec.num_experts = num_experts;
  return make_topk_idx(spec, seed);
}

std::vector<std::vector<int64_t>> make_unbalanced_routing(uint64_t seed, const std::vector<int>& num_tokens,
                                                          int num_topk, int num_experts, int num_ranks) {
  EPX_CHECK(num_tokens.size() == static_cast<size_t>(num_ranks), "num_tokens.size()", num_tokens.size(),
            "must equal num_ranks");
  EPX_CHECK(num_ranks >= 1, "num_ranks", num_ranks, "must be >= 1");
  EPX_CHECK(num_experts % num_ranks == 0, "num_experts", num_experts, "must be a multiple of num_ranks");
  const int experts_per_rank = num_experts / num_ranks;
  std::vector<std::vector<int64_t>> routing(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    if (num_ranks >= 2 && s == num_ranks - 1) {
      routing[s].assign(static_cast<size_t>(num_tokens[s]) * num_topk, -1);
      continue;
    }
    RoutingSpec spec;
    spec.num_tokens = num_tokens[s];
    spec.num_topk = num_topk;
    spec.num_experts = num_experts;
    spec.num_ranks = num_ranks;
    spec.hot_experts = {experts_per_rank, experts_per_rank + 1};
    spec.hot_probability = 0.6;
    spec.excluded_experts = {num_experts - 1};
    if (num_ranks >= 2) spec.excluded_ranks = {0};
    spec.drop_probability = 0.1;
    routing[s] = make_topk_idx(spec, mix_seed(seed, s));
  }
  return routing;
}

std::vector<float> random_topk_weights(uint64_t seed, int num_tokens, int num_topk) {
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
  EPX_CHECK(num_topk >= 0, "num_topk", num_topk, "must be >= 0");
  TestRng rng(seed);
  std::vector<float> weights(static_cast<size_t>(num_tokens) * num_topk);
  for (float& w : weights) w = static_cast<float>(1 + rng.uniform_int(16)) * 0.0625f;
  return weights;
}

std::vector<uint16_t> random_bf16_tokens(uint64_t seed, int num_tokens, int hidden, int src_rank,
                                         TokenValues values, bool stamp) {
  EPX_CHECK(num_tokens >= 0, "num_tokens", num_tokens, "must be >= 0");
  EPX_CHECK(hidden >= 1, "hidden", hidden, "must be >= 1");
  TestRng rng(seed);
  std::vector<uint16_t> x(static_cast<size_t>(num_tokens) * hidden);
  if (values == TokenValues::kSmallIntegers) {
    // Four 16-bit draws per 64-bit word keep the big shapes fast.
    uint16_t table[17];
    for (int v = 0; v < 17; ++v) table[v] = float_to_bf16(static_cast<float>(v - 8));
    size_t i = 0;
    for (; i + 4 <= x.size(); i += 4) {
      const uint64_t bits = rng.next_u64();
      for (int j = 0; j < 4; ++j) x[i + j] = table[(((bits >> (16 * j)) & 0xFFFFu) * 17u) >> 16];
    }
    for (; i < x.size(); ++i) x[i] = table[rng.uniform_int(17)];
  } else {
    for (size_t row = 0; row < static_cast<size_t>(num_tokens); ++row) {
      float group_factor = 1.0f;
      for (int c = 0; c < hidden; ++c) {
        if (c % 128 == 0) group_factor = 1.0f / static_cast<float>(1u << rng.uniform_int(7));
        x[row * hidden + c] = float_to_bf16((rng.uniform_float() * 2.0f - 1.0f) * group_factor);
      }
    }
  }
  if (stamp && hidden >= kStampChannels) {
    for (int t = 0; t < num_tokens; ++t) {
      uint16_t* row = x.data() + static_cast<size_t>(t) * hidden;
      row[0] = float_to_bf16(static_cast<float>(src_rank + 1));
      for (int digit = 0; digit < 4; ++digit) {
        row[1 + digit] = float_to_bf16(static_cast<float>((t >> (4 * (3 - digit))) & 15));
      }
    }
  }
  return x;
}

Stamp read_stamp(const uint16_t* row, int hidden) {
  if (hidden < kStampChannels) return Stamp{};
  const float rank_plus_one = bf16_to_float(row[0]);
  if (!(rank_plus_one >= 1.0f && rank_plus_one < 256.0f) ||
      rank_plus_one != static_cast<int>(rank_plus_one)) {
    return Stamp{};
  }
  int token_idx = 0;
  for (int digit = 0; digit < 4; ++digit) {
    const float value = bf16_to_float(row[1 + digit]);
    if (!(value >= 0.0f && value <= 15.0f) || value != static_cast<int>(value)) return Stamp{};
    token_idx = token_idx * 16 + static_cast<int>(value);
  }
  return Stamp{static_cast<int>(rank_plus_one) - 1, token_idx};
}

Fp8Tokens random_fp8_tokens(uint64_t seed, int num_tokens, int hidden, int src_rank, bool round_scale,
                            bool stamp) {
  EPX_CHECK(hidden % kFp8GroupSize == 0, "hidden", hidden, "must be a multiple of 128 for FP8");
  const std::vector<uint16_t> bf16 =
      random_bf16_tokens(seed, num_tokens, hidden, src_rank, TokenValues::kUniform, stamp);
  const int num_groups = hidden / kFp8GroupSize;
  Fp8Tokens tokens;
  tokens.x.resize(static_cast<size_t>(num_tokens) * hidden);
  tokens.scales.resize(static_cast<size_t>(num_tokens) * num_groups);
  for (int t = 0; t < num_tokens; ++t) {
    quantize_fp8_row(&bf16[static_cast<size_t>(t) * hidden], hidden, round_scale,
                     &tokens.x[static_cast<size_t>(t) * hidden],
                     &tokens.scales[static_cast<size_t>(t) * num_groups]);
  }
  return tokens;
}

std::vector<std::vector<int64_t>> make_routing(uint64_t seed, const std::vector<int>& num_tokens,
                                               int num_topk, int num_experts, int num_ranks,
                                               bool unbalanced) {
  if (unbalanced) return make_unbalanced_routing(seed, num_tokens, num_topk, num_experts, num_ranks);
  std::vector<std::vector<int64_t>> routing;
  for (int r = 0; r < num_ranks; ++r) {
    routing.push_back(random_topk_idx(seed * 100 + r, num_tokens[r], num_topk, num_experts));
  }
  return routing;
}

}  // namespace epx::reference
