// The CPU kernels: accumulate, fold_pieces and the optimizer steps over many tensors per call, in
// the order a call walks them: how the kernels walk tensors, the dtype conversion loops that
// stage bf16/fp16 values as fp32, accumulate, then the steps. The steps are one template over
// math.h's algorithm traits (step_cpu<Algo>, instantiated for each of FUSED_ACCUM_ALGORITHMS):
// the update rules themselves are math.h's, shared with the CUDA kernels; the bf16/fp16
// conversions are csrc/cpu/convert.h's (tested alone by csrc/tests/test_convert.cpp). The
// binding (csrc/bindings.cpp) calls the functions kernels.h declares.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>  // the out-of-place steps' streaming stores
#endif

#include "../kernels.h"
#include "../math.h"
#include "convert.h"

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
namespace {

// ---- how the kernels walk tensors -----------------------------------------------------------
//
// The elements of all tensors of a call are one index
// space, cut into ranges for parallel_for (so 2,000 tiny tensors and one huge one balance
// alike), and each range into blocks of kBlock elements, small enough that the fp32 staging
// arrays of a block stay in L1 (3 arrays x 4 KB).
constexpr int64_t kBlock = 1024;
// Elements per parallel task. At ~10 GB/s per core, 64K elements of a 10-byte/element
// accumulate take ~60 us, well above parallel_for's ~5 us start-up.
constexpr int64_t kGrain = 1 << 16;

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

// Where a step stages nothing (no fused micro-batch, params read and written directly:
// direct_params) its element loops run on the tensors themselves, in blocks of this many: a block
// costs a call through the clone's resolver, a switch and the loop's set-up, which at 1024
// elements was 4-7% of the AdamW step's time in L3 and from DRAM (one thread, AVX-512).
constexpr int64_t kUnstagedBlock = 1 << 14;

// Calls block(i, offset, n) for every block of at most block_size elements of tensor i that lies
// in the global element range [begin, end).
// aligned: blocks cut at multiples of block_size from the tensor's start (else from begin).
template <class Block>
void for_each_block(const std::vector<int64_t>& starts, int64_t begin, int64_t end,
                    int64_t block_size, Block&& block, bool aligned = false) {
  int64_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; begin < end; ++i) {
    const int64_t stop = std::min(end, starts[i + 1]);
    for (int64_t g = begin; g < stop;) {
      const int64_t offset = g - starts[i];
      const int64_t n = std::min(aligned ? block_size - offset % block_size : block_size, stop - g);
      block(i, offset, n);
      g += n;
    }
    begin = stop;
  }
}

// How many threads ran the ranges of the last call (accumulate or a step), for the tests: the
// binding's parallel_for is at::parallel_for, whose team is the calling thread's OpenMP thread
// count, and a Python thread that is not the main one (offload's worker) keeps the count it had
// at its first parallel call (torch initialises it once per thread): tests/test_cpu_threads.py
// reads this through fused_accum_cpu_last_call_threads (ctypes). One lock per range: a range is
// at least kGrain elements, tens of microseconds; at::parallel_for gives each thread one range.
std::atomic<int> last_call_threads{0};

class ThreadCount {
 public:
  void add() {
    const std::thread::id id = std::this_thread::get_id();
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(ids_.begin(), ids_.end(), id) == ids_.end()) ids_.push_back(id);
  }
  ~ThreadCount() { last_call_threads.store(static_cast<int>(ids_.size())); }

 private:
  std::mutex mutex_;
  std::vector<std::thread::id> ids_;
};

// ---- the conversions' loops -----------------------------------------------------------------
//
// A block of bf16/fp16 values staged as fp32 (and written back rounded), with convert.h's
// branch-free conversions, which these loops vectorise.

// dst[j] = float(src[j]) for j < n, src of dtype dt.
FA_CPU_CLONES void to_float(const void* src, DType dt, int64_t n, float* dst) {
  switch (dt) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(s[j]);
      break;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = f16_to_float(s[j]);
      break;
    }
    case DType::kI16:  // (a remainder, never converted alone: the binding checks the dtypes)
      break;
  }
}

// dst[j] = src[j] rounded to dt (nearest even), for j < n.
FA_CPU_CLONES void from_float(const float* src, int64_t n, void* dst, DType dt) {
  switch (dt) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_bf16(src[j]);
      break;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_f16(src[j]);
      break;
    }
    case DType::kI16:  // (as in to_float)
      break;
  }
}

// p[j] = math::follow_weight of the master p[j] and the low-precision param lp[j] of dtype dt,
// for j < n: the master follows the weight where lp's bits are not the master's rounding
// (from_float's, the rounding the step writes lp with). An fp32 lp is its master's rounding
// exactly when the bits are equal: p takes lp's bits either way.
FA_CPU_CLONES void follow_lp(float* __restrict p, const void* __restrict lp, DType dt, int64_t n) {
  switch (dt) {
    case DType::kF32:
      std::memcpy(p, lp, n * sizeof(float));
      break;
    case DType::kBF16: {
      const uint16_t* l = static_cast<const uint16_t*>(lp);
      for (int64_t j = 0; j < n; ++j) p[j] = math::follow_weight(p[j], float_to_bf16(p[j]), l[j], bf16_to_float(l[j]));
      break;
    }
    case DType::kF16: {
      const uint16_t* l = static_cast<const uint16_t*>(lp);
      for (int64_t j = 0; j < n; ++j) p[j] = math::follow_weight(p[j], float_to_f16(p[j]), l[j], f16_to_float(l[j]));
      break;
    }
    case DType::kI16:  // (as in to_float)
      break;
  }
}

// ---- accumulate -----------------------------------------------------------------------------
//
// accumulate on the CPU: acc = alpha * grad + (0 if overwrite else acc) over many tensors,
// with the sum of squares and the non-finite flag of the values written.
struct Stats {
  float sumsq;
  int nonfinite;
};

// One loop per value of `overwrite`, so that the overwrite loop does not load acc (6 instead of
// 10 bytes per bf16 element) — a select inside one loop would still load it.
template <bool kOverwrite>
inline __attribute__((always_inline)) Stats accumulate_loop(float* acc, const float* g, int64_t n,
                                                            float alpha) {
  float sumsq = 0.0f;
  int nonfinite = 0;
  // Reordering the sum is what lets it vectorise: 8 partial sums over 1024 values in fp32 (about
  // 1e-6 relative error), then summed across blocks in double.
#pragma omp simd reduction(+ : sumsq) reduction(| : nonfinite)
  for (int64_t j = 0; j < n; ++j) {
    const float v = math::accumulate(kOverwrite ? 0.0f : acc[j], g[j], alpha, kOverwrite);
    acc[j] = v;
    sumsq += v * v;
    nonfinite |= math::nonfinite(v);
  }
  return {sumsq, nonfinite};
}

