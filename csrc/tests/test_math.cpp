// The shared update rules (csrc/math.h) against the reference formulas evaluated in double, and
// the semantic corners the reference pins down: overwrite never reads acc, sign(0) = 0, SGD's
// first step copies the gradient into the momentum buffer, weight decay coupled vs decoupled.
// Also compiled by nvcc (test_math_nvcc.cu) to check the __host__ __device__ path.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "../math.h"
#include "check.h"

using namespace fused_accum::math;

namespace {

bool close(double got, double want, double rtol = 2e-6, double atol = 1e-7) {
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

// Each rule through its trait, the mode picked at run time (math::update, as the CUDA kernels and
// the kernel tests run it), in the shape of the formulas: one call per element.
void sgd_update(float g, float& p, float& buf, const SgdHyper& h, const SgdScalars& s) {
  float unused = 0.0f;
  update<Sgd>(g, p, buf, unused, unused, false, h, s);
}
SgdScalars sgd_scalars(double lr, float step) { return Sgd::scalars(lr, step, {}); }
void adam_update(float g, float& p, float& m, float& v, const AdamHyper& h, const AdamScalars& s) {
  float unused = 0.0f;
  update<Adam>(g, p, m, v, unused, false, h, s);
}
void adam_update_amsgrad(float g, float& p, float& m, float& v, float& max_v, const AdamHyper& h,
                         const AdamScalars& s) {
  update<Adam>(g, p, m, v, max_v, true, h, s);
}
void lion_update(float g, float& p, float& m, const LionHyper& h, const LionScalars& s) {
  float unused = 0.0f;
  update<Lion>(g, p, m, unused, unused, false, h, s);
}
constexpr auto sgd_hyper = Sgd::hyper;
constexpr auto adam_hyper = Adam::hyper;
constexpr auto adam_scalars = Adam::scalars;
constexpr auto lion_hyper = Lion::hyper;
LionScalars lion_scalars(double lr, const LionHyper& h) { return Lion::scalars(lr, 0.0f, h); }

void test_accumulate() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(accumulate(1.5f, 2.0f, 0.25f, false) == 2.0f, "acc + alpha*g");
  CHECK(accumulate(nan, 2.0f, 0.25f, true) == 0.5f, "overwrite must not read acc");
  CHECK(!nonfinite(3.4028235e38f) && !nonfinite(-1.0f) && !nonfinite(0.0f), "finite values");
  CHECK(nonfinite(INFINITY) && nonfinite(-INFINITY) && nonfinite(nan), "inf/nan");
}

void test_effective_grad() {
  GradScalars s{0.5f, 2.0f, false, false, false};
  CHECK(effective_grad(3.0f, 100.0f, s) == 1.5f, "unfused: coef * acc, grad ignored");
  s.fused = true;
  CHECK(effective_grad(3.0f, 1.0f, s) == 2.5f, "fused add: coef * (acc + alpha*grad)");
  s.grads_overwrite = true;
  CHECK(effective_grad(std::numeric_limits<float>::quiet_NaN(), 1.0f, s) == 1.0f,
        "fused overwrite: coef * alpha*grad, acc not read");
  s.maximize = true;
  CHECK(effective_grad(0.0f, 1.0f, s) == -1.0f, "maximize negates");
}

void test_sgd() {
  const SgdHyper h = sgd_hyper(0.9, 0.1, 0.01, false);
  float p = 2.0f, buf = 123.0f;
  sgd_update(0.5f, p, buf, h, sgd_scalars(0.1, 1.0f));
  const double g = 0.5 + 0.01 * 2.0;  // weight decay folded into g
  CHECK(close(buf, g), "first step: buf = g, got %g", buf);
  CHECK(close(p, 2.0 - 0.1 * g), "p = p - lr*buf, got %g", p);
  const float buf1 = buf, p1 = p;
  sgd_update(0.5f, p, buf, h, sgd_scalars(0.1, 2.0f));
  const double g2 = 0.5 + 0.01 * p1, buf2 = 0.9 * buf1 + 0.9 * g2;
  CHECK(close(buf, buf2), "buf = m*buf + (1-d)*g, got %g want %g", buf, buf2);
  CHECK(close(p, p1 - 0.1 * buf2), "got %g", p);

  const SgdHyper nesterov = sgd_hyper(0.9, 0.0, 0.0, true);
  p = 1.0f, buf = 1.0f;
  sgd_update(0.5f, p, buf, nesterov, sgd_scalars(0.1, 3.0f));
  CHECK(close(buf, 0.9 + 0.5) && close(p, 1.0 - 0.1 * (0.5 + 0.9 * 1.4)), "nesterov");

  const SgdHyper plain = sgd_hyper(0.0, 0.0, 0.0, false);
  p = 1.0f, buf = 7.0f;
  sgd_update(0.5f, p, buf, plain, sgd_scalars(0.1, 1.0f));
  CHECK(buf == 7.0f && close(p, 0.95), "no momentum: buffer untouched");
}

void test_adam() {
  for (bool decoupled : {false, true}) {
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, lr = 0.001, step = 3;
    const AdamHyper h = adam_hyper(b1, b2, eps, wd, decoupled);
    float p = 0.7f, m = 0.2f, v = 0.05f;
    adam_update(0.3f, p, m, v, h, adam_scalars(lr, float(step), h));
    double pd = 0.7, g = 0.3;
    if (decoupled) pd *= 1 - lr * wd;
    else g += wd * 0.7;
    const double md = 0.2 * b1 + (1 - b1) * g, vd = 0.05 * b2 + (1 - b2) * g * g;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    pd -= lr / bc1 * md / (std::sqrt(vd) / std::sqrt(bc2) + eps);
    CHECK(close(m, md) && close(v, vd), "decoupled=%d: m %g/%g v %g/%g", decoupled, m, md, v, vd);
    CHECK(close(p, pd), "decoupled=%d: p %.9g want %.9g", decoupled, p, pd);
  }
}

// Where eps goes: outside the sqrt and after the bias correction. With v = 1e-12 and eps = 1e-6,
// sqrt(v) is as large as eps, so eps inside the sqrt (denominator ~1e-3 instead of ~3e-5), or
// eps divided by sqrt(1 - beta2^step) along with sqrt(v) (~3.2e-5 at step 1: a factor 1.5 on the
// update), each move p by far more than the 2e-6 tolerance.
void test_adam_eps() {
  const double b1 = 0.9, b2 = 0.999, eps = 1e-6, lr = 0.1;
  const AdamHyper h = adam_hyper(b1, b2, eps, 0.0, false);
  float p = 1.0f, m = 0.0f, v = 0.0f;
  const float g = 1e-6f / std::sqrt(1 - b2);  // v after the step: (1 - b2) g^2 = 1e-12
  adam_update(g, p, m, v, h, adam_scalars(lr, 1.0f, h));
  const double vd = (1 - b2) * double(g) * g, md = (1 - b1) * double(g);
  const double want = 1.0 - lr / (1 - b1) * md / (std::sqrt(vd) / std::sqrt(1 - b2) + eps);
  CHECK(close(v, vd, 1e-6, 0.0), "v %g want %g", v, vd);
  CHECK(close(p, want), "eps placement: p %.9g want %.9g", p, want);
  const double inside = 1.0 - lr / (1 - b1) * md / (std::sqrt(vd + eps) / std::sqrt(1 - b2));
  const double corrected = 1.0 - lr / (1 - b1) * md / ((std::sqrt(vd) + eps) / std::sqrt(1 - b2));
  CHECK(!close(inside, want) && !close(corrected, want), "the case cannot tell the placements");
}

// The per-tensor scalars are computed in double (issue 14 item 7): at step 1000 with beta2 =
// 0.999, 1 - beta2^step in fp32 (powf) is off by ~1e-5 relative; in double, rounded once, the
// result is the float nearest the exact value. They start from the double lr, as torch's fused
// Adam (issue 22 item 16): lr = 1e-3 rounded to fp32 first gives a step size 1 ulp away at step 1.
void test_adam_scalars_double() {
  const AdamHyper h = adam_hyper(0.9, 0.999, 1e-8, 0.1, true);
  const double lr = 1e-3;
  for (float step : {1.0f, 10.0f, 1000.0f, 123457.0f}) {
    const AdamScalars s = adam_scalars(lr, step, h);
    const float want_step = float(-(lr / (1 - std::pow(0.9, double(step)))));
    const float want_bc2 = float(std::sqrt(1 - std::pow(0.999, double(step))));
    CHECK(s.neg_step_size == want_step, "step %g: step size %.9g want %.9g", step, s.neg_step_size, want_step);
    CHECK(s.bias_correction2_sqrt == want_bc2, "step %g: bc2 %.9g want %.9g", step, s.bias_correction2_sqrt, want_bc2);
    CHECK(s.decay_factor == float(1.0 - lr * 0.1), "decay factor from double");
  }
  const float from_float_lr = adam_scalars(double(float(lr)), 1.0f, h).neg_step_size;
  CHECK(adam_scalars(lr, 1.0f, h).neg_step_size != from_float_lr,
        "the case cannot tell a double lr from one rounded to fp32");
}

// amsgrad: the running max is taken after exp_avg_sq's update, written, and used in the
// denominator; a smaller new v leaves the max (and so a smaller step than plain Adam).
void test_adam_amsgrad() {
  const AdamHyper h = adam_hyper(0.9, 0.99, 1e-8, 0.0, false);
  const AdamScalars s = adam_scalars(0.01, 5.0f, h);
  float p = 1.0f, m = 0.1f, v = 0.01f, max_v = 0.5f;
  float p_plain = p, m_plain = m, v_plain = v;
  adam_update_amsgrad(0.2f, p, m, v, max_v, h, s);
  adam_update(0.2f, p_plain, m_plain, v_plain, h, s);
  CHECK(max_v == 0.5f && v == v_plain && m == m_plain, "max kept, moments as Adam");
  const double denom = std::sqrt(0.5) / s.bias_correction2_sqrt + 1e-8;
  CHECK(close(p, 1.0 + s.neg_step_size * m / denom), "denominator from max_v: p %.9g", p);
  CHECK(p_plain < p, "a larger max_v must give a smaller step");
  max_v = 1e-6f;
  adam_update_amsgrad(0.2f, p, m, v, max_v, h, s);
  CHECK(max_v == v, "max_v = new v when larger");
  max_v = std::numeric_limits<float>::quiet_NaN();
  adam_update_amsgrad(0.2f, p, m, v, max_v, h, s);
  CHECK(max_v != max_v, "NaN propagates, as torch.maximum");
}

// torch.lerp's two formulas (weight below and above 0.5) give a - w*(a-b) either way.
void test_lerp() {
  CHECK(lerp(2.0f, 4.0f, 0.25f) == 2.5f && lerp(2.0f, 4.0f, 0.75f) == 3.5f, "lerp");
  CHECK(lerp(1.0f, -1.0f, 0.0f) == 1.0f && lerp(1.0f, -1.0f, 1.0f) == -1.0f, "lerp ends exact");
}

void test_lion() {
  CHECK(sign(0.0f) == 0.0f && sign(-0.0f) == 0.0f && sign(-2.0f) == -1.0f && sign(3.0f) == 1.0f,
        "torch.sign");
  const LionHyper h = lion_hyper(0.9, 0.99, 0.1);
  float p = 1.0f, m = -0.5f;
  lion_update(0.2f, p, m, h, lion_scalars(0.01, h));
  // direction = sign(-0.45 + 0.02) = -1
  CHECK(close(p, 1.0 * (1 - 0.01 * 0.1) + 0.01), "p got %.9g", p);
  CHECK(close(m, -0.5 * 0.99 + 0.2 * 0.01), "m got %.9g", m);

  // The sign uses the old momentum: with m = -0.1, g = 0.8, beta1 = beta2 = 0.9 the old m gives
  // sign(-0.09 + 0.08) = -1, an m updated first (-0.01) would give sign(-0.009 + 0.08) = +1.
  const LionHyper order = lion_hyper(0.9, 0.9, 0.0);
  p = 1.0f, m = -0.1f;
  lion_update(0.8f, p, m, order, lion_scalars(0.01, order));
  CHECK(close(p, 1.01), "sign from the old momentum: p got %.9g", p);
  CHECK(close(m, -0.1 * 0.9 + 0.8 * 0.1), "m got %.9g", m);
}

}  // namespace

