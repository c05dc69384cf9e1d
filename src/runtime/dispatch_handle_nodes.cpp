// DispatchHandle's arrays of normal mode across nodes (the State is runtime/dispatch_handle_state.hpp).
#include "epx/normal.hpp"
#include "runtime/dispatch_handle_state.hpp"

namespace epx {

int DispatchHandle::num_nodes() const {
  return state().num_nodes;
}
int DispatchHandle::num_forward_records() const {
  return state().num_nodes > 1 ? state().num_forward_records : 0;
}
const int* DispatchHandle::node_channel_offset_device() const {
  return state().num_nodes > 1 ? state().arrays.node_channel_offset : nullptr;
}
const uint8_t* DispatchHandle::forward_mask_device() const {
  return state().num_nodes > 1 ? state().arrays.forward_mask : nullptr;
}

}  // namespace epx
