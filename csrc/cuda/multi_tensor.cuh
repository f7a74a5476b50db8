// Multi-tensor apply for the CUDA kernels: many tensors per launch, described by a table passed
// as a kernel argument, one thread block per chunk of kChunk elements of one tensor.
//
// Kernel parameters may take 32,764 bytes with CUDA 12.1+ on Volta and newer (every system a cu13
// build runs on; the build targets sm_80 and sm_90), so a table holds what fits in 32 KB: 932
// tensors for accumulate (2 arrays each), 459 for a step (6 arrays), 407 for Adam with amsgrad
// (7); a 2,048-tensor list is 3 accumulate launches or 5 step launches (4 KB tables took 19 and
// 38). A longer list is
// launched as several tables, in order, on one stream. The table stays a by-value
// __grid_constant__ parameter: no device allocation and no copy to manage, and a CUDA graph
// captures it by value. Each block finds its tensor by binary search over the chunk prefix sums.
//
// Per thread: packs of kPack = 8 consecutive elements, 16-byte vector loads (one for 8 bf16/fp16
// values, two for 8 fp32), every load of an iteration issued before the first is used. Whether a
// pack is vector-loaded is decided per operand (vec_mask): a bf16 gradient view at an odd offset
// is read element by element while the tensor's other operands stay 16-byte loads; the tail of a
// tensor (the last numel % 8 elements) is read element by element.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "../kernels.h"
#include "../math.h"

namespace fused_accum {
namespace cuda {

#if defined(CUDART_VERSION) && CUDART_VERSION < 12010
#error "fused_accum's CUDA kernels take 32 KB parameter tables: CUDA 12.1 or newer"
#endif

// 128 threads per block: with __launch_bounds__(kThreads, kMinBlocks) the step kernels get up to
// 65536 / (128 * 6) = 85 registers and 6+ blocks (24 warps) per SM, where 256-thread blocks at
// 88 registers fitted 2 (16 warps); smaller blocks also finish a chunk's tail sooner.
constexpr int kThreads = 128;
constexpr int kPack = 8;
// Elements per block: 4 packs per thread, 4,096 elements (16 KB of fp32 acc). A 1M-element
// tensor is 256 blocks, ~2 per SM of an H200's 132 at once with room for the next; block
// scheduling costs ~a few hundred ns against ~1 us of memory time per block.
constexpr int64_t kChunk = 4 * kThreads * kPack;
constexpr int kArgBytes = 32764;

// What describes one tensor in a table with kArrays operands: one pointer and one dtype per
// operand, its numel, its chunk prefix sum, its index in the caller's lists, the vector mask;
// with kRows, the rows of its matrix (a step whose scalars take its shape: math.h's kShaped).
constexpr int table_entry_bytes(int arrays, bool rows = false) {
  return arrays * (8 + 1) + 8 + 4 + 4 + 1 + (rows ? 8 : 0);
}
// Room left for the table after the op's other arguments (at most 128 bytes: scalars, hyper),
// and a table without rows keeps one unused entry of them (8 bytes: 459, 407 and 932 tensors as
// before the rows came).
constexpr int table_capacity(int arrays, bool rows = false) {
  return (kArgBytes - 128 - 8 - (rows ? 0 : 8)) / table_entry_bytes(arrays, rows);
}

template <int kArrays, bool kRows = false>
struct Table {
  static constexpr int kCapacity = table_capacity(kArrays, kRows);
  int64_t rows[kRows ? kCapacity : 1];  // (kRows) TensorLists::rows
  void* ptr[kArrays][kCapacity];
  int64_t numel[kCapacity];
  int32_t chunk_end[kCapacity];  // tensor t owns chunks [chunk_end[t-1], chunk_end[t])
  int32_t index[kCapacity];      // position in the caller's lists
  uint8_t dtype[kArrays][kCapacity];
  uint8_t vec_mask[kCapacity];   // bit a: operand a's pointer is 16-byte aligned (vector packs)
  int32_t count;
};
static_assert(sizeof(Table<2>) <= kArgBytes - 128, "accumulate table exceeds the argument budget");
static_assert(sizeof(Table<7>) <= kArgBytes - 128, "step table exceeds the argument budget");
static_assert(sizeof(Table<6, true>) <= kArgBytes - 128, "shaped step table exceeds the argument budget");

// Whether operand a of slot t may be read and written as 16-byte packs.
template <int kArrays, bool kRows>
FA_HD bool vec_ok(const Table<kArrays, kRows>& table, int t, int a) {
  return (table.vec_mask[t] >> a) & 1;
}

// ---- per-thread work ---------------------------------------------------------------------------
// __host__ __device__ (FA_HD): the kernels call these with blockIdx.x/threadIdx.x; the emulation
// tests (csrc/tests/test_cuda_emulated.cu) call them on the CPU for every block and thread, so
// the indexing, tails and conversions are checked on machines without a GPU.

// The chunk block `chunk` owns: tensor slot t and elements [begin, end) of it.
struct Work {
  int t;
  int64_t begin, end;
};

template <int kArrays, bool kRows>
FA_HD Work chunk_work(const Table<kArrays, kRows>& table, int chunk) {
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (table.chunk_end[mid] > chunk) hi = mid;
    else lo = mid + 1;
  }
  const int64_t first = lo == 0 ? 0 : table.chunk_end[lo - 1];
  const int64_t begin = (chunk - first) * kChunk;
  const int64_t numel = table.numel[lo];
  return {lo, begin, begin + kChunk < numel ? begin + kChunk : numel};
}

// Index of the first element of pack u of `thread` in the iteration starting at `base`:
// consecutive threads take consecutive packs, so a warp's loads cover contiguous memory.
FA_HD int64_t pack_index(int64_t base, int u, int thread) {
  return base + (static_cast<int64_t>(u) * kThreads + thread) * kPack;
}

FA_HD float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// bf16 is the top half of an fp32: widening is a shift.
FA_HD float bf16_bits_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }
FA_HD float f16_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
FA_HD uint16_t float_to_bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
FA_HD uint16_t float_to_f16_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