// Every fp32 bit pattern (math.h's split rule): below the overflowing magnitudes the split is
// the master rounded to the nearest bf16 with ties away from zero, and rebuilds the master bit
// for bit; the finite masters that round to inf, and inf, split as (+-inf, 0) and rebuild as
// +-inf; a NaN splits as (+-0x7FC0, 0) and rebuilds as that NaN. Ties are where the weight
// differs from torch's ties-to-even.
#ifndef FA_PATTERN_STRIDE
#define FA_PATTERN_STRIDE 1  // (test_math_nvcc.cu checks every 17th: the same code, once is enough)
#endif
void test_split_rebuild_every_pattern() {
  long long not_back = 0, not_nearest = 0, ties = 0, not_inf = 0, not_nan = 0, overflowing = 0;
#pragma omp parallel for reduction(+ : not_back, not_nearest, ties, not_inf, not_nan, overflowing)
  for (long long i = 0; i < (1LL << 32); i += FA_PATTERN_STRIDE) {
    const unsigned int u = static_cast<unsigned int>(i);
    const unsigned short sign = static_cast<unsigned short>((u >> 16) & 0x8000u);
    const SplitMaster s = split_master(bits_float(u));
    const unsigned int back = float_bits(rebuild_master(s.weight, s.remainder));
    const unsigned int m = u & 0x7FFFFFFFu;
    if (m < kOverflowing) {
      not_back += back != u;
      const unsigned int away = ((m + 0x8000u) >> 16) | sign;
      not_nearest += s.weight != away;
      ties += (m & 0xFFFFu) == 0x8000u;
    } else if (m <= kInfBits) {
      not_inf += s.weight != (sign | 0x7F80u) || s.remainder != 0 || back != ((u & 0x80000000u) | kInfBits);
      overflowing += m < kInfBits;
    } else {
      not_nan += s.weight != (sign | 0x7FC0u) || s.remainder != 0 || back != ((u & 0x80000000u) | 0x7FC00000u);
    }
  }
  CHECK(not_back == 0, "%lld finite masters below 0x7F7F8000 not rebuilt exactly", not_back);
  CHECK(not_nearest == 0, "%lld finite masters not split as their nearest bf16 (ties away)", not_nearest);
  CHECK(not_inf == 0, "%lld masters from 0x7F7F8000 to inf not split as (+-inf, 0), rebuilt as +-inf", not_inf);
  CHECK(not_nan == 0, "%lld NaNs not split as (+-0x7FC0, 0), rebuilt as that NaN", not_nan);
  if (FA_PATTERN_STRIDE == 1) {
    CHECK(overflowing == 2 * 32768, "%lld overflowing finite masters", overflowing);
    CHECK(ties == 2LL * 0x7F7F, "%lld exact ties", ties);  // one per finite bf16 step below the top, per sign
  }
}