FA_CPU_CLONES Stats accumulate_block(float* acc, const float* g, int64_t n, float alpha,
                                     bool overwrite) {
  return overwrite ? accumulate_loop<true>(acc, g, n, alpha)
                   : accumulate_loop<false>(acc, g, n, alpha);
}

}  // namespace
}  // namespace cpu

void accumulate_cpu(const TensorLists& t, const AccumulateArgs& a, const ParallelFor& pf) {
  using namespace cpu;
  const std::vector<int64_t> starts = element_starts(t);
  std::mutex mutex;
  double sumsq = 0.0;
  bool nonfinite = false;
  ThreadCount threads;
  pf(0, starts.back(), kGrain, [&](int64_t begin, int64_t end) {
    threads.add();
    float staged[kBlock];
    double range_sumsq = 0.0;
    bool range_nonfinite = false;
    for_each_block(starts, begin, end, kBlock, [&](int64_t i, int64_t offset, int64_t n) {
      const float* g = staged;
      if (t.grad.dtype[i] == DType::kF32) g = at_f32(t.grad, i, offset);
      else to_float(at(t.grad, i, offset), t.grad.dtype[i], n, staged);
      const Stats s = accumulate_block(at_f32(t.acc, i, offset), g, n, a.alpha, a.overwrite);
      range_sumsq += s.sumsq;
      range_nonfinite |= s.nonfinite != 0;
    });
    std::lock_guard<std::mutex> lock(mutex);
    sumsq += range_sumsq;
    nonfinite |= range_nonfinite;
  });
  if (a.sumsq) *a.sumsq += static_cast<float>(sumsq);
  if (a.found_inf && nonfinite) *a.found_inf = 1.0f;  // OR-ed over calls: never reset here
}

// ---- fold_pieces ----------------------------------------------------------------------------
//
// acc = acc (or the first piece) + each piece in order, fp32 adds (kernels.h's FoldArgs). One
// pass over acc: each range of elements is walked in blocks of kFoldBlock, a block of acc stays in
// L1 while every piece's block is added to it in turn, so each element gets its N adds in list
// order and acc is read and written once however many pieces there are.

namespace cpu {
namespace {

constexpr int64_t kFoldBlock = 2048;  // 8 KB of acc in L1, plus one piece's block at a time

// acc[j] = acc[j] + float(piece[j]) for j < n (the add itself in the loop: vectorised per dtype).
FA_CPU_CLONES void add_block(float* __restrict acc, const void* __restrict piece, DType dt,
                             int64_t n) {
  switch (dt) {
    case DType::kF32: {
      const float* p = static_cast<const float*>(piece);
      for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + p[j];
      break;
    }
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(piece);
      for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + bf16_to_float(p[j]);
      break;
    }
    case DType::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(piece);
      for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + f16_to_float(p[j]);
      break;
    }
    default: break;  // the binding admits no other dtype
  }
}

}  // namespace
}  // namespace cpu

void fold_pieces_cpu(const FoldArgs& f, const ParallelFor& pf) {
  using namespace cpu;
  const int64_t elsize = element_size(f.dtype);
  const size_t count = f.pieces.size();
  ThreadCount threads;
  pf(0, f.numel, kGrain, [&](int64_t begin, int64_t end) {
    threads.add();
    for (int64_t b = begin; b < end; b += kFoldBlock) {
      const int64_t n = std::min(kFoldBlock, end - b);
      float* acc = f.acc + b;
      size_t k = 0;
      if (f.overwrite) {  // start from the first piece itself (exact: a -0.0 stays -0.0)
        to_float(static_cast<const char*>(f.pieces[0]) + b * elsize, f.dtype, n, acc);
        k = 1;
      }
      for (; k < count; ++k) add_block(acc, static_cast<const char*>(f.pieces[k]) + b * elsize, f.dtype, n);
    }
  });
}

// ---- the steps ------------------------------------------------------------------------------
//
// The optimizer steps on the CPU, each fusing: the gradient from the
// accumulator (optionally plus the last micro-batch), the update of the fp32 state and param,
// and the write of the low-precision param copy, over many tensors per call.
//
// The element loops read and write the params where they are (direct_params): fp32 params, and
// fp32 masters with their bf16/fp16 copies, whose master follows the copy where that was written
// from outside (math.h's follow_weight) and whose copy takes the updated master's rounding, both
// in the loop itself (MasterParam). Other params (bf16/fp16 params without a master, an fp32
// copy) are staged as fp32 per block of kBlock elements (follow_lp, the update, from_float);
// so is a fused micro-batch's gradient (effective_grad). Staging keeps one update loop per rule
// however many dtype combinations a call mixes, at the cost of L1 traffic only.
// The fp32 master with a bf16 copy was staged too, in three passes over each 1024-element block
// (follow_lp, the update, from_float), since the follow check came in (87a2b94): the AdamW step
// then took 1.09-1.25x the time of 48dd599's two passes (update, from_float); in one loop it
// takes 0.90-0.98x of 48dd599's, 0.78-0.85x of the three passes' (benchmarks/cpu_step.cpp:
// thread CPU time per element, min of 15-30 calls, one thread, 1M warm and cold, 16M; load 8-9
// on 2 cores, Sapphire Rapids, AVX-512).
//
// Exact 2-byte masters (remainders, issue 28) are not staged: the element loop itself rebuilds
// each master from its bf16 param and int16 remainder and splits the update back into both
// (math.h's rebuild_master / split_master, integer ops and selects that vectorise with the
// update, 16 lanes on AVX-512). Staged, the two extra passes made the AdamW step 1.5x slower in
// cache and 7% slower from DRAM at one thread than the fp32-master step (262K and 16M elements),
// which moves 2 more bytes per element. In the loop, on math.h's 16-bit-lane form: 0.97-1.08x
// its time in cache, 0.65-0.9x from DRAM (one thread, AVX-512, interleaved runs).

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

