#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bootstrap/topology.hpp"
#include "epx/error.hpp"
#include "epx/local_launcher.hpp"

// Node detection from host identities and peer access: the pure rule (detect_ranks_per_node) and the
// collective agreement every Buffer runs (agree_ranks_per_node, over the local launcher's bootstrap with
// made-up hosts).
namespace {

using epx::RankLocation;

RankLocation location(const std::string& host, const std::string& boot_id = "boot-1") {
  RankLocation where{};
  std::strncpy(where.hostname, host.c_str(), sizeof(where.hostname) - 1);
  std::strncpy(where.boot_id, boot_id.c_str(), sizeof(where.boot_id) - 1);
  return where;
}

std::vector<RankLocation> hosts(const std::vector<std::string>& names) {
  std::vector<RankLocation> locations;
  for (const std::string& name : names) locations.push_back(location(name));
  return locations;
}

std::vector<uint8_t> all_reach(size_t num_ranks) {
  return std::vector<uint8_t>(num_ranks * num_ranks, 1);
}

std::string detect_error(const std::vector<RankLocation>& locations, const std::vector<uint8_t>& reachable) {
  try {
    epx::detect_ranks_per_node(locations, reachable);
  } catch (const epx::Error& error) {
    return error.message();
  }
  return "";
}

TEST(Topology, RanksOfOneHostFormOneNode) {
  EXPECT_EQ(epx::detect_ranks_per_node(hosts({"a"}), all_reach(1)), 1);
  EXPECT_EQ(epx::detect_ranks_per_node(hosts({"a", "a", "a", "a"}), all_reach(4)), 4);
  EXPECT_EQ(epx::detect_ranks_per_node(hosts({"a", "a", "b", "b", "c", "c"}), all_reach(6)), 2);
  EXPECT_EQ(epx::detect_ranks_per_node(hosts({"a", "b", "c"}), all_reach(3)), 1);
}

TEST(Topology, TheBootIdTellsApartHostsThatShareAName) {
  const std::vector<RankLocation> locations = {location("localhost", "x"), location("localhost", "x"),
                                               location("localhost", "y"), location("localhost", "y")};
  EXPECT_EQ(epx::detect_ranks_per_node(locations, all_reach(4)), 2);
  EXPECT_TRUE(locations[0].same_host(locations[1]));
  EXPECT_FALSE(locations[1].same_host(locations[2]));
}

TEST(Topology, GpusThatDoNotReachEachOtherAreNotOneNode) {
  // One host, two islands of two GPUs: {0, 1} and {2, 3}.
  std::vector<uint8_t> islands(16, 0);
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) islands[a * 4 + b] = a / 2 == b / 2;
  }
  EXPECT_EQ(epx::detect_ranks_per_node(hosts({"a", "a", "a", "a"}), islands), 2);
  // Reaching must go both ways.
  std::vector<uint8_t> one_way = all_reach(2);
  one_way[0 * 2 + 1] = 0;
  EXPECT_EQ(epx::detect_ranks_per_node(hosts({"a", "a"}), one_way), 1);
  // Rank 3 reaches nobody: nodes of 3 and 1.
  std::vector<uint8_t> loner = all_reach(4);
  for (int r = 0; r < 3; ++r) loner[3 * 4 + r] = loner[r * 4 + 3] = 0;
  EXPECT_NE(detect_error(hosts({"a", "a", "a", "a"}), loner).find("every node must have the same number"),
            std::string::npos);
}

TEST(Topology, NodesMustBeEqualBlocksOfConsecutiveRanks) {
  const std::string interleaved = detect_error(hosts({"a", "b", "a", "b"}), all_reach(4));
  EXPECT_NE(interleaved.find("invalid node layout = {0, 2} on a, {1, 3} on b: every node must be a block of "
                             "consecutive ranks"),
            std::string::npos)
      << interleaved;
  const std::string unequal = detect_error(hosts({"a", "a", "a", "b"}), all_reach(4));
  EXPECT_NE(
      unequal.find("invalid node layout = {0, 1, 2} on a, {3} on b: every node must have the same number "
                   "of ranks"),
      std::string::npos)
      << unequal;
  EXPECT_NE(detect_error(hosts({"a", "a"}), all_reach(3)).find("invalid reachable.size() = 9"),
            std::string::npos);
}

TEST(Topology, LocalHostIdentityIsFilledIn) {
  const RankLocation here = epx::local_rank_location("0000:01:00.0");
  EXPECT_FALSE(here.host_name().empty());
  EXPECT_STREQ(here.device_id, "0000:01:00.0");
  EXPECT_TRUE(here.same_host(epx::local_rank_location("")));
}

// ---- The collective agreement ----

struct Scenario {
  std::vector<std::string> hosts;   // per rank
  std::vector<int> ranks_per_node;  // the override of each rank (0: detect)
  int failing_rank = -1;            // a rank whose request carries an error
  int unreachable_rank = -1;        // a rank no other GPU reaches (and that reaches none)
};