FA_HD float load_one(const void* p, uint8_t dt, int64_t i) {
  switch (static_cast<DType>(dt)) {
    case DType::kBF16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

FA_HD void store_one(void* p, uint8_t dt, int64_t i, float v) {
  switch (static_cast<DType>(dt)) {
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// v = elements [i, i + 8) of p as fp32; zeros past n. `vec`: the pack is 16-byte aligned and
// whole, so it is read with one (16-bit dtypes) or two (fp32) 16-byte loads.
FA_HD void load_pack(const void* p, uint8_t dt, int64_t i, int64_t n, bool vec, float (&v)[kPack]) {
  if (vec && static_cast<DType>(dt) == DType::kF32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = q[0], b = q[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if (vec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    const bool bf16 = static_cast<DType>(dt) == DType::kBF16;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const uint16_t h = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));  // little-endian
      v[k] = bf16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPack; ++k) v[k] = i + k < n ? load_one(p, dt, i + k) : 0.0f;
  }
}

// Elements [i, i + 8) of p = v rounded to p's dtype (nearest even); none past n.
FA_HD void store_pack(void* p, uint8_t dt, int64_t i, int64_t n, bool vec, const float (&v)[kPack]) {
  if (vec && static_cast<DType>(dt) == DType::kF32) {
    float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else if (vec) {
    const bool bf16 = static_cast<DType>(dt) == DType::kBF16;
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = bf16 ? float_to_bf16_bits(v[2 * k]) : float_to_f16_bits(v[2 * k]);
      const uint32_t hi = bf16 ? float_to_bf16_bits(v[2 * k + 1]) : float_to_f16_bits(v[2 * k + 1]);
      w[k] = lo | hi << 16;
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      if (i + k < n) store_one(p, dt, i + k, v[k]);
    }
  }
}

// The masters p of elements [i, i + 8) follow the low-precision params lp (dtype dt) where
// those were written from outside (math::follow_weight): p[k] = float(lp[k]) where lp[k]'s bits
// are not p[k] rounded to dt as store_pack writes lp, else p[k].
// `vec` as in load_pack: one 16-byte load of 8 bf16/fp16 values (two of fp32). Past n, p is
// not stored, whatever it becomes.
template <bool kBF16>
FA_HD void follow_lp_pack_t(const uint16_t* lb, int64_t i, int64_t n, bool vec, float (&p)[kPack]) {
  uint16_t bits[kPack];
  if (vec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(lb + i);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < kPack; ++k) bits[k] = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));  // little-endian
  } else {
#pragma unroll
    for (int k = 0; k < kPack; ++k) bits[k] = i + k < n ? lb[i + k] : 0;  // (past n: not stored)
  }
#pragma unroll
  for (int k = 0; k < kPack; ++k) {
    const uint16_t rounded = kBF16 ? float_to_bf16_bits(p[k]) : float_to_f16_bits(p[k]);
    const float value = kBF16 ? bf16_bits_to_float(bits[k]) : f16_bits_to_float(bits[k]);
    p[k] = math::follow_weight(p[k], rounded, bits[k], value);
  }
}

FA_HD void follow_lp_pack(const void* lp, uint8_t dt, int64_t i, int64_t n, bool vec, float (&p)[kPack]) {
  switch (static_cast<DType>(dt)) {
    case DType::kBF16: follow_lp_pack_t<true>(static_cast<const uint16_t*>(lp), i, n, vec, p); break;
    case DType::kF16: follow_lp_pack_t<false>(static_cast<const uint16_t*>(lp), i, n, vec, p); break;
    default: load_pack(lp, dt, i, n, vec, p);  // fp32: the rounding is the master: p takes lp's bits
  }
}