// ---- out-of-place steps (issue 37) ------------------------------------------------------------
//
// A step with sources (offload's double-buffered host state) reads the old values of every
// operand it writes from that operand's source and writes the new ones into the operand, in the
// same element loops as an in-place step, one pass: the out-of-place forms of the param and
// state accessors below (the *IO ones) read from the source and write the operand. An ordinary
// store to an operand that is not in cache first reads its line from memory (read for
// ownership), traffic an in-place step does not have. So the loops stream: run_block walks a
// block in chunks of kChunk elements, the element loop (inlined, the chunk's length a constant)
// writes each chunk's new values to small line-aligned buffers (registers or L1), and every
// completed line goes to its operand with non-temporal stores as wide as the clone's vectors
// (stream_chunk), which write whole lines without reading them. Memory then sees the reads of
// the sources and the writes of the operands: an in-place step's traffic. Where a block's
// operands cannot all start a chunk on a line boundary (views at odd offsets, mutually
// misaligned operands: offload's twins are views at the same element offsets of 64-byte aligned
// buffers, so they can) the elements before the first and after the last whole chunk, or the
// whole block, are stored directly (ordinary stores); so are calls that write less than
// stream_min_bytes, whose operands the benchmark finds in cache.
// The fp32 master with its low-precision copy (MasterIO) follows the copy and rounds to it in
// the loop itself (follow_lp's and from_float's per-element functions, as in place: MasterParam),
// and exact 2-byte masters rebuild and split in it as in place: none of them staged, so the
// blocks are kUnstagedBlock long (kBlock with a fused micro-batch, whose gradient is staged).
// Other params (bf16/fp16 params without a master, an fp32 copy) are staged as in place (from
// the sources), the staged param written back with ordinary stores (no offload layout has them).
// Measured with python -m fused_accum bench offload (AdamW, fp32 master + bf16 copy; the 2-core
// AMD EPYC (Zen 4, AVX-512), shared with other work), speculated_over_step at 0.5 / 4 / 16 /
// 25 MB, old and new interleaved from two worktrees at load 0.8 (two rounds each), plus
// benchmarks/results/offload_issue37_run5 and run6:
//   before (one 128-element sub-block at a time: the loops writing an L1 scratch block, then
//   stream_copy; kSourceBlock 64/128/256 and copy-then-step had been tried): one thread
//   1.72-1.88 / 1.47-1.52 / 1.41-1.57 / 1.44-1.55x, two 1.54-1.98 / 1.28-1.43 / 1.29-1.41 /
//   0.94-1.42x.
//   this: one thread 1.00-1.12 / 0.91-1.17 / 0.88-1.18 / 0.88-1.15x, two 1.01-1.12 / 0.88-1.16 /
//   0.85-1.15 / 0.85-1.17x (at load 2-4, one thread: up to 1.11 / 1.21 / 1.28 / 1.23x; two
//   threads could not be timed then: another job's thread held a core and most calls of either
//   step waited ~8 ms for it).
// What mattered (one thread, interleaved runs of host_step_rows, load 1-2): fusing the passes
// and the block walk into one loop with 16-byte (SSE2) streaming stores, 4 / 16 / 25 MB
// 1.24-1.36 / 1.23-1.29 / 1.2-1.34x; with 64-byte ones (one store per line, as the v4 clone's
// vectors) 1.08-1.2 / 1.15-1.16 / 1.08-1.17x. Ordinary stores instead of streaming: 1.27-1.5 /
// 1.27-1.46 / 1.34-1.47x (not the 2.4-2.6x an earlier form measured, but above 1.3).
// Left: fp32 params without a copy (three written operands, the in-place step the most
// bandwidth-bound) are 1.45 / 1.34x at 4 / 25 MB from memory (python -m benchmarks.kernels
// --repeats 15 --cold --threads 1, one run; before: 1.60 / 1.64x; fp32 master + bf16 copy in the
// same run 1.29 / 1.17x, before 1.43 / 1.53x).

#define FA_ALWAYS_INLINE inline __attribute__((always_inline))

// Elements per streamed chunk: two lines of an fp32 operand, one of a 2-byte operand.
constexpr int64_t kChunk = 32;

// Out-of-place steps that write fewer bytes than this store directly (ordinary stores): in the
// benchmark their operands are in cache (an in-place step just wrote them), where a streaming
// store must also evict the line. (In offload the other buckets' steps pass through the caches
// between two steps of one bucket, so its twins may be cold there, where streaming pays at any
// size: this threshold is the benchmark's, not measured in offload.) One thread, speculated over in-place step, streamed / direct
// (benchmarks/offload.py's host_step_rows, 21 repeats, two runs interleaved, load 1.4-1.7):
// 0.5 MB bucket (1.75 MB written) 1.29-1.5 / 1.12-1.13x, 1 MB 1.23-1.3 / 0.98-1.06x, 2 MB
// (7 MB) 1.14-1.33 / 1.21-1.27x, 4 MB (14 MB) 1.09-1.19 / 1.27x. The tests set it
// (fused_accum_cpu_stream_min_bytes below) to run both forms at any size.
#ifndef FA_STREAM_MIN_BYTES
#define FA_STREAM_MIN_BYTES (4 << 20)
#endif
std::atomic<int64_t> stream_min_bytes{FA_STREAM_MIN_BYTES};

// The widest streaming store of the clone that runs (GCC's resolver picks the x86-64-v4 clone
// where __builtin_cpu_supports("x86-64-v4"), the v3 one where "x86-64-v3"): 64, 32 or 16 bytes.
inline int pick_stream_width() {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
  if (__builtin_cpu_supports("x86-64-v4")) return 64;
  if (__builtin_cpu_supports("x86-64-v3")) return 32;
#endif
  return 16;
}
const int stream_width = pick_stream_width();

// dst[0, kChunk) = buf[0, kChunk) with non-temporal stores, dst and buf 64-byte aligned, as wide
// as the running clone's vectors. A clone cannot name a wider intrinsic than its baseline's
// (target_clones compiles one body for all: GCC refuses to inline _mm512_* into the baseline
// clone), so the 32- and 64-byte forms are inline assembly, run only where that clone runs
// (stream_width; a baseline or v3 clone never meets a zmm instruction, and no legacy-SSE code
// meets a ymm one). 16-byte stores in every clone instead were 1.09-1.19x -> 1.17-1.37x the
// in-place step (4-25 MB, one thread).
template <class T>
FA_ALWAYS_INLINE void stream_chunk(T* dst, const T* buf) {
  constexpr size_t kBytes = kChunk * sizeof(T);
  static_assert(kBytes % 64 == 0, "a chunk is whole lines");
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(buf);
#if defined(__x86_64__) && defined(__GNUC__)
  using Line = char[64];
  if (stream_width == 64) {
    for (size_t k = 0; k < kBytes; k += 64) {
      asm volatile("vmovdqu64 %1, %%zmm0\n\tvmovntdq %%zmm0, %0"
                   : "=m"(*reinterpret_cast<Line*>(d + k))
                   : "m"(*reinterpret_cast<const Line*>(s + k))
                   : "xmm0");
    }
  } else if (stream_width == 32) {
    using Half = char[32];
    for (size_t k = 0; k < kBytes; k += 32) {
      asm volatile("vmovdqu %1, %%ymm0\n\tvmovntdq %%ymm0, %0"
                   : "=m"(*reinterpret_cast<Half*>(d + k))
                   : "m"(*reinterpret_cast<const Half*>(s + k))
                   : "xmm0");
    }
  } else {
    for (size_t k = 0; k < kBytes; k += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + k), _mm_load_si128(reinterpret_cast<const __m128i*>(s + k)));
    }
  }
#else
  std::memcpy(d, s, kBytes);
#endif
}

