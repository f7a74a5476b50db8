// How the CPU kernels walk many tensors: the elements of all tensors of a call are one index
// space, cut into ranges for parallel_for (so 2,000 tiny tensors and one huge one balance
// alike), and each range into blocks of kBlock elements, small enough that the fp32 staging
// arrays of a block stay in L1 (3 arrays x 4 KB).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../kernels.h"

// The element loops are compiled three times, for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA)
// and baseline x86-64, and the best one the CPU has is picked when the library loads (GCC
// function multi-versioning). A plain -mavx2 build would crash on older CPUs; a baseline-only
// build leaves the vector width and the FMA unit unused (baseline fmaf is a libm call). The v3
// clone is what a Zen 1-3 or Intel AVX2 CPU runs; v4 gives Zen 4 / Sapphire Rapids 16 lanes,
// as DeepSpeed's CPU Adam has. All clones round identically: every FMA is an explicit fmaf
// (csrc/math.h) and -ffp-contract=off forbids others.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FA_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FA_CPU_CLONES
#endif

namespace fused_accum {
namespace cpu {

constexpr int64_t kBlock = 1024;
// Elements per parallel task. At ~10 GB/s per core, 64K elements of a 10-byte/element
// accumulate take ~60 us, well above parallel_for's ~5 us start-up.
constexpr int64_t kGrain = 1 << 16;

// dst[j] = float(src[j]) for j < n, src of dtype dt.
void to_float(const void* src, DType dt, int64_t n, float* dst);
// dst[j] = src[j] rounded to dt (nearest even), for j < n.
void from_float(const float* src, int64_t n, void* dst, DType dt);

inline int64_t element_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }

// Pointer to element `offset` of operand `op`'s tensor i.
inline void* at(const Operand& op, int64_t i, int64_t offset) {
  return static_cast<char*>(op.ptr[i]) + offset * element_size(op.dtype[i]);
}
inline float* at_f32(const Operand& op, int64_t i, int64_t offset) {
  return static_cast<float*>(op.ptr[i]) + offset;
}

// Prefix sums of the tensors' sizes: tensor i owns global elements [starts[i], starts[i+1]).
inline std::vector<int64_t> element_starts(const TensorLists& t) {
  std::vector<int64_t> starts(t.numel.size() + 1, 0);
  for (size_t i = 0; i < t.numel.size(); ++i) starts[i + 1] = starts[i] + t.numel[i];
  return starts;
}

// Calls block(i, offset, n) for every block of at most kBlock elements of tensor i that lies in
// the global element range [begin, end).
template <class Block>
void for_each_block(const std::vector<int64_t>& starts, int64_t begin, int64_t end, Block&& block) {
  int64_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; begin < end; ++i) {
    const int64_t stop = std::min(end, starts[i + 1]);
    for (int64_t g = begin; g < stop; g += kBlock) {
      block(i, g - starts[i], std::min(kBlock, stop - g));
    }
    begin = stop;
  }
}

}  // namespace cpu
}  // namespace fused_accum
