#pragma once

#include <stdlib.h>

namespace epx::test {

// While alive, ranks of other nodes are reached through the transport's puts even where it could map them
// (EPX_INTERNODE_PUTS=1: the path a NIC takes, on GPUs that map each other). Normal mode reads it per call,
// low-latency mode when a Buffer is made; the rank processes a test starts inherit it.
struct InternodePutsOnly {
  InternodePutsOnly() { setenv("EPX_INTERNODE_PUTS", "1", 1); }
  ~InternodePutsOnly() { unsetenv("EPX_INTERNODE_PUTS"); }
  InternodePutsOnly(const InternodePutsOnly&) = delete;
  InternodePutsOnly& operator=(const InternodePutsOnly&) = delete;
};

}  // namespace epx::test