// After a range's streamed stores, before their data is used.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Where a block's first streamed chunk starts: the first element at which every streamed
// operand of the block is on a line boundary (a 2-byte operand's element index mod 32, an fp32
// one's mod 16), or none.
struct Phase {
  int64_t mod32 = -1, mod16 = -1;
  bool none = false;
  FA_ALWAYS_INLINE void add(const void* p, int64_t element_size) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a % element_size != 0) {
      none = true;
      return;
    }
    const int64_t r = static_cast<int64_t>((64 - a % 64) % 64) / element_size;
    int64_t& m = element_size == 2 ? mod32 : mod16;
    if (m < 0) m = r;
    else if (m != r) none = true;
  }
  // How many elements before the first chunk (n: none).
  FA_ALWAYS_INLINE int64_t head(int64_t n) const {
    if (none) return n;
    if (mod32 >= 0) return mod16 < 0 || mod32 % 16 == mod16 ? std::min(n, mod32) : n;
    return std::min(n, std::max<int64_t>(mod16, 0));
  }
};

// The element loops walk their operands in pieces of kPrefetchBlock elements and prefetch, for
// each, the lines kPrefetchAhead elements ahead in every operand they read. From memory the step
// is bound by the loads in flight, and the hardware's stream prefetchers do not cross a 4 KB
// page (torch's allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE=1), so each stream
// stalls at every page start; 512 elements (2 KB of an fp32 operand) ahead keeps them coming.
// AdamW over DeepSpeedCPUAdam without / with it, ahead 256 / 512 / 1024 elements (Sapphire
// Rapids, one process, interleaved, medians of 15-21): fp32 64M one thread 1.02x / 1.11, 1.13,
// 1.11x; two threads 1.03x / 1.10, 1.11, 1.09x; 16M 1.01-1.03x / 1.04-1.14, 1.08-1.15,
// 1.06-1.11x. With huge pages (THP_MEM_ALLOC_ENABLE=1) the loop without it was 1.08x, with it
// 1.10x: the pages were what it made up for.
constexpr int64_t kPrefetchBlock = 64, kPrefetchAhead = 512;

// Prefetches the lines of x[j, j + kPrefetchBlock), to be written too where kWrite (in place).
template <int kWrite, class T>
FA_ALWAYS_INLINE void prefetch_block(const T* x, int64_t j) {
  const char* first = reinterpret_cast<const char*>(x + j);
  for (int64_t byte = 0; byte < kPrefetchBlock * int64_t{sizeof(T)}; byte += 64) __builtin_prefetch(first + byte, kWrite);
}

// Where an element loop reads and writes the param: fp32 values (the master, or a staged
// block), or an exact master's two halves, rebuilt and split in the loop, in place; or out of
// place (*IO). Every accessor, param or state, has at(o) (the same accessor at element o),
// prefetch(j) (prefetch_block of the operands it reads at element j),
// and for run_block: kStreams (whether it writes an operand out of place), Buf (its chunk's
// buffers), chunk(o, buf) (the accessor at o writing buf), flush(o, buf) (buf streamed to the
// operand at o), phase (its operands' alignment).
// (always_inline, as math.h's split_master and rebuild_master: a call left in an Adam loop keeps
// it scalar, 7x slower)
struct NoBuf {};
struct InPlaceAccessor {  // run_block's members for an accessor that writes in place
  static constexpr bool kStreams = false;
  using Buf = NoBuf;
  FA_ALWAYS_INLINE void flush(int64_t, const NoBuf&) const {}
  FA_ALWAYS_INLINE void phase(Phase&) const {}
};
struct Fp32Param : InPlaceAccessor {
  float* __restrict p;
  explicit Fp32Param(float* q) : p(q) {}
  FA_ALWAYS_INLINE float load(int64_t j) const { return p[j]; }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const { p[j] = v; }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const { prefetch_block<1>(p, j); }
  FA_ALWAYS_INLINE Fp32Param at(int64_t o) const { return Fp32Param{p + o}; }
  FA_ALWAYS_INLINE Fp32Param chunk(int64_t o, NoBuf&) const { return at(o); }
};
struct RemainderParam : InPlaceAccessor {
  uint16_t* __restrict w;  // the bf16 param's bits
  int16_t* __restrict r;   // its remainder
  RemainderParam(uint16_t* w_, int16_t* r_) : w(w_), r(r_) {}
  FA_ALWAYS_INLINE float load(int64_t j) const { return math::rebuild_master(w[j], r[j]); }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const {
    const math::SplitMaster s = math::split_master(v);
    w[j] = s.weight;
    r[j] = s.remainder;
  }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const {
    prefetch_block<1>(w, j);
    prefetch_block<1>(r, j);
  }
  FA_ALWAYS_INLINE RemainderParam at(int64_t o) const { return {w + o, r + o}; }
  FA_ALWAYS_INLINE RemainderParam chunk(int64_t o, NoBuf&) const { return at(o); }
};
// No param: a step that reads and writes none (math.h's kWritesParam: a split step's prologue).
struct NoParam : InPlaceAccessor {
  FA_ALWAYS_INLINE float load(int64_t) const { return 0.0f; }
  FA_ALWAYS_INLINE void store(int64_t, float) const {}
  FA_ALWAYS_INLINE void prefetch(int64_t) const {}
  FA_ALWAYS_INLINE NoParam at(int64_t) const { return {}; }
  FA_ALWAYS_INLINE NoParam chunk(int64_t, NoBuf&) const { return {}; }
};
// An fp32 state operand in place (from a float*); null: absent.
struct InPlace : InPlaceAccessor {
  float* __restrict p;
  InPlace(float* q) : p(q) {}  // NOLINT: implicit, from the in-place callers' pointers
  FA_ALWAYS_INLINE float load(int64_t j) const { return p[j]; }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const { p[j] = v; }
  FA_ALWAYS_INLINE bool present() const { return p != nullptr; }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const {
    if (p) prefetch_block<1>(p, j);
  }
  FA_ALWAYS_INLINE InPlace at(int64_t o) const { return p ? p + o : nullptr; }
  FA_ALWAYS_INLINE InPlace chunk(int64_t o, NoBuf&) const { return at(o); }
  static InPlace none() { return nullptr; }
};

