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

// g: the staged micro-batch gradient when s.fused; on return, the gradient the step uses.
// Three loops so that acc is loaded only where it is used.
FA_CPU_CLONES void grad_block(const float* __restrict acc, float* __restrict g, int64_t n,
                              math::GradScalars s) {
  if (!s.fused) {
    for (int64_t j = 0; j < n; ++j) g[j] = math::effective_grad(acc[j], 0.0f, s);
  } else if (s.grads_overwrite) {
    for (int64_t j = 0; j < n; ++j) g[j] = math::effective_grad(0.0f, g[j], s);
  } else {
    for (int64_t j = 0; j < n; ++j) g[j] = math::effective_grad(acc[j], g[j], s);
  }
}

FA_CPU_CLONES void sgd_block(const float* __restrict g, float* __restrict p,
                             float* __restrict buf, int64_t n, math::SgdHyper h,
                             math::SgdScalars s) {
  if (buf) {
    for (int64_t j = 0; j < n; ++j) math::sgd_update(g[j], p[j], buf[j], h, s);
  } else {  // momentum == 0: no buffer exists
    for (int64_t j = 0; j < n; ++j) {
      float unused = 0.0f;
      math::sgd_update(g[j], p[j], unused, h, s);
    }
  }
}

FA_CPU_CLONES void adam_block(const float* __restrict g, float* __restrict p,
                              float* __restrict m, float* __restrict v, int64_t n,
                              math::AdamHyper h, math::AdamScalars s) {
  for (int64_t j = 0; j < n; ++j) math::adam_update(g[j], p[j], m[j], v[j], h, s);
}

FA_CPU_CLONES void lion_block(const float* __restrict g, float* __restrict p,
                              float* __restrict m, int64_t n, math::LionHyper h,
                              math::LionScalars s) {
  for (int64_t j = 0; j < n; ++j) math::lion_update(g[j], p[j], m[j], h, s);
}

// The loop every step shares. update(i, offset, n, g, p) applies the rule to tensor i's block.
template <class Update>
void step_cpu(const TensorLists& t, const StepArgs& a, const ParallelFor& pf, Update&& update) {
  if (a.found_inf && *a.found_inf != 0.0f) return;  // skip-all: nothing is written
  const math::GradScalars gs{*a.coef, a.grad_alpha, t.grad.present(), a.grads_overwrite,
                             a.maximize};
  const std::vector<int64_t> starts = element_starts(t);
  pf(0, starts.back(), kGrain, [&](int64_t begin, int64_t end) {
    float g[kBlock], p_staged[kBlock];
    for_each_block(starts, begin, end, [&](int64_t i, int64_t offset, int64_t n) {
      if (gs.fused) to_float(at(t.grad, i, offset), t.grad.dtype[i], n, g);
      grad_block(at_f32(t.acc, i, offset), g, n, gs);
      const DType param_dtype = t.param.dtype[i];
      float* p = p_staged;
      if (param_dtype == DType::kF32) p = at_f32(t.param, i, offset);
      else to_float(at(t.param, i, offset), param_dtype, n, p_staged);
      update(i, offset, n, g, p);
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
  const float lr = *a.lr;
  step_cpu(t, a, pf, [&](int64_t i, int64_t offset, int64_t n, const float* g, float* p) {
    float* buf = t.state1.present() ? at_f32(t.state1, i, offset) : nullptr;
    sgd_block(g, p, buf, n, h, math::sgd_scalars(lr, a.steps[t.index[i]]));
  });
}

void adam_step_cpu(const TensorLists& t, const StepArgs& a, const math::AdamHyper& h,
                   const ParallelFor& pf) {
  using namespace cpu;
  const float lr = *a.lr;
  step_cpu(t, a, pf, [&](int64_t i, int64_t offset, int64_t n, const float* g, float* p) {
    adam_block(g, p, at_f32(t.state1, i, offset), at_f32(t.state2, i, offset), n, h,
               math::adam_scalars(lr, a.steps[t.index[i]], h));
  });
}

void lion_step_cpu(const TensorLists& t, const StepArgs& a, const math::LionHyper& h,
                   const ParallelFor& pf) {
  using namespace cpu;
  const math::LionScalars s = math::lion_scalars(*a.lr, h);
  step_cpu(t, a, pf, [&](int64_t i, int64_t offset, int64_t n, const float* g, float* p) {
    lion_block(g, p, at_f32(t.state1, i, offset), n, h, s);
  });
}

}  // namespace fused_accum
