// The CPU dtype conversions (csrc/cpu/convert.h) against independent definitions: every one of
// the 65,536 bf16 and fp16 bit patterns is decoded from its IEEE fields, and fp32 -> bf16/fp16
// rounding is compared with nearest-even rounding done in double, on the values around every
// rounding boundary of the half range plus a spread of random floats.
#include <cmath>
#include <cstdint>
#include <random>

#include "../cpu/convert.h"
#include "check.h"

using namespace fused_accum::cpu;

namespace {

// IEEE binary16 decoded from its fields, in double.
double half_value(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  double v;
  if (exponent == 0x1F) v = mantissa ? NAN : INFINITY;
  else if (exponent == 0) v = std::ldexp(mantissa, -24);
  else v = std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -v : v;
}

// Round x to a format with `mantissa_bits` explicit bits, minimum normal exponent `emin` and
// largest finite value `max_finite`, to nearest even; overflow gives inf.
double round_to_format(double x, int mantissa_bits, int emin, double max_finite) {
  if (std::isnan(x) || x == 0) return x;
  int e;
  std::frexp(std::fabs(x), &e);  // |x| = f * 2^e, f in [0.5, 1)
  const int exponent = std::max(e - 1, emin);
  const double ulp = std::ldexp(1.0, exponent - mantissa_bits);
  const double r = std::nearbyint(x / ulp) * ulp;  // default rounding mode: ties to even
  // Overflow: anything rounding past max_finite (at max_finite + ulp/2 or above) is inf.
  if (std::fabs(r) > max_finite) return std::copysign(INFINITY, x);
  return r;
}

bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

void test_decode_every_pattern() {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const double want_half = half_value(h);
    CHECK(same(f16_to_float(h), want_half), "f16 0x%04x: %g, want %g", bits, f16_to_float(h), want_half);
    const float bf = bf16_to_float(h);
    CHECK(float_bits(bf) == bits << 16, "bf16 0x%04x", bits);
    // Every value of the narrow type is representable: converting back is exact.
    if (!std::isnan(want_half)) CHECK(float_to_f16(f16_to_float(h)) == h, "f16 round trip 0x%04x", bits);
    if (!std::isnan(bf)) CHECK(float_to_bf16(bf) == h, "bf16 round trip 0x%04x", bits);
  }
}

void check_rounding(float f) {
  const double want_h = round_to_format(f, 10, -14, 65504.0);
  CHECK(same(f16_to_float(float_to_f16(f)), want_h), "f16(%.9g) = %.9g, want %.9g", f,
        f16_to_float(float_to_f16(f)), want_h);
  const double want_b = round_to_format(f, 7, -126, 3.3895313892515355e38);
  CHECK(same(bf16_to_float(float_to_bf16(f)), want_b), "bf16(%.9g) = %.9g, want %.9g", f,
        bf16_to_float(float_to_bf16(f)), want_b);
}

void test_rounding() {
  // Around every half value: the midpoints to both neighbours and one fp32 ulp either side.
  for (uint32_t bits = 0; bits < 0x7C00; ++bits) {
    const double v = half_value(static_cast<uint16_t>(bits));
    const double next = half_value(static_cast<uint16_t>(bits + 1));
    const float mid = static_cast<float>((v + next) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      check_rounding(f);
      check_rounding(-f);
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int k = 0; k < 1000000; ++k) check_rounding(bits_float(any_bits(rng)));
  CHECK(float_to_bf16(NAN) == 0x7FC0 && (float_to_f16(NAN) & 0x7E00) == 0x7E00, "NaN stays NaN");
  CHECK(float_to_f16(65520.0f) == 0x7C00 && float_to_f16(65519.0f) == 0x7BFF, "f16 overflow");
}

}  // namespace

TEST_MAIN(test_decode_every_pattern(); test_rounding())