// Out of place: the old values read from in, the new written to out (or a chunk's buffer);
// stream: whether run_block may stream (else ordinary stores throughout).
struct StateIO {
  const float* __restrict in;
  float* __restrict out;
  bool stream;
  static constexpr bool kStreams = true;
  struct Buf {
    alignas(64) float v[kChunk];
  };
  FA_ALWAYS_INLINE float load(int64_t j) const { return in[j]; }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const { out[j] = v; }
  FA_ALWAYS_INLINE bool present() const { return out != nullptr; }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const {
    if (out) prefetch_block<0>(in, j);
  }
  FA_ALWAYS_INLINE StateIO at(int64_t o) const { return out ? StateIO{in + o, out + o, stream} : *this; }
  FA_ALWAYS_INLINE StateIO chunk(int64_t o, Buf& b) const { return out ? StateIO{in + o, b.v, stream} : *this; }
  FA_ALWAYS_INLINE void flush(int64_t o, const Buf& b) const {
    if (out) stream_chunk(out + o, b.v);
  }
  FA_ALWAYS_INLINE void phase(Phase& ph) const {
    if (!stream) ph.none = true;
    else if (out) ph.add(out, 4);
  }
  static StateIO none() { return {nullptr, nullptr, false}; }
};
// An fp32 master and its bf16 or fp16 copy (kLp), element by element: the master as the update
// starts from it, following the copy where that was written from outside (follow_lp's rule),
// and the copy of an updated master (from_float's rounding).
template <DType kLp>
FA_ALWAYS_INLINE uint16_t round_to(float v) {
  return kLp == DType::kBF16 ? float_to_bf16(v) : float_to_f16(v);
}
template <DType kLp>
FA_ALWAYS_INLINE float followed(float master, uint16_t lp) {
  return math::follow_weight(master, round_to<kLp>(master), lp, kLp == DType::kBF16 ? bf16_to_float(lp) : f16_to_float(lp));
}

// The fp32 master with its bf16 or fp16 copy (kLp), in place: followed and rounded in the element
// loop itself, one pass, where the staged form took three (follow_lp, the update, from_float)
// over a 1024-element block.
template <DType kLp>
struct MasterParam : InPlaceAccessor {
  float* __restrict p;
  uint16_t* __restrict lp;
  MasterParam(float* p_, uint16_t* lp_) : p(p_), lp(lp_) {}
  FA_ALWAYS_INLINE float load(int64_t j) const { return followed<kLp>(p[j], lp[j]); }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const {
    p[j] = v;
    lp[j] = round_to<kLp>(v);
  }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const {
    prefetch_block<1>(p, j);
    prefetch_block<1>(lp, j);
  }
  FA_ALWAYS_INLINE MasterParam at(int64_t o) const { return {p + o, lp + o}; }
  FA_ALWAYS_INLINE MasterParam chunk(int64_t o, NoBuf&) const { return at(o); }
};

// The fp32 master, and its low-precision copy of dtype kLp (kF32: none) out of place, followed
// and rounded as MasterParam's.
template <DType kLp>
struct MasterIO {
  const float* __restrict in;
  const uint16_t* __restrict lp_in;
  float* __restrict out;
  uint16_t* __restrict lp_out;
  bool stream;
  static constexpr bool kStreams = true;
  static constexpr bool kHasLp = kLp != DType::kF32;
  struct Buf {
    alignas(64) float p[kChunk];
    alignas(64) uint16_t lp[kHasLp ? kChunk : 1];
  };
  FA_ALWAYS_INLINE float load(int64_t j) const {
    if constexpr (kHasLp) return followed<kLp>(in[j], lp_in[j]);
    else return in[j];
  }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const {
    out[j] = v;
    if constexpr (kHasLp) lp_out[j] = round_to<kLp>(v);
  }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const {
    prefetch_block<0>(in, j);
    if constexpr (kHasLp) prefetch_block<0>(lp_in, j);
  }
  FA_ALWAYS_INLINE MasterIO at(int64_t o) const {
    return {in + o, kHasLp ? lp_in + o : nullptr, out + o, kHasLp ? lp_out + o : nullptr, stream};
  }
  FA_ALWAYS_INLINE MasterIO chunk(int64_t o, Buf& b) const {
    return {in + o, kHasLp ? lp_in + o : nullptr, b.p, kHasLp ? b.lp : nullptr, stream};
  }
  FA_ALWAYS_INLINE void flush(int64_t o, const Buf& b) const {
    stream_chunk(out + o, b.p);
    if (kHasLp) stream_chunk(lp_out + o, b.lp);
  }
  FA_ALWAYS_INLINE void phase(Phase& ph) const {
    if (!stream) ph.none = true;
    ph.add(out, 4);
    if (kHasLp) ph.add(lp_out, 2);
  }
};
struct RemainderParamIO {
  const uint16_t* __restrict w_in;
  const int16_t* __restrict r_in;
  uint16_t* __restrict w_out;
  int16_t* __restrict r_out;
  bool stream;
  static constexpr bool kStreams = true;
  struct Buf {
    alignas(64) uint16_t w[kChunk];
    alignas(64) int16_t r[kChunk];
  };
  FA_ALWAYS_INLINE float load(int64_t j) const { return math::rebuild_master(w_in[j], r_in[j]); }
  FA_ALWAYS_INLINE void store(int64_t j, float v) const {
    const math::SplitMaster s = math::split_master(v);
    w_out[j] = s.weight;
    r_out[j] = s.remainder;
  }
  FA_ALWAYS_INLINE void prefetch(int64_t j) const {
    prefetch_block<0>(w_in, j);
    prefetch_block<0>(r_in, j);
  }
  FA_ALWAYS_INLINE RemainderParamIO at(int64_t o) const { return {w_in + o, r_in + o, w_out + o, r_out + o, stream}; }
  FA_ALWAYS_INLINE RemainderParamIO chunk(int64_t o, Buf& b) const { return {w_in + o, r_in + o, b.w, b.r, stream}; }
  FA_ALWAYS_INLINE void flush(int64_t o, const Buf& b) const {
    stream_chunk(w_out + o, b.w);
    stream_chunk(r_out + o, b.r);
  }
  FA_ALWAYS_INLINE void phase(Phase& ph) const {
    if (!stream) ph.none = true;
    ph.add(w_out, 2);
    ph.add(r_out, 2);
  }
};

// Runs loop(o, len, p, a, b, c) (an element loop over elements [o, o + len) with the
// accessors at o; a, b, c the states, null where absent) over a block of n elements: in place,
// once; out of place, the elements before the first line-aligned chunk and after the last whole
// chunk directly (ordinary stores), the chunks between through their buffers, each streamed to
// its operands once the loop has filled it.
template <class P, class S, class Loop>
FA_ALWAYS_INLINE void run_block(int64_t n, Loop&& loop, P p, S a, S b, S c) {
  if constexpr (!P::kStreams && !S::kStreams) {
    loop(int64_t{0}, n, p, a, b, c);
  } else {
    Phase ph;
    p.phase(ph);
    a.phase(ph);
    b.phase(ph);
    c.phase(ph);
    const int64_t head = ph.head(n);
    typename P::Buf pb{};  // (zeroed once per block: a loop that leaves an absent state's
    typename S::Buf ab{}, bb{}, cb{};  // buffer alone cannot tell the compiler so)
    for (int64_t j = 0; j < n;) {
      if (j >= head && n - j >= kChunk) {
        loop(j, kChunk, p.chunk(j, pb), a.chunk(j, ab), b.chunk(j, bb), c.chunk(j, cb));
        p.flush(j, pb);
        a.flush(j, ab);
        b.flush(j, bb);
        c.flush(j, cb);
        j += kChunk;
      } else {
        const int64_t len = j < head ? head - j : n - j;
        loop(j, len, p.at(j), a.at(j), b.at(j), c.at(j));
        j += len;
      }
    }
  }
}
// (a lambda given to run_block: inlined, so that a chunk's loop has a constant length)
#define FA_INLINE_LAMBDA __attribute__((always_inline))

