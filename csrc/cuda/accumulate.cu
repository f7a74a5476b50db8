// accumulate on CUDA: acc = alpha * grad + (0 if overwrite else acc) over many tensors per
// launch, with the sum of squares and the non-finite flag of the values written.
//
// Bytes per element: bf16 grad 2 + acc 4 read (none on overwrite) + acc 4 written = 10 (6).
#include "../math.h"
#include "multi_tensor.cuh"

namespace fused_accum {
namespace cuda {

using AccTable = Table<2>;  // operands: acc, grad
enum AccOperand { kAccAcc = 0, kAccGrad = 1 };

// 2 packs per thread per iteration: 6 loads of 16 bytes in flight (bf16 grads), 48-53 registers,
// so 4 blocks of 256 threads fit on an SM.
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
  const bool vector_ok = table.vector_ok[w.t];
  ThreadStats stats{0.0f, false};

  for (int64_t base = w.begin; base < w.end; base += kAccStride) {
    float a[kAccUnroll][kPack], g[kAccUnroll][kPack];
    int64_t idx[kAccUnroll];
    bool vec[kAccUnroll];
#pragma unroll
    for (int u = 0; u < kAccUnroll; ++u) {  // issue every load before the first use
      idx[u] = pack_index(base, u, thread);
      vec[u] = vector_ok && idx[u] + kPack <= w.end;
      load_pack(grad, grad_dtype, idx[u], w.end, vec[u], g[u]);
      if (!overwrite) load_pack(acc, 0, idx[u], w.end, vec[u], a[u]);
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
      store_pack(acc, 0, idx[u], w.end, vec[u], a[u]);
    }
  }
  return stats;
}

namespace {

__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(const __grid_constant__ AccTable table, float alpha, bool overwrite,
                      float* found_inf, float* sumsq) {
  ThreadStats stats = accumulate_thread(table, alpha, overwrite, blockIdx.x, threadIdx.x);
  if (found_inf != nullptr && __syncthreads_or(stats.nonfinite) && threadIdx.x == 0) {
    *found_inf = 1.0f;  // OR-ed over calls: never reset here
  }
  if (sumsq != nullptr) {
    // Warp shuffle, then one value per warp through shared memory, then one atomic per block.
    __shared__ float warp_sums[kThreads / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      stats.sumsq += __shfl_down_sync(0xFFFFFFFFu, stats.sumsq, offset);
    }
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = stats.sumsq;
    __syncthreads();
    if (threadIdx.x == 0) {
      float block_sumsq = 0.0f;
#pragma unroll
      for (int k = 0; k < kThreads / 32; ++k) block_sumsq += warp_sums[k];
      atomicAdd(sumsq, block_sumsq);
    }
  }
}

}  // namespace
}  // namespace cuda

const char* accumulate_cuda(const TensorLists& t, const AccumulateArgs& a, void* stream) {
  using namespace cuda;
  const Operand* const ops[2] = {&t.acc, &t.grad};
  return for_each_table(t, ops, [&](const AccTable& table, int chunks) {
    accumulate_kernel<<<chunks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        table, a.alpha, a.overwrite, a.found_inf, a.sumsq);
    return last_error();
  });
}

}  // namespace fused_accum