// Every (weight, remainder) pair: the rebuilt master rounds to its weight under the tie rule
// (its split gives the weight back; a NaN weight may come back as the canonical NaN), it is NaN
// exactly when the weight is, +-inf exactly when the weight is, finite exactly when the weight
// is, with the weight's sign, and within half a bf16 ulp of it (the half ulp above the weight:
// the distance to the tie, (W << 16 | 0x8000) - (W << 16) as fp32 values, in double, exact).
// The bound against a weight written from outside the optimizer: the remainder left under it
// moves the master by at most half an ulp of the new weight.
void test_rebuild_every_pair() {
  long long not_weight = 0, wrong_class = 0, wrong_sign = 0, too_far = 0;
#pragma omp parallel for reduction(+ : not_weight, wrong_class, wrong_sign, too_far)
  for (long long i = 0; i < (1LL << 32); i += FA_PATTERN_STRIDE) {
    const unsigned short w = static_cast<unsigned short>(i >> 16);
    const short r = static_cast<short>(static_cast<unsigned short>(i));
    const unsigned int wm = w & 0x7FFFu;
    const float x = rebuild_master(w, r);
    const unsigned int xu = float_bits(x);
    const SplitMaster s = split_master(x);
    const bool w_nan = wm > 0x7F80u, w_inf = wm == 0x7F80u;
    if (w_nan) {
      not_weight += s.weight != w && s.weight != ((w & 0x8000u) | 0x7FC0u);
    } else {
      not_weight += s.weight != w;
      wrong_sign += (xu >> 31) != (w >> 15u);
    }
    const bool x_nan = x != x, x_inf = (xu & 0x7FFFFFFFu) == kInfBits;
    wrong_class += x_nan != w_nan || x_inf != w_inf;
    if (!w_nan && !w_inf) {
      const double weight = bits_float(static_cast<unsigned int>(w) << 16);
      const double half_ulp = double(bits_float((wm << 16) | 0x8000u)) - double(bits_float(wm << 16));
      too_far += !(std::fabs(double(x) - weight) <= half_ulp);
    }
  }
  CHECK(not_weight == 0, "%lld pairs whose rebuilt master does not split back to the weight", not_weight);
  CHECK(wrong_class == 0, "%lld pairs rebuilt as NaN/inf where the weight is not, or the reverse", wrong_class);
  CHECK(wrong_sign == 0, "%lld pairs rebuilt with another sign than the weight's", wrong_sign);
  CHECK(too_far == 0, "%lld pairs rebuilt more than half a bf16 ulp from the weight", too_far);
}