// sqrt(v) / bias_correction2_sqrt, rounded as the divide rounds, without the divide: the divisor
// b is the same for a whole tensor, so its reciprocal y = RN(1/b) is formed once, and each
// quotient is a product and two FMA corrections. q0 = a*y is within 1.5 ulp of a/b; the first
// correction q1 = RN(q0 + RN(a - b*q0)*y) is within 1/2 ulp + 2^-45 relative of it (faithful);
// from a faithful q1 and y within half an ulp of 1/b, a - b*q1 is exact and
// RN(q1 + (a - b*q1)*y) = RN(a/b) (Markstein's theorem: Muller et al., Handbook of
// Floating-Point Arithmetic, ch. 4, "Markstein's theorem"). Checked against the divide on every
// significand of a, in the binades 2^-75, 1 and 2^63 (exponents only scale), for 7,606 divisors
// b: the bias corrections of beta2 = 0.9, 0.95, 0.98, 0.99, 0.999, 0.9999 at steps 1..1,000,
// the powers of two and all-ones significands from 2^-62 to 1, 1,500 random ones: no difference.
// The theorem holds where nothing under- or overflows: a (a square root) is 0, inf, NaN or in
// [2^-75, 2^64]; with b in [2^-62, 1] (checked per tensor, else the divide runs) every quotient
// and residual is a normal number. 0, inf and NaN take q0 = a*y, which is a/b for them, bits
// and sign alike (a NaN's payload too: both return the operand NaN, quieted).
// Why: the AdamW loop was bound by the divide/sqrt unit on AVX-512 (Zen 4: sqrt and two
// divides per 16 lanes; DeepSpeed's CPU Adam does one sqrt and one divide, in other roundings),
// and the FMA unit had room: the step from L3 (1M elements) took 0.92x the time, from L2 0.88x
// (one thread, /tmp microbenchmark, interleaved). On AVX2 it was 1.03x slower, so only the
// AVX-512 clone's CPU takes this path (kExactDivideByConstant).
struct DivideByConstant {
  float b, y;  // y = RN(1 / b)
  FA_ALWAYS_INLINE float operator()(float a, float) const {
    const float q0 = a * y;
    const float q1 = fmaf(fmaf(-q0, b, a), y, q0);
    const float q2 = fmaf(fmaf(-q1, b, a), y, q1);
    return (a > 0.0f && a < __builtin_inff()) ? q2 : q0;
  }
};

// Whether the CPU runs the AVX-512 clones (x86-64-v4), where DivideByConstant is the faster.
inline bool divide_by_constant_pays() {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
  static const bool avx512 = __builtin_cpu_supports("x86-64-v4");
  return avx512;
#else
  return false;
#endif
}

// Steps that write at least this many bytes divide: their operands come from memory, where the
// step waits on loads, not on the divider, and DivideByConstant's instructions (a product, four
// FMAs, two compares and a select where the divide is one) keep fewer loads in flight. Ours over DeepSpeedCPUAdam's AdamW, with the divide / with
// DivideByConstant, one and two threads (Sapphire Rapids, AVX-512, both forms and DeepSpeed
// interleaved in one process, medians of 11-21, load 0.6-1.2): fp32 64M 1.02-1.05 / 0.96-1.01x,
// 16M 1.00-1.08 / 0.96-1.04x, bf16 + fp32 master 64M 1.28-1.34 / 1.25-1.31x. Smaller steps,
// whose operands can stay in cache from one step to the next (1M elements: 12 MB written), keep
// DivideByConstant: fp32 1M 1.04 / 1.05x one thread, 1.08 / 1.10x two (and on Zen 4 the step
// from L3 took 0.92x the divide's time). With the prefetch (kPrefetchAhead, 4096 elements then)
// the divide still led at 64M: 1.04 / 1.06x against 1.02 / 1.02x, one / two threads.
constexpr int64_t kDivideByConstantMaxBytes = 32 << 20;

// The reciprocal DivideByConstant takes for divisor b, or 0 where it must not (see its bounds)
// or would not pay (a step of `written` bytes, from memory).
inline float divide_by_constant_reciprocal(float b, int64_t written) {
  return divide_by_constant_pays() && written < kDivideByConstantMaxBytes && b >= 0x1p-62f && b <= 1.0f ? 1.0f / b
                                                                                                          : 0.0f;
}

// The element loop of algorithm Algo in mode kMode (math.h: the branches that are the same for
// every element of a tensor, as template constants, so that the loop is straight-line code GCC
// vectorises): the gradient g[j] * c, the param p and the states s1..s3 through their accessors,
// each state read and written only where the mode does (an absent one is null).
template <class Algo, int kMode, class P, class S, class D>
FA_ALWAYS_INLINE void element_loop(const float* __restrict g, float c, P p, S s1, S s2, S s3, int64_t n,
                                   const typename Algo::Hyper& h, const typename Algo::Scalars& s, D divide) {
  constexpr unsigned kReads = Algo::reads(kMode), kWrites = Algo::writes(kMode);
  // Four vectors per iteration: more loads in flight per stream, which is what a step from
  // memory is bound by. AdamW, one thread, ns/element (benchmarks/cpu_step.cpp, thread CPU time,
  // interleaved, Sapphire Rapids AVX-512, load 3-4): fp32 16M 1.31-1.42 -> 1.25-1.26, bf16 +
  // master 16M 1.67-1.73 -> 1.52-1.57, 1M in cache unchanged (0.55-0.64 -> 0.55-0.57); against
  // DeepSpeedCPUAdam in one process, fp32 16M / 64M from 0.87-0.95x / 0.89-0.92x to 0.97-1.02x /
  // 1.00-1.07x. Eight: fp32 a little faster still, bf16 + master back at the unrolled-once time.
  auto run = [&](int64_t begin, int64_t end) FA_INLINE_LAMBDA {
#pragma GCC unroll 4
    for (int64_t j = begin; j < end; ++j) {
      float pj = p.load(j);
      float a = (kReads & 1u) ? s1.load(j) : 0.0f;
      float b = (kReads & 2u) ? s2.load(j) : 0.0f;
      float x = (kReads & 4u) ? s3.load(j) : 0.0f;
      Algo::template update<kMode>(g[j] * c, pj, a, b, x, h, s, divide);
      p.store(j, pj);
      if (kWrites & 1u) s1.store(j, a);
      if (kWrites & 2u) s2.store(j, b);
      if (kWrites & 4u) s3.store(j, x);
    }
  };
  int64_t j = 0;
  for (; j + kPrefetchBlock <= n; j += kPrefetchBlock) {  // (see kPrefetchAhead)
    const int64_t ahead = j + kPrefetchAhead;
    prefetch_block<0>(g, ahead);
    p.prefetch(ahead);
    if (kReads & 1u) s1.prefetch(ahead);
    if (kReads & 2u) s2.prefetch(ahead);
    if (kReads & 4u) s3.prefetch(ahead);
    run(j, j + kPrefetchBlock);
  }
  run(j, n);
}

