// The shared update rules (csrc/math.h) against the reference formulas evaluated in double, and
// the semantic corners the reference pins down: overwrite never reads acc, sign(0) = 0, SGD's
// first step copies the gradient into the momentum buffer, weight decay coupled vs decoupled.
// Also compiled by nvcc (test_math_nvcc.cu) to check the __host__ __device__ path.
#include <cmath>
#include <initializer_list>
#include <limits>

#include "../math.h"
#include "check.h"

using namespace fused_accum::math;

namespace {

bool close(double got, double want, double rtol = 2e-6, double atol = 1e-7) {
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

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
  sgd_update(0.5f, p, buf, h, sgd_scalars(0.1f, 1.0f));
  const double g = 0.5 + 0.01 * 2.0;  // weight decay folded into g
  CHECK(close(buf, g), "first step: buf = g, got %g", buf);
  CHECK(close(p, 2.0 - 0.1 * g), "p = p - lr*buf, got %g", p);
  const float buf1 = buf, p1 = p;
  sgd_update(0.5f, p, buf, h, sgd_scalars(0.1f, 2.0f));
  const double g2 = 0.5 + 0.01 * p1, buf2 = 0.9 * buf1 + 0.9 * g2;
  CHECK(close(buf, buf2), "buf = m*buf + (1-d)*g, got %g want %g", buf, buf2);
  CHECK(close(p, p1 - 0.1 * buf2), "got %g", p);

  const SgdHyper nesterov = sgd_hyper(0.9, 0.0, 0.0, true);
  p = 1.0f, buf = 1.0f;
  sgd_update(0.5f, p, buf, nesterov, sgd_scalars(0.1f, 3.0f));
  CHECK(close(buf, 0.9 + 0.5) && close(p, 1.0 - 0.1 * (0.5 + 0.9 * 1.4)), "nesterov");

  const SgdHyper plain = sgd_hyper(0.0, 0.0, 0.0, false);
  p = 1.0f, buf = 7.0f;
  sgd_update(0.5f, p, buf, plain, sgd_scalars(0.1f, 1.0f));
  CHECK(buf == 7.0f && close(p, 0.95), "no momentum: buffer untouched");
}

void test_adam() {
  for (bool decoupled : {false, true}) {
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, lr = 0.001, step = 3;
    const AdamHyper h = adam_hyper(b1, b2, eps, wd, decoupled);
    float p = 0.7f, m = 0.2f, v = 0.05f;
    adam_update(0.3f, p, m, v, h, adam_scalars(float(lr), float(step), h));
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

void test_lion() {
  CHECK(sign(0.0f) == 0.0f && sign(-0.0f) == 0.0f && sign(-2.0f) == -1.0f && sign(3.0f) == 1.0f,
        "torch.sign");
  const LionHyper h = lion_hyper(0.9, 0.99, 0.1);
  float p = 1.0f, m = -0.5f;
  lion_update(0.2f, p, m, h, lion_scalars(0.01f, h));
  // direction = sign(-0.45 + 0.02) = -1
  CHECK(close(p, 1.0 * (1 - 0.01 * 0.1) + 0.01), "p got %.9g", p);
  CHECK(close(m, -0.5 * 0.99 + 0.2 * 0.01), "m got %.9g", m);
}

}  // namespace

TEST_MAIN(test_accumulate(); test_effective_grad(); test_sgd(); test_adam(); test_lion())
