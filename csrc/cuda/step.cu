// The optimizer steps on CUDA (SGD, Adam/AdamW, Lion): one kernel skeleton, one update rule each
// from csrc/math.h. Each element is read and written once: the gradient from acc (plus the fused
// last micro-batch), the fp32 state and param updated, the low-precision param written.
//
// Bytes per element, AdamW from acc with a bf16 param copy: read acc, master, m, v (16), write
// master, m, v (12) and the bf16 param (2) = 30.
#include "../math.h"
#include "multi_tensor.cuh"

namespace fused_accum {
namespace cuda {

using StepTable = Table<6>;
enum StepOperand { kStepAcc = 0, kStepGrad, kStepParam, kStepState1, kStepState2, kStepLp };

// 1 pack per thread per iteration: Adam with a fused grad already has 9 loads of 16 bytes in
// flight per thread. 2 packs would need ~145 registers; ptxas caps a 256-thread block at 128
// and spills (seen with nvcc 13.0).
constexpr int kStepUnroll = 1;
constexpr int kStepStride = kThreads * kPack * kStepUnroll;
static_assert(kChunk % kStepStride == 0, "a chunk is a whole number of iterations");

// What every block of a step reads: StepArgs, plus whether a micro-batch gradient is fused.
struct DeviceStepArgs {
  const float* lr;
  const float* coef;
  const float* steps;
  const float* found_inf;
  float grad_alpha;
  bool fused, grads_overwrite, maximize;
};

// An update rule: how many fp32 state arrays it keeps, its per-tensor scalars, its element update.
struct Sgd {
  using Hyper = math::SgdHyper;
  static constexpr int kStates = 1;  // the momentum buffer; absent when momentum == 0
  FA_HD static math::SgdScalars scalars(float lr, float step, const Hyper&) {
    return math::sgd_scalars(lr, step);
  }
  FA_HD static void update(float g, float& p, float& s1, float&, const Hyper& h,
                           const math::SgdScalars& s) {
    math::sgd_update(g, p, s1, h, s);
  }
};

struct Adam {
  using Hyper = math::AdamHyper;
  static constexpr int kStates = 2;  // exp_avg, exp_avg_sq
  FA_HD static math::AdamScalars scalars(float lr, float step, const Hyper& h) {
    return math::adam_scalars(lr, step, h);
  }
  FA_HD static void update(float g, float& p, float& s1, float& s2, const Hyper& h,
                           const math::AdamScalars& s) {
    math::adam_update(g, p, s1, s2, h, s);
  }
};

struct Lion {
  using Hyper = math::LionHyper;
  static constexpr int kStates = 1;  // exp_avg
  FA_HD static math::LionScalars scalars(float lr, float, const Hyper& h) {
    return math::lion_scalars(lr, h);
  }
  FA_HD static void update(float g, float& p, float& s1, float&, const Hyper& h,
                           const math::LionScalars& s) {
    math::lion_update(g, p, s1, h, s);
  }
};

// Everything thread `thread` of the block for chunk `chunk` does.
template <class Rule>
FA_HD void step_thread(const StepTable& table, const DeviceStepArgs& args,
                       const typename Rule::Hyper& hyper, int chunk, int thread) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // skip-all, no host sync
  const Work w = chunk_work(table, chunk);
  const int t = w.t;
  const math::GradScalars gs{*args.coef, args.grad_alpha, args.fused, args.grads_overwrite,
                             args.maximize};
  const auto scalars = Rule::scalars(*args.lr, args.steps[table.index[t]], hyper);
  const bool read_acc = !(args.fused && args.grads_overwrite);  // overwrite: acc is not read
  const bool has_state1 = Rule::kStates >= 1 && table.ptr[kStepState1][t] != nullptr;
  const bool has_lp = table.ptr[kStepLp][t] != nullptr;
  const uint8_t param_dtype = table.dtype[kStepParam][t];
  void* const param = table.ptr[kStepParam][t];
  float* const state1 = static_cast<float*>(table.ptr[kStepState1][t]);
  float* const state2 = static_cast<float*>(table.ptr[kStepState2][t]);