// Whether Algo's update divides by a per-tensor constant, Algo::divisor(scalars) (math.h).
template <class Algo, class = void>
struct HasDivisor : std::false_type {};
template <class Algo>
struct HasDivisor<Algo, std::void_t<decltype(Algo::divisor(std::declval<const typename Algo::Scalars&>()))>>
    : std::true_type {};

// The exact 2-byte masters' loops keep the divide: their 16-bit-lane split and rebuild already
// load the FMA and shuffle units, and DivideByConstant made them slower (adamw_bf16_master
// cpu_remainder over DeepSpeed, full cpu_adam suite: 16M 1.31x -> 1.09-1.12x, 1M 0.85x ->
// 0.71-0.72x, one thread).
template <class P>
constexpr bool kKeepsDivide = std::is_same_v<P, RemainderParam> || std::is_same_v<P, RemainderParamIO>;

// A block of n elements of one tensor, compiled for each SIMD level (FA_CPU_CLONES): the loop of
// the block's mode, with DivideByConstant where `reciprocal` (RN(1 / Algo::divisor(s)), or 0) is
// given, run over the block by run_block. P: the param's accessor (Fp32Param, RemainderParam;
// out of place MasterIO, RemainderParamIO, or a staged Fp32Param), S: the states' (InPlace, or
// StateIO out of place).
template <class Algo, class P, class S>
FA_CPU_CLONES void step_block(const float* __restrict g, float c, P p, S s1, S s2, S s3, int64_t n,
                              typename Algo::Hyper h, typename Algo::Scalars s, float reciprocal) {
  math::with_mode<Algo>(Algo::mode(h, s, s3.present()), [&](auto mode) FA_INLINE_LAMBDA {
    auto run = [&](auto divide) FA_INLINE_LAMBDA {
      run_block(
          n,
          [&](int64_t o, int64_t len, auto p, auto a, auto b, auto x) FA_INLINE_LAMBDA {
            element_loop<Algo, decltype(mode)::value>(g + o, c, p, a, b, x, len, h, s, divide);
          },
          p, s1, s2, s3);
    };
    if constexpr (HasDivisor<Algo>::value && !kKeepsDivide<P>) {
      if (reciprocal != 0.0f) return run(DivideByConstant{Algo::divisor(s), reciprocal});
    }
    run(math::Divide{});
  });
}

// Whether a step's element loops read and write every param directly, unstaged: exact 2-byte
// masters (RemainderParam, RemainderParamIO), or fp32 params without a low-precision copy
// (Fp32Param, MasterIO<kF32>) or with a bf16/fp16 one (MasterParam, MasterIO). Else (bf16/fp16
// params without a master, an fp32 copy) the param is staged as fp32 in 1024-element blocks.
inline bool direct_params(const TensorLists& t) {
  if (t.rem.present()) return true;
  for (int64_t i = 0; i < t.size(); ++i) {
    if (t.param.dtype[i] != DType::kF32) return false;
    if (t.lp.present() && t.lp.dtype[i] != DType::kBF16 && t.lp.dtype[i] != DType::kF16) return false;
  }
  return true;
}

// The bytes an out-of-place step writes (its operands').
inline int64_t written_bytes(const TensorLists& t) {
  int64_t bytes = 0;
  for (int k = 0; k < TensorLists::kWritten; ++k) {
    const Operand& op = t.written(k);
    if (!op.present()) continue;
    for (int64_t i = 0; i < t.size(); ++i) bytes += t.numel[i] * element_size(op.dtype[i]);
  }
  return bytes;
}

// Tensor i's elements [offset, offset + n) of every written operand from its source (a skipped
// out-of-place step: the operands take the old values).
inline void copy_sources(const TensorLists& t, int64_t i, int64_t offset, int64_t n) {
  for (int k = 0; k < TensorLists::kWritten; ++k) {
    const Operand& src = t.source[k];
    if (src.present()) std::memcpy(at(t.written(k), i, offset), at(src, i, offset), n * element_size(src.dtype[i]));
  }
}

}  // namespace
}  // namespace cpu

