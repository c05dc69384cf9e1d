// Stand-ins for the NVSHMEM transport where EPX was built without it: multi-node low-latency groups are
// refused with a clear error instead of failing to link.
#include "epx/error.hpp"
#include "kernels/internode_kernels.hpp"
#include "kernels/low_latency_kernels.hpp"
#include "runtime/remote_memory.hpp"

namespace epx {

namespace {

[[noreturn]] void no_nvshmem(const char* what) {
  EPX_FAIL(what,
           " needs the NVSHMEM transport, and this EPX was built without it (configure with "
           "EPX_WITH_NVSHMEM=ON; pip install nvidia-nvshmem-cu13==3.4.5)");
}

}  // namespace

RemoteMemory allocate_remote_memory(Bootstrap&, size_t, int) {
  no_nvshmem("a low-latency buffer spanning several NVLink nodes (ranks_per_node < num_ranks)");
}

namespace kernels {

void launch_low_latency_dispatch_remote(const LowLatencyDispatchArgs&, cudaStream_t) {
  no_nvshmem("low_latency_dispatch across nodes");
}
void launch_low_latency_combine_remote(const LowLatencyCombineArgs&, cudaStream_t) {
  no_nvshmem("low_latency_combine across nodes");
}
void launch_low_latency_clean_remote(const LowLatencyCleanArgs&, cudaStream_t) {
  no_nvshmem("clean_low_latency_buffer across nodes");
}

void launch_internode_notify(const InternodeNotifyArgs&, cudaStream_t) {
  no_nvshmem("normal-mode dispatch across nodes");
}
void launch_internode_dispatch(const InternodeDispatchArgs&, cudaStream_t) {
  no_nvshmem("normal-mode dispatch across nodes");
}
void launch_internode_combine(const InternodeCombineArgs&, cudaStream_t) {
  no_nvshmem("normal-mode combine across nodes");
}

}  // namespace kernels

}  // namespace epx
