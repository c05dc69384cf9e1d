#pragma once

#include <vector>

#include "reference/normal.hpp"

// The combine reduction both references use: normal_combine (one group of every rank, partials unrounded) and
// internode_combine (one group per node, each partial rounded to BF16 as it crosses the network).
namespace epx::reference::detail {

// Sums start at -0.0f, the identity of float addition: a sum is exactly its terms added left to right (one
// term gives itself, -0.0 included; +0.0f would turn a lone -0.0 into +0.0).
constexpr float kSumStart = -0.0f;

// For every token of every rank, in float32: for each group of `ranks_per_group` consecutive ranks in
// ascending order, partial = kSumStart + the returned copies of its ranks in ascending rank order (groups
// that got no copy are skipped); acc = kSumStart + each partial (rounded to BF16 first when
// `round_partials`); acc += bias0, bias1; combined_x = BF16(acc). A token with no source at all (no copy, no
// bias) is +0.0; without `round_partials`, a token with exactly one source is that source, bit for bit. The
// top-k weights are summed from +0.0f in the same order, never rounded. Throws epx::Error naming the
// argument when `inputs` do not fit the handle and params.
std::vector<NormalCombineRankOutput> combine_by_groups(const NormalHandle& handle,
                                                       const NormalCombineParams& params,
                                                       const std::vector<NormalCombineRankInput>& inputs,
                                                       int ranks_per_group, bool round_partials);

}  // namespace epx::reference::detail