// The step of algorithm Algo over many tensors. Per block of tensor i: the gradient is g[j] * c,
// acc itself with c the signed coef (math::effective_grad's product, so the same bits) where no
// micro-batch is fused, else staged by grad_block with c = 1 (exact); the param an Fp32Param or
// a RemainderParam (in place) or an IO form (out of place: MasterIO, RemainderParamIO, or a
// staged Fp32Param), the states InPlace or StateIO (null: absent); step_block runs the
// algorithm's loop over it. With sources (out of place) the same element loops read each old
// value from its source and write the new one into the operand, in one pass (streamed: see
// run_block); a param that is staged is staged from its source (and its weight followed from
// the source's), then written to the operand.
template <class Algo>
void step_cpu(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h, const ParallelFor& pf) {
  using namespace cpu;
  const std::vector<int64_t> starts = element_starts(t);
  const bool sourced = t.sourced();
  if (a.found_inf && *a.found_inf != 0.0f) {  // skip-all: nothing changes (out of place: copied)
    if (sourced) {
      pf(0, starts.back(), kGrain, [&](int64_t begin, int64_t end) {
        for_each_block(starts, begin, end, kUnstagedBlock,
                       [&](int64_t i, int64_t offset, int64_t n) { copy_sources(t, i, offset, n); });
      });
    }
    return;
  }
  const math::GradScalars gs{*a.coef, a.grad_alpha, t.grad.present(), a.grads_overwrite,
                             a.maximize};
  // Per tensor, once (Adam: two pow() in double), not per block; and the reciprocal of the
  // divisor where DivideByConstant may divide by it (AVX-512 clones, divisor in its bounds, a
  // call under kDivideByConstantMaxBytes).
  std::vector<typename Algo::Scalars> scalars(t.size());
  std::vector<float> reciprocal(t.size(), 0.0f);
  const int64_t written = written_bytes(t);
  for (int64_t i = 0; i < t.size(); ++i) {
    scalars[i] = math::tensor_scalars<Algo>(*a.lr, a.steps[t.index[i]], h, Algo::kShaped ? t.rows[i] : 1, t.numel[i]);
    if constexpr (HasDivisor<Algo>::value) reciprocal[i] = divide_by_constant_reciprocal(Algo::divisor(scalars[i]), written);
  }
  const bool has_rem = t.rem.present();
  const bool direct = !Algo::kWritesParam || direct_params(t);
  // (a fused micro-batch's gradient is staged: 1024-element blocks, in L1)
  const int64_t block_size = direct && !t.grad.present() ? kUnstagedBlock : kBlock;
  const bool stream = sourced && written >= stream_min_bytes.load(std::memory_order_relaxed);
  constexpr int kP = TensorLists::kParam, kL = TensorLists::kLp, kR = TensorLists::kRem;
  ThreadCount threads;
  pf(0, starts.back(), kGrain, [&](int64_t begin, int64_t end) {
    threads.add();
    float g[kBlock], p_staged[kBlock];
    auto block = [&](int64_t i, int64_t offset, int64_t n) {
      // the block of written operand k, and where its old values are read from (in place: the
      // same)
      auto out = [&](int k) -> void* { return t.written(k).present() ? at(t.written(k), i, offset) : nullptr; };
      auto in = [&](int k) -> void* {
        if (!sourced) return out(k);
        return t.source[k].present() ? at(t.source[k], i, offset) : nullptr;
      };
      const float* grad = at_f32(t.acc, i, offset);
      float c = gs.maximize ? -gs.coef : gs.coef;
      if constexpr (Algo::kReadsInput) {  // the op's input, in the gradient's place, as it is
        if (t.grad.dtype[i] == DType::kF32) {
          grad = at_f32(t.grad, i, offset);
        } else {
          to_float(at(t.grad, i, offset), t.grad.dtype[i], n, g);
          grad = g;
        }
        c = 1.0f;
      } else if (gs.fused) {
        to_float(at(t.grad, i, offset), t.grad.dtype[i], n, g);
        grad_block(grad, g, n, gs);
        grad = g;
        c = 1.0f;
      }
      // (a split step's ops: in place, the binding refuses sources; the prologue's param is
      // NoParam: only those loops are compiled)
      constexpr bool kSplit = !Algo::kWritesParam || Algo::kReadsInput;
      auto run_io = [&](auto p) {  // out of place
        auto io = [&](int k) { return StateIO{static_cast<const float*>(in(k)), static_cast<float*>(out(k)), stream}; };
        if constexpr (!kSplit) {
          step_block<Algo>(grad, c, p, io(TensorLists::kState1), io(TensorLists::kState2), io(TensorLists::kState3),
                           n, h, scalars[i], reciprocal[i]);
        }
      };
      auto run_in = [&](auto p) {  // in place
        auto state = [&](int k) { return InPlace{static_cast<float*>(out(k))}; };
        if constexpr (Algo::kWritesParam || std::is_same_v<decltype(p), NoParam>) {
          step_block<Algo>(grad, c, p, state(TensorLists::kState1), state(TensorLists::kState2),
                           state(TensorLists::kState3), n, h, scalars[i], reciprocal[i]);
        }
      };
      if constexpr (!Algo::kWritesParam) {
        run_in(NoParam{});
        return;
      }
      if (has_rem) {  // the master is the bf16 param plus its remainder (the binding checked)
        if (sourced) {
          run_io(RemainderParamIO{static_cast<const uint16_t*>(in(kP)), static_cast<const int16_t*>(in(kR)),
                                  static_cast<uint16_t*>(out(kP)), static_cast<int16_t*>(out(kR)), stream});
        } else {
          run_in(RemainderParam{static_cast<uint16_t*>(out(kP)), static_cast<int16_t*>(out(kR))});
        }
        return;
      }
      const DType param_dtype = t.param.dtype[i];
      if (direct) {  // an fp32 master, without or with its bf16/fp16 copy (direct_params)
        auto master = [&](auto lp_dtype) {
          constexpr DType kLp = decltype(lp_dtype)::value;
          if (sourced) {
            run_io(MasterIO<kLp>{static_cast<const float*>(in(kP)), static_cast<const uint16_t*>(in(kL)),
                                 static_cast<float*>(out(kP)), static_cast<uint16_t*>(out(kL)), stream});
          } else if constexpr (kLp == DType::kF32) {
            run_in(Fp32Param{static_cast<float*>(out(kP))});
          } else {
            run_in(MasterParam<kLp>{static_cast<float*>(out(kP)), static_cast<uint16_t*>(out(kL))});
          }
        };
        if (!t.lp.present()) master(std::integral_constant<DType, DType::kF32>{});
        else if (t.lp.dtype[i] == DType::kBF16) master(std::integral_constant<DType, DType::kBF16>{});
        else master(std::integral_constant<DType, DType::kF16>{});
        return;
      }
      // staged (bf16/fp16 params without a master, fp32 params with an fp32 copy)
      float* p = p_staged;
      if (param_dtype == DType::kF32 && !sourced) p = static_cast<float*>(out(kP));
      else to_float(in(kP), param_dtype, n, p_staged);
      // the master follows its weight where that was written from outside (in place: the
      // update below writes every element of p)
      if (t.lp.present()) follow_lp(p, in(kL), t.lp.dtype[i], n);
      if (sourced) run_io(Fp32Param{p});
      else run_in(Fp32Param{p});
      if (p == p_staged) from_float(p, n, out(kP), param_dtype);
      if (t.lp.present()) from_float(p, n, out(kL), t.lp.dtype[i]);
    };
    // (out of place: blocks cut at multiples of block_size in each tensor, so that ranges
    // start the only partial chunks)
    for_each_block(starts, begin, end, block_size, block, sourced);
    if (stream) stream_fence();
  });
}

#define FA_CPU_STEP(A) \
  template void step_cpu<math::A>(const TensorLists&, const StepArgs&, const math::A::Hyper&, const ParallelFor&);
FUSED_ACCUM_ALGORITHMS(FA_CPU_STEP)
#undef FA_CPU_STEP

}  // namespace fused_accum

// The test hook above, as a C symbol (tests/test_cpu_threads.py loads _C with ctypes): the
// number of distinct threads that ran the last CPU accumulate or step call, 0 if it ran none.
extern "C" __attribute__((visibility("default"))) int fused_accum_cpu_last_call_threads() {
  return fused_accum::cpu::last_call_threads.load();
}

// The size under which out-of-place steps store directly instead of streaming (in bytes
// written), for the tests (tests/test_step_sources.py, ctypes): sets it to `bytes` unless that
// is negative, and returns the value it had.
extern "C" __attribute__((visibility("default"))) int64_t fused_accum_cpu_stream_min_bytes(int64_t bytes) {
  const int64_t old = fused_accum::cpu::stream_min_bytes.load();
  if (bytes >= 0) fused_accum::cpu::stream_min_bytes.store(bytes);
  return old;
}
