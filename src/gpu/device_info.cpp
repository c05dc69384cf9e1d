#include "gpu/device_info.hpp"

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/cuda_check.hpp"

namespace epx {

int visible_gpu_count() {
  // Counted in a child process: initialising CUDA here would break the workers the caller forks next.
  const pid_t child = fork();
  if (child < 0) return 0;
  if (child == 0) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    _exit(count > 100 ? 100 : count);
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

std::string device_name(int device) {
  cudaDeviceProp properties{};
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  return properties.name;
}

std::string device_pci_bus_id(int device) {
  char bus_id[32] = {};
  EPX_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device));
  return bus_id;
}

bool device_reaches(int device, const std::string& peer_bus_id) {
  int peer_device = -1;
  if (cudaDeviceGetByPCIBusId(&peer_device, peer_bus_id.c_str()) != cudaSuccess) {
    (void)cudaGetLastError();  // not visible here: not an error
    return true;
  }
  if (peer_device == device) return true;
  int can_access = 0;
  EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_access, device, peer_device));
  return can_access != 0;
}

}  // namespace epx
