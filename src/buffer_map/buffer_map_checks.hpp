#pragma once

#include <cstddef>
#include <string>

// Checks the buffer maps share (normal_buffer_map.cpp, internode_buffer_map.cpp).
namespace epx::detail {

// Row bytes a size hint is asked for: > 0 and a multiple of 16.
void check_hidden_bytes(size_t hidden_bytes);

// Throws epx::Error naming `buffer_name` (= buffer_bytes) unless `needed` bytes fit: "must be >= needed for
// this call (`peers`, C channels, Q tokens per queue, B-byte records); size it with `hint` for the configs
// used".
void check_queues_fit(size_t needed, size_t buffer_bytes, const char* buffer_name, const std::string& peers,
                      int num_channels, int queue_tokens, int record_bytes, const char* hint);

}  // namespace epx::detail