// Runs agree_ranks_per_node on every rank. Returns "" and sets `agreed` when every rank got the same value;
// else the error, after checking that every rank raised exactly the same one.
std::string agree(const Scenario& scenario, int* agreed = nullptr) {
  const int num_ranks = static_cast<int>(scenario.hosts.size());
  epx::LocalLaunchOptions options;
  options.num_ranks = num_ranks;
  options.timeout = std::chrono::milliseconds(20000);
  int fds[2];  // rank 0's child writes its result into the pipe
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const epx::LocalLaunchResult result = epx::launch_local(options, [&](epx::Bootstrap& bootstrap) {
    const int rank = bootstrap.rank();
    epx::TopologyRequest request;
    request.ranks_per_node = scenario.ranks_per_node.empty() ? 0 : scenario.ranks_per_node[rank];
    request.location = location(scenario.hosts[rank]);
    std::snprintf(request.location.device_id, sizeof(request.location.device_id), "gpu%d", rank);
    request.can_reach = [&](const RankLocation& peer) {
      return rank != scenario.unreachable_rank &&
             std::string(peer.device_id) != "gpu" + std::to_string(scenario.unreachable_rank);
    };
    if (rank == scenario.failing_rank) request.error = "invalid EPX_RANKS_PER_NODE = two: must be an integer";
    std::array<char, 512> text{};
    try {
      std::snprintf(text.data(), text.size(), "%d", epx::agree_ranks_per_node(bootstrap, request));
    } catch (const epx::Error& error) {
      std::snprintf(text.data(), text.size(), "error: %s", error.message().c_str());
    }
    const std::vector<std::array<char, 512>> texts = epx::all_gather_value(bootstrap, text);
    for (const auto& other : texts) {
      if (std::strcmp(other.data(), text.data()) != 0)
        throw std::runtime_error(std::string("ranks disagree: '") + other.data() + "' vs '" + text.data() +
                                 "'");
    }
    if (rank == 0 && write(fds[1], text.data(), text.size()) != static_cast<ssize_t>(text.size()))
      throw std::runtime_error("write failed");
    return 0;
  });
  close(fds[1]);
  char result_text[512] = {};
  const ssize_t got = read(fds[0], result_text, sizeof(result_text));
  close(fds[0]);
  EXPECT_TRUE(result.ok()) << result.summary();
  if (got != static_cast<ssize_t>(sizeof(result_text))) return "no result from rank 0";
  const std::string text(result_text);
  if (text.rfind("error: ", 0) == 0) return text.substr(7);
  if (agreed != nullptr) *agreed = std::stoi(text);
  return "";
}

TEST(Topology, EveryRankAgreesOnTheDetectedNodes) {
  int agreed = 0;
  EXPECT_EQ(agree({{"a", "a", "a", "a"}, {}}, &agreed), "");
  EXPECT_EQ(agreed, 4);  // one host: one node, as before detection existed
  EXPECT_EQ(agree({{"a", "a", "b", "b"}, {}}, &agreed), "");
  EXPECT_EQ(agreed, 2);
  EXPECT_EQ(agree({{"a", "b"}, {}}, &agreed), "");
  EXPECT_EQ(agreed, 1);
}

TEST(Topology, AnOverrideMakesVirtualNodesInsideRealOnes) {
  int agreed = 0;
  EXPECT_EQ(agree({{"a", "a", "a", "a"}, {2, 2, 2, 2}}, &agreed), "");
  EXPECT_EQ(agreed, 2);
  EXPECT_EQ(agree({{"a", "a", "b", "b"}, {1, 1, 1, 1}}, &agreed), "");
  EXPECT_EQ(agreed, 1);
  const std::string spans = agree({{"a", "a", "b", "b"}, {4, 4, 4, 4}});
  EXPECT_NE(spans.find("invalid ranks_per_node = 4: must divide the detected ranks per node (2)"),
            std::string::npos)
      << spans;
  const std::string uneven = agree({{"a", "a", "a", "a"}, {3, 3, 3, 3}});
  EXPECT_NE(uneven.find("invalid ranks_per_node = 3: must divide num_ranks (4)"), std::string::npos)
      << uneven;
}

TEST(Topology, EveryRankRaisesTheSameError) {
  // Choices that differ between ranks.
  const std::string differ = agree({{"a", "a", "a", "a"}, {2, 4, 4, 4}});
  EXPECT_NE(
      differ.find("invalid ranks_per_node = 2 on rank 0, 4 on rank 1, 4 on rank 2, 4 on rank 3: must be "
                  "the same on every rank"),
      std::string::npos)
      << differ;
  // One rank that could not prepare its request.
  const std::string failed = agree({{"a", "a", "a", "a"}, {}, 2});
  EXPECT_EQ(failed.rfind("rank 2: invalid EPX_RANKS_PER_NODE = two: must be an integer", 0), 0u) << failed;
  // Nodes that are not blocks of ranks, and a GPU nobody reaches.
  EXPECT_NE(agree({{"a", "b", "a", "b"}, {}}).find("every node must be a block of consecutive ranks"),
            std::string::npos);
  EXPECT_NE(agree({{"a", "a", "a", "a"}, {}, -1, 3}).find("{0, 1, 2} on a, {3} on a"), std::string::npos);
}

TEST(Topology, NodesOfMoreThanEightRanksCannotSpanNodes) {
  Scenario scenario;
  for (int r = 0; r < 18; ++r) scenario.hosts.push_back(r < 9 ? "a" : "b");
  const std::string big = agree(scenario);
  EXPECT_NE(
      big.find("invalid ranks_per_node (detected) = 9: must be <= 8 when the group spans nodes (18 ranks)"),
      std::string::npos)
      << big;
  // One host of 9 ranks is one node, as before (low-latency groups share GPUs this way).
  int agreed = 0;
  scenario.hosts.assign(9, "a");
  EXPECT_EQ(agree(scenario, &agreed), "");
  EXPECT_EQ(agreed, 9);
}

}  // namespace
