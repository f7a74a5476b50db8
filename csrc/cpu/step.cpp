// The optimizer steps on the CPU (SGD, Adam/AdamW, Lion), each fusing: the gradient from the
// accumulator (optionally plus the last micro-batch), the update of the fp32 state and param,
// and the write of the low-precision param copy, over many tensors per call.
//
// Per block of kBlock elements: stage the gradient as fp32 (effective_grad), stage the param as
// fp32 when it is bf16/fp16, run the update rule on fp32 arrays, write back. Staging keeps one
// update loop per rule however many dtype combinations a call mixes (grads, params and lp params
// each bf16/fp16/fp32), at the cost of L1 traffic only.
#include "../kernels.h"
#include "../math.h"
#include "multi_tensor.h"

namespace fused_accum {
namespace cpu {
namespace {

// A fused micro-batch: g holds the staged micro-batch gradient; on return, the gradient the step
// uses (coef and sign applied). Two loops so that acc is loaded only where it is used.
FA_CPU_CLONES void grad_block(const float* __restrict acc, float* __restrict g, int64_t n,
                              math::GradScalars s) {
  if (s.grads_overwrite) {
    for (int64_t j = 0; j < n; ++j) g[j] = math::effective_grad(0.0f, g[j], s);
  } else {
    for (int64_t j = 0; j < n; ++j) g[j] = math::effective_grad(acc[j], g[j], s);
  }
}

// The element loops take the branches that are the same for every element as template
// constants (math.h's *_update_t), so that each loop is straight-line code GCC vectorises; one
// switch per block picks the loop.
template <bool kWd, bool kMomentum, bool kFirst, bool kNesterov>
inline __attribute__((always_inline)) void sgd_loop(const float* __restrict g, float c,
                                                    float* __restrict p,
                                                    float* __restrict buf, int64_t n,
                                                    const math::SgdHyper& h,
                                                    const math::SgdScalars& s) {
  float unused = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    math::sgd_update_t<kWd, kMomentum, kFirst, kNesterov>(g[j] * c, p[j],
                                                          kMomentum ? buf[j] : unused, h, s);
  }
}

FA_CPU_CLONES void sgd_block(const float* __restrict g, float c, float* __restrict p,
                             float* __restrict buf, int64_t n, math::SgdHyper h,
                             math::SgdScalars s) {
  const int mode = (h.weight_decay != 0.0f ? 8 : 0) | (h.momentum != 0.0f ? 4 : 0) |
                   (s.first_step ? 2 : 0) | (h.nesterov ? 1 : 0);
  switch (mode) {
#define FA_SGD_CASE(k)                                                                         \
  case k:                                                                                     \
    sgd_loop<(k & 8) != 0, (k & 4) != 0, (k & 2) != 0, (k & 1) != 0>(g, c, p, buf, n, h, s); \
    break;
    FA_SGD_CASE(0) FA_SGD_CASE(1) FA_SGD_CASE(2) FA_SGD_CASE(3) FA_SGD_CASE(4) FA_SGD_CASE(5)
    FA_SGD_CASE(6) FA_SGD_CASE(7) FA_SGD_CASE(8) FA_SGD_CASE(9) FA_SGD_CASE(10) FA_SGD_CASE(11)
    FA_SGD_CASE(12) FA_SGD_CASE(13) FA_SGD_CASE(14) FA_SGD_CASE(15)
#undef FA_SGD_CASE
  }
}

template <int kMode>
inline __attribute__((always_inline)) void adam_loop(const float* __restrict g, float c,
                                                     float* __restrict p,
                                                     float* __restrict m, float* __restrict v,
                                                     float* __restrict max_v, int64_t n,
                                                     const math::AdamHyper& h,
                                                     const math::AdamScalars& s) {
  float unused = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    math::adam_update_mode<kMode>(g[j] * c, p[j], m[j], v[j], (kMode & 1) ? max_v[j] : unused, h,
                                  s);
  }
}

// max_v: amsgrad's running max, or null.
FA_CPU_CLONES void adam_block(const float* __restrict g, float c, float* __restrict p,
                              float* __restrict m, float* __restrict v, float* __restrict max_v,
                              int64_t n, math::AdamHyper h, math::AdamScalars s) {
  switch (math::adam_mode(h, max_v != nullptr)) {
#define FA_ADAM_CASE(k) \
  case k: adam_loop<k>(g, c, p, m, v, max_v, n, h, s); break;
    FA_ADAM_CASE(0) FA_ADAM_CASE(1) FA_ADAM_CASE(2) FA_ADAM_CASE(3) FA_ADAM_CASE(4)
    FA_ADAM_CASE(5) FA_ADAM_CASE(6) FA_ADAM_CASE(7) FA_ADAM_CASE(8) FA_ADAM_CASE(9)
    FA_ADAM_CASE(10) FA_ADAM_CASE(11) FA_ADAM_CASE(12) FA_ADAM_CASE(13) FA_ADAM_CASE(14)
    FA_ADAM_CASE(15)
#undef FA_ADAM_CASE
  }
}

FA_CPU_CLONES void lion_block(const float* __restrict g, float c, float* __restrict p,
                              float* __restrict m, int64_t n, math::LionHyper h,
                              math::LionScalars s) {
  for (int64_t j = 0; j < n; ++j) math::lion_update(g[j] * c, p[j], m[j], h, s);
}

// The loop every step shares. update(i, offset, n, g, c, p) applies the rule to tensor i's
// block, the gradient being g[j] * c. Without a fused micro-batch, g is acc itself and c the
// signed coef (math::effective_grad's product, so the same bits) and no staging pass runs; with
// one, g is staged by grad_block and c = 1 (exact).
template <class Update>
void step_cpu(const TensorLists& t, const StepArgs& a, const ParallelFor& pf, Update&& update) {
  if (a.found_inf && *a.found_inf != 0.0f) return;  // skip-all: nothing is written
  const math::GradScalars gs{*a.coef, a.grad_alpha, t.grad.present(), a.grads_overwrite,
                             a.maximize};
  const std::vector<int64_t> starts = element_starts(t);
  pf(0, starts.back(), kGrain, [&](int64_t begin, int64_t end) {
    float g[kBlock], p_staged[kBlock];
    for_each_block(starts, begin, end, [&](int64_t i, int64_t offset, int64_t n) {
      const float* grad = at_f32(t.acc, i, offset);
      float c = gs.maximize ? -gs.coef : gs.coef;
      if (gs.fused) {
        to_float(at(t.grad, i, offset), t.grad.dtype[i], n, g);
        grad_block(grad, g, n, gs);
        grad = g;
        c = 1.0f;
      }
      const DType param_dtype = t.param.dtype[i];
      float* p = p_staged;
      if (param_dtype == DType::kF32) p = at_f32(t.param, i, offset);
      else to_float(at(t.param, i, offset), param_dtype, n, p_staged);
      update(i, offset, n, grad, c, p);
      if (param_dtype != DType::kF32) from_float(p, n, at(t.param, i, offset), param_dtype);
      if (t.lp.present()) from_float(p, n, at(t.lp, i, offset), t.lp.dtype[i]);
    });
  });
}

}  // namespace
}  // namespace cpu

