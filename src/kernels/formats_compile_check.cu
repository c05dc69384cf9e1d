// Compiles every EPX_HD number-format function for the device, so nvcc proves they are device-clean.
// Nothing launches this kernel; the CPU tests check the values, and the same headers run in the kernels.
#include <cstdint>

#include "formats/bf16.hpp"
#include "formats/fp8.hpp"
#include "formats/logfmt.hpp"

namespace epx::detail {

__global__ void formats_compile_check_kernel(const float* in, uint32_t* out) {
  const float x = in[threadIdx.x];
  uint32_t acc = float_as_bits(bf16_to_float(float_to_bf16(x)));
  acc ^= float_to_bf16_round_up(x) ^ float_to_bf16_round_down(x);

  const Fp8GroupScale scale = fp8_group_scale(fp8_amax_update(0.0f, x), (threadIdx.x & 1u) != 0u);
  const uint8_t q = fp8_quantize_value(x, scale);
  acc ^= float_as_bits(fp8_dequantize_value(q, scale)) ^ float_to_e4m3(x) ^ float_as_bits(e4m3_to_float(q));
  const uint8_t byte = ue8m0_from_pow2_scale(scale.scale);
  acc ^= pack_ue8m0x4(byte, q, 0, 0) ^ unpack_ue8m0x4(acc, 1) ^ float_as_bits(pow2_scale_from_ue8m0(byte));
  acc ^= static_cast<uint32_t>(ll_scale_index(1, threadIdx.x, 2, 32, 4));

  const float max_key = logfmt_abs_for_max(x);
  const LogfmtParams params = logfmt_params(max_key, logfmt_abs_for_min(x));
  const LogfmtParams decoded = logfmt_params_from_meta(params.max_bits, params.min_bits);
  const uint16_t code = logfmt_encode_value(x, params);
  uint8_t packed_bytes[5];
  logfmt_store_codes4(packed_bytes, logfmt_pack_codes4(code, code, code, code));
  const uint16_t unpacked = logfmt_unpack_code4(logfmt_load_codes4(packed_bytes), 3);
  acc ^= float_as_bits(logfmt_decode_value(unpacked, decoded)) ^ float_as_bits(logfmt_level(7, decoded));
  acc ^= logfmt_group_qualifies(max_key) ? 1u : 0u;
  out[threadIdx.x] = acc;
}

}  // namespace epx::detail
