// The optimizer steps on CUDA: one kernel skeleton, instantiated for each algorithm of math.h's
// FUSED_ACCUM_ALGORITHMS with its update rule. Each element is read and written once: the gradient from acc (plus the fused
// last micro-batch), the fp32 state and param updated, the low-precision param written.
//
// Bytes per element, AdamW from acc with a bf16 param copy: read acc, master, m, v and the bf16
// param (18: the master follows the param where that was written from outside,
// math::follow_weight), write master, m, v (12) and the bf16 param (2) = 32. With a 2-byte remainder instead of the fp32
// master (issue 28): read acc, bf16 param, remainder, m, v (16), write param, remainder, m, v
// (12) = 28; the fused last micro-batch adds its bf16 gradient (30).
//
// The remainders travel in the table's lp column (kStepLp, dtype kI16): a step has either
// low-precision copies or remainders, never both (the binding checks), so the mode costs no
// operand and no table capacity. A call has remainders for all its tensors or for none, so the
// mode is a template parameter (kRemainder): the fp32-master kernels carry none of its code or
// registers (a run-time branch in one kernel made plain Adam spill 4 bytes at its bound).
#include "../math.h"
#include "multi_tensor.cuh"

namespace fused_accum {
namespace cuda {

// Operands of a step table. state3 (Adam's amsgrad max_exp_avg_sq) is last and only in the
// 7-operand table of a call that has a third state list, so every other step keeps the
// 6-operand table (459 tensors per 32 KB launch rather than 407) and the same indices.
enum StepOperand { kStepAcc = 0, kStepGrad, kStepParam, kStepState1, kStepState2, kStepLp, kStepState3 };
using StepTable = Table<6>;
using State3StepTable = Table<7>;

// 1 pack per thread per iteration: Adam with a fused grad already has 9-10 loads of 16 bytes in
// flight per thread, and 2 packs would need ~145 registers (spills under any useful bound). A
// software prefetch of the next pack into registers costs the same registers as the second
// pack, so none is done; whether an L2 prefetch hint helps is for the GPU sweep to show.
// Occupancy comes from blocks instead: __launch_bounds__(128, kMinBlocks) caps a thread at
// 65536 / (128 * kMinBlocks) registers: 6 blocks 80 registers (24 warps per SM), 5 blocks 96
// (20 warps), 4 blocks 128 (16 warps). Each rule's bound (math.h: its kCudaMinBlocks) is the
// largest that compiles without a spill (nvcc 13.0, sm_90, -fmad=false; the gate in
// scripts/check_cuda_build.sh fails on any). 256-thread blocks at 88 registers gave Adam 16 warps.
constexpr int kStepUnroll = 1;
constexpr int kStepStride = kThreads * kPack * kStepUnroll;
static_assert(kChunk % kStepStride == 0, "a chunk is a whole number of iterations");

// What every block of a step reads: StepArgs, plus whether a micro-batch gradient is fused.
struct DeviceStepArgs {
  const double* lr;
  const float* coef;
  const float* steps;
  const float* found_inf;
  float grad_alpha;
  bool fused, grads_overwrite, maximize;
};

// Whether a step skips everything (found_inf set: read on the device, no host sync).
FA_HD bool step_skipped(const DeviceStepArgs& args) {
  return args.found_inf != nullptr && *args.found_inf != 0.0f;
}

// Everything thread `thread` of the block for chunk `chunk` does, given the tensor's per-tensor
// scalars (computed once per block by the kernel: Adam's are a pair of double pow calls, whose
// register needs inside the element loop made ptxas spill).
template <class Algo, bool kRemainder, int kArrays, bool kRows>
FA_HD void step_thread_with(const Table<kArrays, kRows>& table, const DeviceStepArgs& args,
                            const typename Algo::Hyper& hyper, const typename Algo::Scalars& scalars,
                            int chunk, int thread) {
  constexpr int kStates = math::kStateCount<Algo>;
  constexpr bool kState3 = kArrays > kStepState3;
  const Work w = chunk_work(table, chunk);
  const int t = w.t;
  const math::GradScalars gs{*args.coef, args.grad_alpha, args.fused, args.grads_overwrite,
                             args.maximize};
  // overwrite: acc is not read; nor by an op that reads its input in the gradient's place
  // (math.h's kReadsInput), whose input is read as a fused gradient is, and taken as it is
  constexpr bool kInput = Algo::kReadsInput, kParam = Algo::kWritesParam;
  const bool read_acc = !kInput && !(args.fused && args.grads_overwrite);
  const bool read_grad = kInput || args.fused;
  const bool has_state1 = kStates >= 1 && table.ptr[kStepState1][t] != nullptr;
  bool has_state3 = false;
  float* __restrict__ state3 = nullptr;
  if constexpr (kState3) {
    state3 = static_cast<float*>(table.ptr[kStepState3][t]);
    has_state3 = state3 != nullptr;
  }
  // the lp column holds either low-precision copies or (kRemainder) the remainders
  constexpr bool has_rem = kRemainder;
  const bool has_lp = kParam && !kRemainder && table.ptr[kStepLp][t] != nullptr;
  const uint8_t param_dtype = table.dtype[kStepParam][t];
  const float* __restrict__ acc = static_cast<const float*>(table.ptr[kStepAcc][t]);
  const void* __restrict__ grad = table.ptr[kStepGrad][t];
  void* __restrict__ const param = table.ptr[kStepParam][t];
  float* __restrict__ const state1 = static_cast<float*>(table.ptr[kStepState1][t]);
  float* __restrict__ const state2 = static_cast<float*>(table.ptr[kStepState2][t]);
  void* __restrict__ const lp = table.ptr[kStepLp][t];
  // per operand: 16-byte packs where its pointer allows (a misaligned view does not drag the
  // tensor's other operands down to scalar accesses)
  const bool acc_vec = vec_ok(table, t, kStepAcc), grad_vec = vec_ok(table, t, kStepGrad);
  const bool param_vec = vec_ok(table, t, kStepParam), lp_vec = vec_ok(table, t, kStepLp);
  const bool s1_vec = vec_ok(table, t, kStepState1), s2_vec = vec_ok(table, t, kStepState2);
  bool s3_vec = false;
  if constexpr (kState3) s3_vec = vec_ok(table, t, kStepState3);

  for (int64_t base = w.begin; base < w.end; base += kStepStride) {
    float a[kStepUnroll][kPack], g[kStepUnroll][kPack], p[kStepUnroll][kPack];
    float s1[kStepUnroll][kPack], s2[kStepUnroll][kPack], s3[kStepUnroll][kPack];
    int64_t idx[kStepUnroll];
    bool whole[kStepUnroll];
#pragma unroll
    for (int u = 0; u < kStepUnroll; ++u) {  // issue every load before the first use
      idx[u] = pack_index(base, u, thread);
      whole[u] = idx[u] + kPack <= w.end;
      if (read_acc) load_pack(acc, 0, idx[u], w.end, acc_vec && whole[u], a[u]);
      if (read_grad) {
        load_pack(grad, table.dtype[kStepGrad][t], idx[u], w.end, grad_vec && whole[u], g[u]);
      }
      if constexpr (!kParam) {
        for (int k = 0; k < kPack; ++k) p[u][k] = 0.0f;  // (none: never stored)
      } else if constexpr (has_rem) {
        load_master_pack(param, lp, idx[u], w.end, param_vec && lp_vec && whole[u], p[u]);
      } else {
        load_pack(param, param_dtype, idx[u], w.end, param_vec && whole[u], p[u]);
      }
      if (has_state1) load_pack(state1, 0, idx[u], w.end, s1_vec && whole[u], s1[u]);
      if (kStates >= 2) load_pack(state2, 0, idx[u], w.end, s2_vec && whole[u], s2[u]);
      if (has_state3) load_pack(state3, 0, idx[u], w.end, s3_vec && whole[u], s3[u]);
    }
#pragma unroll
    for (int u = 0; u < kStepUnroll; ++u) {
      if (idx[u] >= w.end) continue;
      // the master follows its weight where that was written from outside (math::follow_weight).
      // Loaded here, after the other loads are issued: with the load among them, Adam's kernel
      // spilled 4 bytes at its bound (nvcc 13.0, sm_90); the other warps cover the latency.
      if (has_lp) follow_lp_pack(lp, table.dtype[kStepLp][t], idx[u], w.end, lp_vec && whole[u], p[u]);
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const float ge =
            kInput ? g[u][k] : math::effective_grad(read_acc ? a[u][k] : 0.0f, args.fused ? g[u][k] : 0.0f, gs);
        math::update<Algo, kState3>(ge, p[u][k], s1[u][k], s2[u][k], s3[u][k], has_state3, hyper, scalars);
      }
      if constexpr (!kParam) {
      } else if constexpr (has_rem) {
        store_master_pack(param, lp, idx[u], w.end, param_vec && lp_vec && whole[u], p[u]);
      } else {
        store_pack(param, param_dtype, idx[u], w.end, param_vec && whole[u], p[u]);
      }
      if (has_state1) store_pack(state1, 0, idx[u], w.end, s1_vec && whole[u], s1[u]);
      if (kStates >= 2) store_pack(state2, 0, idx[u], w.end, s2_vec && whole[u], s2[u]);
      if (has_state3) store_pack(state3, 0, idx[u], w.end, s3_vec && whole[u], s3[u]);
      if (has_lp) store_pack(lp, table.dtype[kStepLp][t], idx[u], w.end, lp_vec && whole[u], p[u]);
    }
  }
}

// The scalars of the table's tensor t (its rows where Algo::kShaped: the table has them).
template <class Algo, int kArrays, bool kRows>
FA_HD typename Algo::Scalars tensor_scalars(const Table<kArrays, kRows>& table, const DeviceStepArgs& args,
                                            const typename Algo::Hyper& hyper, int t) {
  int64_t rows = 1;
  if constexpr (kRows) rows = table.rows[t];
  return math::tensor_scalars<Algo>(*args.lr, args.steps[table.index[t]], hyper, rows, table.numel[t]);
}

// As step_thread_with, computing the tensor's scalars itself (the CPU emulation of the kernel),
// in the mode of the table's lp column (kI16: the remainders), as launch_step picks the kernel.
template <class Algo, int kArrays, bool kRows>
FA_HD void step_thread(const Table<kArrays, kRows>& table, const DeviceStepArgs& args,
                       const typename Algo::Hyper& hyper, int chunk, int thread) {
  if (step_skipped(args)) return;  // skip-all, no host sync
  const Work w = chunk_work(table, chunk);
  const auto scalars = tensor_scalars<Algo>(table, args, hyper, w.t);
  if (table.ptr[kStepLp][w.t] != nullptr && table.dtype[kStepLp][w.t] == static_cast<uint8_t>(DType::kI16)) {
    step_thread_with<Algo, true>(table, args, hyper, scalars, chunk, thread);
  } else {
    step_thread_with<Algo, false>(table, args, hyper, scalars, chunk, thread);
  }
}

// The operand of the lp column: the remainders when the step has them, else the lp copies.
inline const Operand* lp_column(const TensorLists& t) { return t.rem.present() ? &t.rem : &t.lp; }

namespace {

// The table of a call of Algo without (6 operands) or with (7) a third state list, with the
// rows of each matrix where Algo's scalars take its shape (math.h's kShaped).
template <class Algo, bool kState3>
using TableOf = Table<kState3 ? 7 : 6, Algo::kShaped>;

// Algo's kernel's blocks per SM, without or with the third state list (math.h: kCudaMinBlocks
// has an entry per kernel the algorithm has; one where the third list is required).
template <class Algo, bool kState3>
constexpr int kMinBlocks = Algo::kCudaMinBlocks[kState3 && !math::kState3Required<Algo> ? 1 : 0];

template <class Algo, bool kState3, bool kRemainder>
__global__ void __launch_bounds__(kThreads, kMinBlocks<Algo, kState3>)
    step_kernel(const __grid_constant__ TableOf<Algo, kState3> table, DeviceStepArgs args,
                typename Algo::Hyper hyper) {
  if (step_skipped(args)) return;  // uniform over the grid: no thread reaches the barrier
  // One thread computes the tensor's scalars (Adam: double pow, sqrt, divide) for the block.
  __shared__ typename Algo::Scalars scalars;
  if (threadIdx.x == 0) scalars = tensor_scalars<Algo>(table, args, hyper, chunk_work(table, blockIdx.x).t);
  __syncthreads();
  step_thread_with<Algo, kRemainder>(table, args, hyper, scalars, blockIdx.x, threadIdx.x);
}

template <class Algo, bool kState3>
const char* launch_step(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h,
                        void* stream) {
  const DeviceStepArgs args{a.lr, a.coef, a.steps, a.found_inf, a.grad_alpha, t.grad.present(),
                            a.grads_overwrite, a.maximize};
  const bool remainders = t.rem.present();
  const auto launch = [&](const TableOf<Algo, kState3>& table, int chunks) {
    const auto kernel = remainders ? step_kernel<Algo, kState3, true> : step_kernel<Algo, kState3, false>;
    kernel<<<chunks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(table, args, h);
    return last_error();
  };
  if constexpr (kState3) {
    const Operand* const ops[7] = {&t.acc,    &t.grad,       &t.param, &t.state1,
                                   &t.state2, lp_column(t), &t.state3};
    return for_each_table<7, Algo::kShaped>(t, ops, launch);
  } else {
    const Operand* const ops[6] = {&t.acc, &t.grad, &t.param, &t.state1, &t.state2, lp_column(t)};
    return for_each_table<6, Algo::kShaped>(t, ops, launch);
  }
}

}  // namespace
}  // namespace cuda

// A call with a third state list (Adam's amsgrad) runs its own instantiation, so the other
// kernels carry none of the third state's loads, stores and registers. An algorithm that always
// keeps three states (math::kState3Required: the binding refuses a call without the list) has
// only that one.
template <class Algo>
const char* step_cuda(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h, void* stream) {
  if constexpr (math::kState3Required<Algo>) {
    return cuda::launch_step<Algo, true>(t, a, h, stream);
  } else {
    if constexpr (math::kStateCount<Algo> >= 3) {
      if (t.state3.present()) return cuda::launch_step<Algo, true>(t, a, h, stream);
    }
    return cuda::launch_step<Algo, false>(t, a, h, stream);
  }
}

#define FA_CUDA_STEP(A) \
  template const char* step_cuda<math::A>(const TensorLists&, const StepArgs&, const math::A::Hyper&, void*);
FUSED_ACCUM_ALGORITHMS(FA_CUDA_STEP)
#undef FA_CUDA_STEP

}  // namespace fused_accum
