#pragma once

#include <vector>

#include "epx/reference/normal.hpp"

// The combine reduction both references use: normal_combine (one group of every rank, partials unrounded) and
// internode_combine (one group per node, each partial rounded to BF16 as it crosses the network).
namespace epx::reference::detail {

// For every token of every rank, in float32: for each group of `ranks_per_group` consecutive ranks in
// ascending order, partial = +0.0f + the returned copies of its ranks in ascending rank order (groups that
// got no copy are skipped); acc = +0.0f + each partial (rounded to BF16 first when `round_partials`); acc +=
// bias0, bias1; combined_x = BF16(acc). The top-k weights are summed the same way, never rounded. Throws
// epx::Error naming the argument when `inputs` do not fit the handle and params.
std::vector<NormalCombineRankOutput> combine_by_groups(const NormalHandle& handle,
                                                       const NormalCombineParams& params,
                                                       const std::vector<NormalCombineRankInput>& inputs,
                                                       int ranks_per_group, bool round_partials);

}  // namespace epx::reference::detail
