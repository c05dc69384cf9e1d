#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "bootstrap/shared_object.hpp"
#include "epx/local_launcher.hpp"

namespace {

epx::LocalLaunchOptions options_for(int num_ranks) {
  epx::LocalLaunchOptions options;
  options.num_ranks = num_ranks;
  options.timeout = std::chrono::milliseconds(20000);
  return options;
}

void expect(bool ok, int rank, const std::string& what) {
  if (!ok) throw std::runtime_error("rank " + std::to_string(rank) + ": " + what);
}

// Every rank maps the one object rank 0 created: each writes its slot, and after a barrier sees every
// other rank's; the object starts zeroed, and its name is gone once unlink() ran (the mappings stay).
TEST(SharedObject, EveryRankMapsTheSameZeroedMemoryAndTheNameGoes) {
  for (int num_ranks : {1, 2, 4}) {
    const auto result = epx::launch_local(options_for(num_ranks), [](epx::Bootstrap& group) {
      const int rank = group.rank();
      epx::SharedObject object(group, 4096);
      group.barrier();  // every rank opened it
      expect(object.base() != nullptr, rank, "no mapping");
      expect(!object.name().empty(), rank, "no name");
      auto* words = static_cast<std::atomic<uint64_t>*>(object.base());
      expect(words[64 + rank].load() == 0, rank, "not zeroed");
      group.barrier();  // nobody writes before everyone checked the zeros
      words[rank].store(1000 + rank);
      group.barrier();
      for (int r = 0; r < group.num_ranks(); ++r)
        expect(words[r].load() == uint64_t(1000 + r), rank, "slot " + std::to_string(r));
      object.unlink();
      group.barrier();  // rank 0 has removed the name
      const int fd = shm_open(object.name().c_str(), O_RDWR, 0600);
      if (fd >= 0) close(fd);
      expect(fd < 0, rank, "the name " + object.name() + " still exists");
      expect(words[0].load() == 1000, rank, "the mapping went with the name");
      return 0;
    });
    EXPECT_TRUE(result.ok()) << result.summary();
  }
}

// Two objects of one process have different names.
TEST(SharedObject, TwoObjectsHaveTheirOwnNames) {
  const auto result = epx::launch_local(options_for(2), [](epx::Bootstrap& group) {
    epx::SharedObject first(group, 4096);
    epx::SharedObject second(group, 4096);
    group.barrier();  // every rank opened both: rank 0 may remove the names from here on
    expect(first.base() != nullptr && second.base() != nullptr, group.rank(), "no mapping");
    expect(first.name() != second.name(), group.rank(), "one name twice: " + first.name());
    static_cast<char*>(first.base())[0] = 1;
    expect(static_cast<char*>(second.base())[0] == 0, group.rank(), "the objects share memory");
    group.barrier();  // nobody unmaps before everyone checked
    return 0;
  });
  EXPECT_TRUE(result.ok()) << result.summary();
}

}  // namespace