// fp32 masters follow the weight: a master is replaced by the weight's value exactly where the
// weight's bits are not the master's rounding, compared as bits (kept NaN payloads, -0.0).
void test_follow_weight() {
  const float master = 1.0f + 0x1.0p-12f;  // rounds to bf16 1.0 (0x3F80)
  CHECK(float_bits(follow_weight(master, 0x3F80u, 0x3F80u, 1.0f)) == float_bits(master),
        "a weight equal to the master's rounding keeps the master's full precision");
  CHECK(follow_weight(master, 0x3F80u, 0x0000u, 0.0f) == 0.0f, "a pruned weight restarts the master");
  CHECK(float_bits(follow_weight(0.0f, 0x0000u, 0x8000u, -0.0f)) == 0x80000000u, "-0.0 against +0.0 differs");
  const float payload = bits_float(0x7FC01234u);
  CHECK(float_bits(follow_weight(payload, 0x7FC0u, 0x7FC0u, bits_float(0x7FC00000u))) == 0x7FC01234u,
        "a NaN master whose rounding is the stored NaN is kept, payload and all");
  CHECK(float_bits(follow_weight(2.0f, 0x4000u, 0x7FC0u, bits_float(0x7FC00000u))) == 0x7FC00000u,
        "a NaN weight over a finite master: the NaN");
  CHECK(follow_weight(2.0f, 0x4000u, 0xFF80u, -INFINITY) == -INFINITY, "an inf weight: inf");
}