  for (int64_t base = w.begin; base < w.end; base += kStepStride) {
    float acc[kStepUnroll][kPack], grad[kStepUnroll][kPack], p[kStepUnroll][kPack];
    float s1[kStepUnroll][kPack], s2[kStepUnroll][kPack];
    int64_t idx[kStepUnroll];
    bool vec[kStepUnroll];
#pragma unroll
    for (int u = 0; u < kStepUnroll; ++u) {  // issue every load before the first use
      idx[u] = pack_index(base, u, thread);
      vec[u] = table.vector_ok[t] && idx[u] + kPack <= w.end;
      if (read_acc) load_pack(table.ptr[kStepAcc][t], 0, idx[u], w.end, vec[u], acc[u]);
      if (args.fused) {
        load_pack(table.ptr[kStepGrad][t], table.dtype[kStepGrad][t], idx[u], w.end, vec[u], grad[u]);
      }
      load_pack(param, param_dtype, idx[u], w.end, vec[u], p[u]);
      if (has_state1) load_pack(state1, 0, idx[u], w.end, vec[u], s1[u]);
      if (Rule::kStates >= 2) load_pack(state2, 0, idx[u], w.end, vec[u], s2[u]);
    }
#pragma unroll
    for (int u = 0; u < kStepUnroll; ++u) {
      if (idx[u] >= w.end) continue;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const float g = math::effective_grad(read_acc ? acc[u][k] : 0.0f,
                                             args.fused ? grad[u][k] : 0.0f, gs);
        Rule::update(g, p[u][k], s1[u][k], s2[u][k], hyper, scalars);
      }
      store_pack(param, param_dtype, idx[u], w.end, vec[u], p[u]);
      if (has_state1) store_pack(state1, 0, idx[u], w.end, vec[u], s1[u]);
      if (Rule::kStates >= 2) store_pack(state2, 0, idx[u], w.end, vec[u], s2[u]);
      if (has_lp) store_pack(table.ptr[kStepLp][t], table.dtype[kStepLp][t], idx[u], w.end, vec[u], p[u]);
    }
  }
}

namespace {

template <class Rule>
__global__ void __launch_bounds__(kThreads)
    step_kernel(const __grid_constant__ StepTable table, DeviceStepArgs args,
                typename Rule::Hyper hyper) {
  step_thread<Rule>(table, args, hyper, blockIdx.x, threadIdx.x);
}

template <class Rule>
const char* launch_step(const TensorLists& t, const StepArgs& a, const typename Rule::Hyper& h,
                        void* stream) {
  const DeviceStepArgs args{a.lr, a.coef, a.steps, a.found_inf, a.grad_alpha, t.grad.present(),
                            a.grads_overwrite, a.maximize};
  const Operand* const ops[6] = {&t.acc, &t.grad, &t.param, &t.state1, &t.state2, &t.lp};
  return for_each_table(t, ops, [&](const StepTable& table, int chunks) {
    step_kernel<Rule><<<chunks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(table, args, h);
    return last_error();
  });
}

}  // namespace
}  // namespace cuda

const char* sgd_step_cuda(const TensorLists& t, const StepArgs& a, const math::SgdHyper& h,
                          void* stream) {
  return cuda::launch_step<cuda::Sgd>(t, a, h, stream);
}

const char* adam_step_cuda(const TensorLists& t, const StepArgs& a, const math::AdamHyper& h,
                           void* stream) {
  return cuda::launch_step<cuda::Adam>(t, a, h, stream);
}

const char* lion_step_cuda(const TensorLists& t, const StepArgs& a, const math::LionHyper& h,
                           void* stream) {
  return cuda::launch_step<cuda::Lion>(t, a, h, stream);
}

}  // namespace fused_accum
