// accumulate on CUDA: acc = alpha * grad + (0 if overwrite else acc) over many tensors per
// launch, with the sum of squares and the non-finite flag of the values written.
//
// Bytes per element: bf16 grad 2 + acc 4 read (none on overwrite) + acc 4 written = 10 (6).
//
// The sum of squares is deterministic: each block writes its partial to a workspace slot of its
// own and one single-block kernel adds them up in a fixed order (the float atomicAdd it replaces
// made last_grad_norm and the clip factor differ in the last bits between identical runs).
// The workspace is 4 bytes per block (per 4,096 elements: 0.1% of an accumulate's traffic).
#include "../math.h"
#include "launch.h"
#include "multi_tensor.cuh"

namespace fused_accum {
namespace cuda {

using AccTable = Table<2>;  // operands: acc, grad
enum AccOperand { kAccAcc = 0, kAccGrad = 1 };

// 2 packs per thread per iteration: 6 loads of 16 bytes in flight (bf16 grads), ~50 registers,
// so the 8 blocks of 128 threads that __launch_bounds__ asks for fit on an SM with room to spare.
constexpr int kAccUnroll = 2;
constexpr int kAccStride = kThreads * kPack * kAccUnroll;
static_assert(kChunk % kAccStride == 0, "a chunk is a whole number of iterations");

struct ThreadStats {
  float sumsq;
  bool nonfinite;
};

// Everything thread `thread` of the block for chunk `chunk` does, but the block's reduction.
FA_HD ThreadStats accumulate_thread(const AccTable& table, float alpha, bool overwrite, int chunk,
                                    int thread) {
  const Work w = chunk_work(table, chunk);
  float* acc = static_cast<float*>(table.ptr[kAccAcc][w.t]);
  const void* grad = table.ptr[kAccGrad][w.t];
  const uint8_t grad_dtype = table.dtype[kAccGrad][w.t];
  const bool acc_vec = vec_ok(table, w.t, kAccAcc), grad_vec = vec_ok(table, w.t, kAccGrad);
  ThreadStats stats{0.0f, false};

  for (int64_t base = w.begin; base < w.end; base += kAccStride) {
    float a[kAccUnroll][kPack], g[kAccUnroll][kPack];
    int64_t idx[kAccUnroll];
    bool whole[kAccUnroll];
#pragma unroll
    for (int u = 0; u < kAccUnroll; ++u) {  // issue every load before the first use
      idx[u] = pack_index(base, u, thread);
      whole[u] = idx[u] + kPack <= w.end;
      load_pack(grad, grad_dtype, idx[u], w.end, grad_vec && whole[u], g[u]);
      if (!overwrite) load_pack(acc, 0, idx[u], w.end, acc_vec && whole[u], a[u]);
    }
#pragma unroll
    for (int u = 0; u < kAccUnroll; ++u) {
      if (idx[u] >= w.end) continue;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        a[u][k] = math::accumulate(overwrite ? 0.0f : a[u][k], g[u][k], alpha, overwrite);
        // Elements past the end hold 0 from load_pack: they add nothing to either statistic.
        stats.sumsq += a[u][k] * a[u][k];
        stats.nonfinite |= math::nonfinite(a[u][k]);
      }
      store_pack(acc, 0, idx[u], w.end, acc_vec && whole[u], a[u]);
    }
  }
  return stats;
}

namespace {

// The block's sum of v over its kBlockThreads threads, in a fixed order (shuffle tree within each
// warp, then the warps in order); the result is valid in thread 0.
template <int kBlockThreads>
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kBlockThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float sum = 0.0f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < kBlockThreads / 32; ++k) sum += warp_sums[k];
  }
  return sum;
}

__global__ void __launch_bounds__(kThreads, 8)
    accumulate_kernel(const __grid_constant__ AccTable table, float alpha, bool overwrite,
                      float* __restrict__ found_inf, float* __restrict__ partials) {
  ThreadStats stats = accumulate_thread(table, alpha, overwrite, blockIdx.x, threadIdx.x);
  if (found_inf != nullptr && __syncthreads_or(stats.nonfinite) && threadIdx.x == 0) {
    *found_inf = 1.0f;  // OR-ed over calls: never reset here (a store of 1: any order gives 1)
  }
  if (partials != nullptr) {  // this launch's slots: the caller offsets the pointer
    const float block_sumsq = block_sum<kThreads>(stats.sumsq);
    if (threadIdx.x == 0) partials[blockIdx.x] = block_sumsq;
  }
}

// One block: *sumsq += the n partials, each thread summing a fixed strided subset in order,
// then block_sum. The same n gives the same order, so the same bits, on every run.
constexpr int kReduceThreads = 512;
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partials_kernel(const float* __restrict__ partials, int64_t n, float* __restrict__ sumsq) {
  float v = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kReduceThreads) v += partials[i];
  const float total = block_sum<kReduceThreads>(v);
  if (threadIdx.x == 0) *sumsq += total;
}

}  // namespace
}  // namespace cuda

int64_t accumulate_cuda_workspace(const TensorLists& t, const AccumulateArgs& a) {
  return a.sumsq != nullptr ? cuda::total_chunks(t) : 0;
}

const char* accumulate_cuda_into(const TensorLists& t, const AccumulateArgs& a, float* workspace,
                                 void* stream) {
  using namespace cuda;
  const auto s = static_cast<cudaStream_t>(stream);
  const Operand* const ops[2] = {&t.acc, &t.grad};
  int64_t first = 0;  // this table's first slot in workspace
  const char* err = for_each_table(t, ops, [&](const AccTable& table, int chunks) {
    float* partials = a.sumsq != nullptr ? workspace + first : nullptr;
    accumulate_kernel<<<chunks, kThreads, 0, s>>>(table, a.alpha, a.overwrite, a.found_inf, partials);
    first += chunks;
    return last_error();
  });
  if (err != nullptr || a.sumsq == nullptr || first == 0) return err;
  reduce_partials_kernel<<<1, kReduceThreads, 0, s>>>(workspace, first, a.sumsq);
  return last_error();
}

// The kernels.h entry point, for callers without an allocator of their own: the workspace is
// stream-ordered (cudaMallocAsync/cudaFreeAsync), so it neither syncs nor breaks graph capture.
// The torch binding passes a caching-allocator tensor to accumulate_cuda_into instead.
const char* accumulate_cuda(const TensorLists& t, const AccumulateArgs& a, void* stream) {
  const int64_t n = accumulate_cuda_workspace(t, a);
  if (n == 0) return accumulate_cuda_into(t, a, nullptr, stream);
  const auto s = static_cast<cudaStream_t>(stream);
  void* workspace = nullptr;
  cudaError_t e = cudaMallocAsync(&workspace, n * sizeof(float), s);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const char* err = accumulate_cuda_into(t, a, static_cast<float*>(workspace), stream);
  e = cudaFreeAsync(workspace, s);
  return err != nullptr ? err : e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace fused_accum
