// bf16/fp16 <-> fp32 on the CPU, bit-exact with PyTorch's c10::BFloat16 / c10::Half.
//
// Branch-free integer and float arithmetic only, so the compiler vectorises the loops that call
// these with plain SSE2/AVX (no F16C needed, no _Float16 compiler support needed). Rounding is to
// nearest even, as in tensor.to(torch.bfloat16 / torch.float16). csrc/tests/test_convert.cpp
// checks every 16-bit pattern and the rounding boundaries.
#pragma once

#include <cstdint>
#include <cstring>

namespace fused_accum {
namespace cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bf16 is the top half of an fp32: widening is a shift.
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even by adding 0x7FFF plus the lowest kept bit, then truncate. NaN would
// carry into the exponent or lose its payload, so it becomes the canonical quiet NaN 0x7FC0.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// fp16 -> fp32. Normal and inf/NaN halves: move exponent and mantissa into place (>> 3 of the
// sign-stripped value) and re-bias the exponent by 112 = 127 - 15 with a multiply by 2^-112,
// after adding 224 to the exponent so that 31 (inf/NaN) lands on 255. Subnormal halves
// (exponent 0): the 10 mantissa bits m are placed in the mantissa of 0.5 and 0.5 is subtracted,
// which gives m * 2^-24 exactly.
inline float f16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // exponent and mantissa, sign shifted out
  const float normal = bits_float((two_w >> 4) + (224u << 23)) * 0x1.0p-112f;
  const float subnormal = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? float_bits(subnormal) : float_bits(normal);
  return bits_float(sign | magnitude);
}

// fp32 -> fp16, round to nearest even, overflow to inf. The float unit does the rounding: |f|
// is scaled by 2^112 * 2^-110 (the first product overflows to inf exactly when the half would),
// then added to a power of two chosen from f's exponent so that the sum keeps exactly the bits a
// half keeps (its ulp is the half's ulp; at least 2^-24, the subnormal ulp). The half's exponent
// and mantissa are then read off the sum's bits. NaN becomes 0x7E00 with f's sign.
inline uint16_t float_to_f16(float f) {
  const float scaled = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const uint32_t sum = float_bits(bits_float((bias >> 1) + 0x07800000u) + scaled);
  const uint32_t exp_bits = (sum >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = sum & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace cpu
}  // namespace fused_accum
