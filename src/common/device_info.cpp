#include "common/device_info.hpp"

#include <cuda_runtime.h>

namespace epx {

int visible_gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later checks start clean
    return 0;
  }
  return count;
}

}  // namespace epx
