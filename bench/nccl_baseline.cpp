#include "nccl_baseline.hpp"

#include "epx/error.hpp"

#if defined(EPX_HAVE_NCCL)
#include <nccl.h>

#define EPX_NCCL_CHECK(call)                                                         \
  do {                                                                               \
    const ncclResult_t epx_status_ = (call);                                         \
    if (epx_status_ != ncclSuccess)                                                  \
      EPX_FAIL("NCCL call `", #call, "` failed: ", ncclGetErrorString(epx_status_)); \
  } while (0)
#endif

namespace epx::bench {

#if defined(EPX_HAVE_NCCL)
NcclAllToAll::NcclAllToAll(Bootstrap& bootstrap, bool enabled) : num_ranks_(bootstrap.num_ranks()) {
  if (!enabled) return;
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  id = all_gather_value(bootstrap, id)[0];
  ncclComm_t comm = nullptr;
  EPX_NCCL_CHECK(ncclCommInitRank(&comm, bootstrap.num_ranks(), id, bootstrap.rank()));
  comm_ = comm;
}

NcclAllToAll::~NcclAllToAll() {
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

bool NcclAllToAll::available() const {
  return comm_ != nullptr;
}

void NcclAllToAll::run(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes, cudaStream_t stream) {
  auto comm = static_cast<ncclComm_t>(comm_);
  size_t send_offset = 0, recv_offset = 0;
  EPX_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < num_ranks_; ++r) {
    EPX_NCCL_CHECK(
        ncclSend(static_cast<const char*>(send) + send_offset, send_bytes[r], ncclUint8, r, comm, stream));
    EPX_NCCL_CHECK(
        ncclRecv(static_cast<char*>(recv) + recv_offset, recv_bytes[r], ncclUint8, r, comm, stream));
    send_offset += send_bytes[r];
    recv_offset += recv_bytes[r];
  }
  EPX_NCCL_CHECK(ncclGroupEnd());
}
#else
NcclAllToAll::NcclAllToAll(Bootstrap& bootstrap, bool) : num_ranks_(bootstrap.num_ranks()) {}
NcclAllToAll::~NcclAllToAll() = default;
bool NcclAllToAll::available() const {
  return false;
}
void NcclAllToAll::run(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&,
                       cudaStream_t) {}
#endif

}  // namespace epx::bench
