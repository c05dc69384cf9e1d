#pragma once

#include "common/host_device.hpp"

// The rules a combine sender group's writer warps and its publisher warp follow (EPX_COMBINE_PUBLISHER_WARP):
// chunk k of the group's stream holds ring slot k % 2 until published; the writers' leader starts chunk k
// once the publisher took chunk k - 2, the slot's last user; the publisher takes chunk k once every writer
// warp arrived for it, then stores the queue's tail at the chunk's end. So a writer never waits for a
// system-scope release, and a slot never counts arrivals of two chunks. Plain arithmetic shared by the kernel
// and the CPU test (tests/cpu/test_combine_publish_ring.cpp), which runs random schedules of writers,
// publisher and reader.
namespace epx::kernels {

constexpr int kPublishRingSlots = 2;

EPX_HD int publish_ring_slot(int chunk) {
  return chunk % kPublishRingSlots;
}

// Whether the writers may start chunk `chunk` once `published` chunks are published.
EPX_HD bool writers_may_start(int chunk, int published) {
  return published >= chunk - (kPublishRingSlots - 1);
}

// Whether the publisher may take the chunk of a slot that `arrived` of `num_writers` writer warps finished.
EPX_HD bool publisher_may_take(int arrived, int num_writers) {
  return arrived >= num_writers;
}

// The publisher needs a warp of its own and leaves at least two writers.
EPX_HD bool group_takes_publisher(int group_warps) {
  return group_warps >= 3;
}

}  // namespace epx::kernels