void test_split_special_values() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(split_master(0.0f).weight == 0x0000 && split_master(0.0f).remainder == 0, "+0");
  CHECK(split_master(-0.0f).weight == 0x8000 && split_master(-0.0f).remainder == 0, "-0");
  CHECK(split_master(INFINITY).weight == 0x7F80 && split_master(-INFINITY).weight == 0xFF80, "+-inf");
  CHECK(split_master(nan).weight == 0x7FC0 && split_master(nan).remainder == 0, "the quiet NaN");
  CHECK(split_master(bits_float(0x7FFFFFFFu)).weight == 0x7FC0, "NaN 0x7FFFFFFF: the canonical NaN");
  CHECK(split_master(bits_float(0xFFFFFFFFu)).weight == 0xFFC0, "NaN 0xFFFFFFFF: -NaN");
  CHECK(split_master(bits_float(0x7F800001u)).weight == 0x7FC0, "NaN just above inf: a NaN");
  CHECK(split_master(bits_float(0x7FC01234u)).remainder == 0, "a NaN's payload is not kept");
  CHECK(split_master(1.0f + 0x1.0p-8f).weight == 0x3F81, "a tie rounds away from zero");
  CHECK(split_master(-(1.0f + 0x1.0p-8f)).weight == 0xBF81, "... on both sides");
  CHECK(split_master(bits_float(0x3F808000u - 1)).weight == 0x3F80, "one ulp below a tie: down");
  CHECK(split_master(bits_float(0x3F808000u + 1)).weight == 0x3F81, "one ulp above: up");
  CHECK(split_master(std::numeric_limits<float>::denorm_min()).weight == 0x0000, "a denormal");
  CHECK(split_master(bits_float(0x7F7F7FFFu)).weight == 0x7F7F, "the largest master shown finite");
  const SplitMaster top = split_master(3.40282347e38f);
  CHECK(top.weight == 0x7F80 && top.remainder == 0, "the largest finite: inf, as .to(bfloat16)");
  CHECK(split_master(-3.40282347e38f).weight == 0xFF80, "... -inf for its negative");
  // decodes of pairs no split makes: the weight itself
  CHECK(float_bits(rebuild_master(0x0000, -1)) == 0x00000000u, "pruned: (+0, r < 0) is +0.0");
  CHECK(float_bits(rebuild_master(0x8000, -32768)) == 0x80000000u, "(-0, r < 0) is -0.0");
  CHECK(float_bits(rebuild_master(0x7F80, 1)) == 0x7F800000u && float_bits(rebuild_master(0xFF80, -1)) == 0xFF800000u,
        "(+-inf, r != 0) is +-inf");
  CHECK(rebuild_master(0x7FC0, -5) != rebuild_master(0x7FC0, -5), "a NaN weight rebuilds to a NaN");
  CHECK(float_bits(rebuild_master(0x0000, 5)) == 5u, "(+0, r > 0): a denormal");
  CHECK(float_bits(rebuild_master(0x3F80, -1)) == 0x3F7FFFFFu, "below 1.0");
}

TEST_MAIN(test_split_rebuild_every_pattern(); test_rebuild_every_pair(); test_split_special_values(); test_follow_weight(); test_accumulate(); test_effective_grad(); test_sgd(); test_adam(); test_adam_eps();
          test_adam_scalars_double(); test_adam_amsgrad(); test_lerp(); test_lion())
