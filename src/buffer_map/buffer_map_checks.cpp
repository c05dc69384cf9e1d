#include "buffer_map/buffer_map_checks.hpp"

#include "epx/error.hpp"

namespace epx::detail {

void check_hidden_bytes(size_t hidden_bytes) {
  EPX_CHECK(hidden_bytes > 0, "hidden_bytes", hidden_bytes, "must be > 0");
  EPX_CHECK(hidden_bytes % 16 == 0, "hidden_bytes", hidden_bytes, "must be a multiple of 16");
}

void check_queues_fit(size_t needed, size_t buffer_bytes, const char* buffer_name, const std::string& peers,
                      int num_channels, int queue_tokens, int record_bytes, const char* hint) {
  EPX_CHECK(needed <= buffer_bytes, buffer_name, buffer_bytes,
            concat("must be >= ", needed, " for this call (", peers, ", ", num_channels, " channels, ",
                   queue_tokens, " tokens per queue, ", record_bytes, "-byte records); size it with ", hint,
                   " for the configs used")
                .c_str());
}

}  // namespace epx::detail
