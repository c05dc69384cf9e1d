#include "bootstrap/topology.hpp"

#include <unistd.h>

#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>

#include "buffer_map/internode_buffer_map.hpp"
#include "epx/error.hpp"

namespace epx {

namespace {

// Copies `text` into a fixed field, cut to fit and always terminated.
template <size_t N>
void copy_field(char (&field)[N], const std::string& text) {
  std::memset(field, 0, N);
  std::memcpy(field, text.data(), text.size() < N - 1 ? text.size() : N - 1);
}

template <size_t N>
std::string field_text(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}

std::string message_of(const std::exception& error) {
  const auto* epx_error = dynamic_cast<const Error*>(&error);
  return epx_error != nullptr ? epx_error->message() : error.what();
}

// "{0, 1} on a, {2, 3} on b": the nodes found, for messages.
std::string describe_nodes(const std::vector<std::vector<int>>& nodes,
                           const std::vector<RankLocation>& locations) {
  std::ostringstream out;
  for (size_t k = 0; k < nodes.size(); ++k) {
    out << (k == 0 ? "{" : ", {");
    for (size_t i = 0; i < nodes[k].size(); ++i) out << (i == 0 ? "" : ", ") << nodes[k][i];
    out << "} on " << locations[nodes[k].front()].host_name();
  }
  return out.str();
}

// What every rank tells the others in the last round: its ranks_per_node, or why it has none.
struct RankChoice {
  int ranks_per_node;
  char error[500];
};

}  // namespace

bool RankLocation::same_host(const RankLocation& other) const {
  return field_text(hostname) == field_text(other.hostname) &&
         field_text(boot_id) == field_text(other.boot_id);
}

std::string RankLocation::host_name() const {
  return field_text(hostname);
}

RankLocation local_rank_location(const std::string& device_id) {
  RankLocation location{};
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  copy_field(location.hostname, name);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;  // stays empty where there is none
  copy_field(location.boot_id, boot_id);
  copy_field(location.device_id, device_id);
  return location;
}

int detect_ranks_per_node(const std::vector<RankLocation>& locations, const std::vector<uint8_t>& reachable) {
  const size_t num_ranks = locations.size();
  EPX_CHECK(num_ranks >= 1, "locations.size()", num_ranks, "must be >= 1");
  EPX_CHECK(reachable.size() == num_ranks * num_ranks, "reachable.size()", reachable.size(),
            "must be num_ranks * num_ranks");
  auto mutual = [&](int a, int b) {
    return reachable[a * num_ranks + b] != 0 && reachable[b * num_ranks + a] != 0;
  };

  std::vector<std::vector<int>> nodes;
  for (int rank = 0; rank < static_cast<int>(num_ranks); ++rank) {
    bool placed = false;
    for (std::vector<int>& node : nodes) {
      if (!locations[node.front()].same_host(locations[rank])) continue;
      bool reaches_all = true;
      for (int member : node) reaches_all = reaches_all && mutual(rank, member);
      if (!reaches_all) continue;
      node.push_back(rank);
      placed = true;
      break;
    }
    if (!placed) nodes.push_back({rank});
  }

  const size_t ranks_per_node = nodes.front().size();
  const char* what = "(nodes are the ranks of one host whose GPUs reach each other over NVLink/P2P)";
  for (const std::vector<int>& node : nodes) {
    EPX_CHECK(node.size() == ranks_per_node, "node layout", describe_nodes(nodes, locations),
              detail::concat("every node must have the same number of ranks ", what).c_str());
  }
  for (size_t k = 0; k < nodes.size(); ++k) {
    for (size_t i = 0; i < ranks_per_node; ++i) {
      EPX_CHECK(nodes[k][i] == static_cast<int>(k * ranks_per_node + i), "node layout",
                describe_nodes(nodes, locations),
                detail::concat("every node must be a block of consecutive ranks ", what,
                               "; start the ranks host by host")
                    .c_str());
    }
  }
  return static_cast<int>(ranks_per_node);
}

int agree_ranks_per_node(Bootstrap& bootstrap, const TopologyRequest& request) {
  const int num_ranks = bootstrap.num_ranks();
  const int rank = bootstrap.rank();
  std::string error = request.error;

  const std::vector<RankLocation> locations = all_gather_value(bootstrap, request.location);
  std::vector<uint8_t> row(num_ranks, 0);
  try {
    for (int peer = 0; peer < num_ranks && error.empty(); ++peer) {
      row[peer] =
          peer == rank || (locations[peer].same_host(request.location) && request.can_reach(locations[peer]));
    }
  } catch (const std::exception& failure) {
    error = message_of(failure);
  }
  // A rank that failed so far marks its own entry, so the others skip detection (which its empty row would
  // only confuse) and everyone reports its error.
  constexpr uint8_t kFailed = 2;
  if (!error.empty()) row[rank] = kFailed;
  const std::vector<std::byte> rows = bootstrap.all_gather(row.data(), row.size());
  std::vector<uint8_t> reachable(rows.size());
  std::memcpy(reachable.data(), rows.data(), rows.size());
  bool any_failed = false;
  for (int r = 0; r < num_ranks; ++r)
    any_failed = any_failed || reachable[size_t(r) * num_ranks + r] == kFailed;

  RankChoice mine{};
  try {
    if (!any_failed) {
      const int detected = detect_ranks_per_node(locations, reachable);
      if (request.ranks_per_node == 0) {
        validate_node_split(num_ranks, detected, "ranks_per_node (detected)");
        mine.ranks_per_node = detected;
      } else {
        const char* name = request.source.c_str();
        EPX_CHECK(request.ranks_per_node >= 0, name, request.ranks_per_node, "must be >= 0 (0: detect)");
        validate_node_split(num_ranks, request.ranks_per_node, name);
        EPX_CHECK(detected % request.ranks_per_node == 0, name, request.ranks_per_node,
                  detail::concat("must divide the detected ranks per node (", detected,
                                 "): a node cannot span hosts or GPUs that do not reach each other")
                      .c_str());
        mine.ranks_per_node = request.ranks_per_node;
      }
    }
  } catch (const std::exception& failure) {
    error = message_of(failure);
  }
  copy_field(mine.error, error);

  const std::vector<RankChoice> choices = all_gather_value(bootstrap, mine);
  for (int r = 0; r < num_ranks; ++r) {
    if (choices[r].error[0] != '\0') EPX_FAIL("rank ", r, ": ", field_text(choices[r].error));
  }
  std::ostringstream values;
  bool same = true;
  for (int r = 0; r < num_ranks; ++r) {
    values << (r == 0 ? "" : ", ") << choices[r].ranks_per_node << " on rank " << r;
    same = same && choices[r].ranks_per_node == choices[0].ranks_per_node;
  }
  EPX_CHECK(same, "ranks_per_node", values.str(),
            "must be the same on every rank (set BufferOptions::ranks_per_node / EPX_RANKS_PER_NODE alike)");
  return choices[0].ranks_per_node;
}

}  // namespace epx
