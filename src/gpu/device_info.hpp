#pragma once

#include <string>

namespace epx {

// Number of usable CUDA devices; 0 when there is no driver or no GPU (CI), never throws. Does not initialise
// CUDA in the calling process, so it is safe to call before forking workers.
int visible_gpu_count();

// The name of CUDA device `device` ("NVIDIA H200").
std::string device_name(int device);

// The PCI bus id of CUDA device `device`: what names a GPU across processes.
std::string device_pci_bus_id(int device);

// Whether `device` reaches the GPU with PCI bus id `peer_bus_id` directly (NVLink / P2P): true for the same
// GPU (ranks sharing one, a test setup), when peer access is possible, and when the peer's GPU is not visible
// to this process (CUDA IPC may still map its memory; opening it is then the real test).
bool device_reaches(int device, const std::string& peer_bus_id);

}  // namespace epx
