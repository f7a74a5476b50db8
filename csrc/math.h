// The element-wise update rules of every op, written once for the CPU and the CUDA kernels.
//
// Each function mirrors one formula of fused_accum/backends/reference.py, in the same order of
// operations, so that the kernels round where the reference rounds (a contracted FMA aside: the
// tests allow the ~1 ulp that costs). Per-tensor quantities (Adam's bias corrections, SGD's
// first-step flag, the decoupled decay factor) are computed once per tensor by the *_scalars()
// functions, not per element. Hyperparameters arrive as float: the reference multiplies fp32
// tensors by Python floats, which PyTorch rounds to fp32 first.
//
// No dependency beyond <math.h>: the standalone unit tests (csrc/tests) compile this header with
// the host compiler alone, and the .cu files compile it with nvcc without torch's headers.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define FA_HD __host__ __device__ __forceinline__
#else
#define FA_HD inline
#endif

namespace fused_accum {
namespace math {

// ---- accumulate -----------------------------------------------------------------------------

// acc = alpha * grad + (0 if overwrite else acc). On overwrite acc is never read, so a NaN left
// in a freshly reused buffer cannot leak into the result.
FA_HD float accumulate(float acc, float grad, float alpha, bool overwrite) {
  const float scaled = grad * alpha;
  return overwrite ? scaled : acc + scaled;
}

// True for +-inf and NaN (NaN fails every ordered comparison). A comparison rather than
// isfinite() so that compilers vectorise it on the CPU.
FA_HD bool nonfinite(float x) { return !(fabsf(x) <= 3.40282347e38f); }

// ---- the gradient a step uses -----------------------------------------------------------------

// coef * (accumulated gradient), negated when maximising. `fused` adds the window's last
// micro-batch (grad) on the fly, as accumulate() would have, without writing acc.
struct GradScalars {
  float coef;
  float grad_alpha;
  bool fused;           // a last micro-batch gradient is fused into this step
  bool grads_overwrite; // ... and it replaces acc instead of adding to it
  bool maximize;
};

FA_HD float effective_grad(float acc, float grad, const GradScalars& s) {
  const float g = s.fused ? accumulate(acc, grad, s.grad_alpha, s.grads_overwrite) : acc;
  const float scaled = g * s.coef;
  return s.maximize ? -scaled : scaled;
}

// ---- SGD (torch.optim.SGD) --------------------------------------------------------------------

struct SgdHyper {
  float momentum, one_minus_dampening, weight_decay;
  bool nesterov;
};
struct SgdScalars {
  float lr;
  bool first_step; // torch starts the momentum buffer as a copy of the first gradient
};

// Hyperparameters arrive from Python as double; 1 - beta is formed in double, as in the
// reference, then everything is rounded to fp32 once, as PyTorch does for a Python float
// multiplying an fp32 tensor.
inline SgdHyper sgd_hyper(double momentum, double dampening, double weight_decay, bool nesterov) {
  return {float(momentum), float(1.0 - dampening), float(weight_decay), nesterov};
}

FA_HD SgdScalars sgd_scalars(float lr, float step) { return {lr, step == 1.0f}; }

// Updates param (fp32 value) and, when momentum != 0, the momentum buffer.
FA_HD void sgd_update(float g, float& param, float& buf, const SgdHyper& h, const SgdScalars& s) {
  if (h.weight_decay != 0.0f) g = g + h.weight_decay * param;
  if (h.momentum != 0.0f) {
    buf = s.first_step ? g : h.momentum * buf + h.one_minus_dampening * g;
    g = h.nesterov ? g + h.momentum * buf : buf;
  }
  param = param - s.lr * g;
}

// ---- Adam / AdamW (torch.optim.Adam, torch.optim.AdamW; no amsgrad) --------------------------

struct AdamHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  bool decoupled;
};
struct AdamScalars {
  float step_size;             // lr / (1 - beta1^step)
  float bias_correction2_sqrt; // sqrt(1 - beta2^step)
  float decay_factor;          // 1 - lr * weight_decay (AdamW), else 1
};

inline AdamHyper adam_hyper(double beta1, double beta2, double eps, double weight_decay,
                            bool decoupled) {
  return {float(beta1), float(beta2), float(1.0 - beta1), float(1.0 - beta2),
          float(eps),   float(weight_decay), decoupled};
}

FA_HD AdamScalars adam_scalars(float lr, float step, const AdamHyper& h) {
  const float bias_correction1 = 1.0f - powf(h.beta1, step);
  AdamScalars s;
  s.step_size = lr / bias_correction1;
  s.bias_correction2_sqrt = sqrtf(1.0f - powf(h.beta2, step));
  s.decay_factor = h.decoupled ? 1.0f - lr * h.weight_decay : 1.0f;
  return s;
}

FA_HD void adam_update(float g, float& param, float& exp_avg, float& exp_avg_sq,
                       const AdamHyper& h, const AdamScalars& s) {
  if (h.weight_decay != 0.0f) {
    if (h.decoupled) param = param * s.decay_factor;
    else g = g + h.weight_decay * param;
  }
  exp_avg = exp_avg * h.beta1 + g * h.one_minus_beta1;
  exp_avg_sq = exp_avg_sq * h.beta2 + g * g * h.one_minus_beta2;
  const float denom = sqrtf(exp_avg_sq) / s.bias_correction2_sqrt + h.eps;
  param = param - s.step_size * (exp_avg / denom);
}

// ---- Lion (Chen et al. 2023), decoupled weight decay ------------------------------------------

struct LionHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay;
};
struct LionScalars {
  float lr;
  float decay_factor; // 1 - lr * weight_decay
};

inline LionHyper lion_hyper(double beta1, double beta2, double weight_decay) {
  return {float(beta1), float(beta2), float(1.0 - beta1), float(1.0 - beta2), float(weight_decay)};
}

FA_HD LionScalars lion_scalars(float lr, const LionHyper& h) {
  return {lr, 1.0f - lr * h.weight_decay};
}

// torch.sign: -1, 0 or +1 (0 for 0, which copysign would not give).
FA_HD float sign(float x) { return (x > 0.0f ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f); }

FA_HD void lion_update(float g, float& param, float& exp_avg, const LionHyper& h,
                       const LionScalars& s) {
  const float decayed = param * s.decay_factor;
  const float direction = sign(exp_avg * h.beta1 + g * h.one_minus_beta1);
  param = decayed - s.lr * direction;
  exp_avg = exp_avg * h.beta2 + g * h.one_minus_beta2;
}

}  // namespace math
}  // namespace fused_accum