void sgd_step_cpu(const TensorLists& t, const StepArgs& a, const math::SgdHyper& h,
                  const ParallelFor& pf) {
  using namespace cpu;
  const double lr = *a.lr;
  step_cpu(t, a, pf, [&](int64_t i, int64_t offset, int64_t n, const float* g, float c, float* p) {
    float* buf = t.state1.present() ? at_f32(t.state1, i, offset) : nullptr;
    sgd_block(g, c, p, buf, n, h, math::sgd_scalars(lr, a.steps[t.index[i]]));
  });
}

void adam_step_cpu(const TensorLists& t, const StepArgs& a, const math::AdamHyper& h,
                   const ParallelFor& pf) {
  using namespace cpu;
  // Per tensor, once (two pow() in double each): not per block.
  std::vector<math::AdamScalars> scalars(t.size());
  for (int64_t i = 0; i < t.size(); ++i) scalars[i] = math::adam_scalars(*a.lr, a.steps[t.index[i]], h);
  const bool amsgrad = t.state3.present();
  step_cpu(t, a, pf, [&](int64_t i, int64_t offset, int64_t n, const float* g, float c, float* p) {
    adam_block(g, c, p, at_f32(t.state1, i, offset), at_f32(t.state2, i, offset),
               amsgrad ? at_f32(t.state3, i, offset) : nullptr, n, h, scalars[i]);
  });
}

void lion_step_cpu(const TensorLists& t, const StepArgs& a, const math::LionHyper& h,
                   const ParallelFor& pf) {
  using namespace cpu;
  const math::LionScalars s = math::lion_scalars(*a.lr, h);
  step_cpu(t, a, pf, [&](int64_t i, int64_t offset, int64_t n, const float* g, float c, float* p) {
    lion_block(g, c, p, at_f32(t.state1, i, offset), n, h, s);
  });
}

}  // namespace fused_accum