// Exact 2-byte masters (master_weights="remainder"): the fp32 masters of elements [i, i + 8)
// rebuilt from the bf16 weights w and the int16 remainders r (math::rebuild_master); zeros past
// n. `vec`: both packs are 16-byte aligned and whole: one 16-byte load each, 8 elements.
FA_HD void load_master_pack(const void* w, const void* r, int64_t i, int64_t n, bool vec,
                            float (&v)[kPack]) {
  const uint16_t* wb = static_cast<const uint16_t*>(w);
  const int16_t* rb = static_cast<const int16_t*>(r);
  if (vec) {
    const uint4 wr = *reinterpret_cast<const uint4*>(wb + i);
    const uint4 rr = *reinterpret_cast<const uint4*>(rb + i);
    const uint32_t ws[4] = {wr.x, wr.y, wr.z, wr.w}, rs[4] = {rr.x, rr.y, rr.z, rr.w};
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const int shift = 16 * (k % 2);  // little-endian
      v[k] = math::rebuild_master(static_cast<uint16_t>(ws[k / 2] >> shift),
                                  static_cast<int16_t>(static_cast<uint16_t>(rs[k / 2] >> shift)));
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPack; ++k) v[k] = i + k < n ? math::rebuild_master(wb[i + k], rb[i + k]) : 0.0f;
  }
}

// Elements [i, i + 8) of w and r = the split of the fp32 masters v (math::split_master); none
// past n. `vec` as in load_master_pack.
FA_HD void store_master_pack(void* w, void* r, int64_t i, int64_t n, bool vec, const float (&v)[kPack]) {
  uint16_t* wb = static_cast<uint16_t*>(w);
  int16_t* rb = static_cast<int16_t*>(r);
  if (vec) {
    uint32_t ws[4], rs[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const math::SplitMaster lo = math::split_master(v[2 * k]), hi = math::split_master(v[2 * k + 1]);
      ws[k] = static_cast<uint32_t>(lo.weight) | static_cast<uint32_t>(hi.weight) << 16;
      rs[k] = static_cast<uint32_t>(static_cast<uint16_t>(lo.remainder)) |
              static_cast<uint32_t>(static_cast<uint16_t>(hi.remainder)) << 16;
    }
    *reinterpret_cast<uint4*>(wb + i) = make_uint4(ws[0], ws[1], ws[2], ws[3]);
    *reinterpret_cast<uint4*>(rb + i) = make_uint4(rs[0], rs[1], rs[2], rs[3]);
  } else {
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      if (i + k < n) {
        const math::SplitMaster s = math::split_master(v[k]);
        wb[i + k] = s.weight;
        rb[i + k] = s.remainder;
      }
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Fills tables from `ops` (kArrays operands of t; an absent operand gives null pointers) and calls
// launch(table, chunks) for each full table and the last one. Returns the first launch error.
// Blocks (chunks) that for_each_table launches for `t`, over all of its tables.
inline int64_t total_chunks(const TensorLists& t) {
  int64_t chunks = 0;
  for (int64_t i = 0; i < t.size(); ++i) chunks += (t.numel[i] + kChunk - 1) / kChunk;
  return chunks;
}

template <int kArrays, bool kRows = false, class Launch>
const char* for_each_table(const TensorLists& t, const Operand* const (&ops)[kArrays],
                           Launch&& launch) {
  Table<kArrays, kRows> table;
  table.count = 0;
  int64_t chunks = 0;
  for (int64_t i = 0; i < t.size(); ++i) {
    const int64_t tensor_chunks = (t.numel[i] + kChunk - 1) / kChunk;
    if (tensor_chunks > INT_MAX) return "fused_accum: a tensor of more than 2^31 chunks";
    if (table.count == Table<kArrays, kRows>::kCapacity || chunks + tensor_chunks > INT_MAX) {
      if (const char* err = launch(table, static_cast<int>(chunks))) return err;
      table.count = 0;
      chunks = 0;
    }
    const int s = table.count++;
    uint8_t vec_mask = 0;
    for (int a = 0; a < kArrays; ++a) {
      const bool present = ops[a]->present();
      table.ptr[a][s] = present ? ops[a]->ptr[i] : nullptr;
      table.dtype[a][s] = present ? static_cast<uint8_t>(ops[a]->dtype[i]) : 0;
      if (present && aligned16(ops[a]->ptr[i])) vec_mask |= static_cast<uint8_t>(1u << a);
    }
    chunks += tensor_chunks;
    table.numel[s] = t.numel[i];
    table.chunk_end[s] = static_cast<int32_t>(chunks);
    table.index[s] = static_cast<int32_t>(t.index[i]);
    table.vec_mask[s] = vec_mask;
    if constexpr (kRows) table.rows[s] = t.rows[i];
  }
  if (table.count > 0) return launch(table, static_cast<int>(chunks));
  return nullptr;
}

inline const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace cuda
}  // namespace fused_accum
