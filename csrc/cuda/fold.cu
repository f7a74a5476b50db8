// fold_pieces on CUDA (kernels.h's FoldArgs): acc = acc (or the first piece) + each piece in
// order, one fp32 add per piece per element, in one launch that reads every piece: the pieces'
// pointers are a by-value kernel parameter (FoldTable, 2 KB), so nothing is copied to the device
// and a CUDA graph captures the launch as it is. More than kMaxFoldPieces pieces take one launch
// per kMaxFoldPieces, in order (the later ones adding to acc), which gives the same bits.
//
// Bytes per element: 4 (acc read; none with overwrite) + N x 2 or 4 (the pieces) + 4 (acc written).
// Each thread owns packs of 8 elements (multi_tensor.cuh's load_pack/store_pack: 16-byte loads
// where acc and every piece are 16-byte aligned, element by element otherwise), one block per
// kChunk elements.
#include <climits>

#include "multi_tensor.cuh"

namespace fused_accum {
namespace cuda {

constexpr int kMaxFoldPieces = 256;

struct FoldTable {
  const void* piece[kMaxFoldPieces];
  int count;
  uint8_t dtype;
  bool from_first;  // overwrite: start from piece[0] itself
  bool vec;         // acc and every piece 16-byte aligned
};

// Everything thread `thread` of block `chunk` does: elements [chunk * kChunk, + kChunk) of acc.
FA_HD void fold_thread(float* acc, int64_t numel, const FoldTable& t, int chunk, int thread) {
  const int64_t begin = static_cast<int64_t>(chunk) * kChunk;
  const int64_t end = begin + kChunk < numel ? begin + kChunk : numel;
  for (int64_t base = begin; base < end; base += kThreads * kPack) {
    const int64_t i = pack_index(base, 0, thread);
    if (i >= end) break;
    const bool vec = t.vec && i + kPack <= end;
    float a[kPack], p[kPack];
    int k = 0;
    if (t.from_first) {
      load_pack(t.piece[0], t.dtype, i, end, vec, a);
      k = 1;
    } else {
      load_pack(acc, 0, i, end, vec, a);
    }
    for (; k < t.count; ++k) {
      load_pack(t.piece[k], t.dtype, i, end, vec, p);
#pragma unroll
      for (int e = 0; e < kPack; ++e) a[e] = a[e] + p[e];
    }
    store_pack(acc, 0, i, end, vec, a);
  }
}

// The FoldTables of `f`, in launch order: launch(table) for each (one for up to kMaxFoldPieces
// pieces). Returns the first error.
template <class Launch>
const char* for_each_fold_table(const FoldArgs& f, Launch&& launch) {
  FoldTable table;
  table.dtype = static_cast<uint8_t>(f.dtype);
  for (size_t first = 0; first < f.pieces.size(); first += kMaxFoldPieces) {
    const size_t count = f.pieces.size() - first < kMaxFoldPieces ? f.pieces.size() - first : kMaxFoldPieces;
    table.count = static_cast<int>(count);
    table.from_first = f.overwrite && first == 0;
    table.vec = aligned16(f.acc);
    for (size_t k = 0; k < count; ++k) {
      table.piece[k] = f.pieces[first + k];
      table.vec = table.vec && aligned16(f.pieces[first + k]);
    }
    if (const char* err = launch(table)) return err;
  }
  return nullptr;
}

inline int64_t fold_chunks(const FoldArgs& f) { return (f.numel + kChunk - 1) / kChunk; }

namespace {
__global__ void __launch_bounds__(kThreads)
    fold_kernel(float* __restrict__ acc, int64_t numel, const __grid_constant__ FoldTable table) {
  fold_thread(acc, numel, table, blockIdx.x, threadIdx.x);
}
}  // namespace

}  // namespace cuda

const char* fold_pieces_cuda(const FoldArgs& f, void* stream) {
  using namespace cuda;
  const int64_t chunks = fold_chunks(f);
  if (chunks == 0) return nullptr;
  if (chunks > INT_MAX) return "fused_accum: fold_pieces of more than 2^31 chunks";
  const auto s = static_cast<cudaStream_t>(stream);
  return for_each_fold_table(f, [&](const FoldTable& table) {
    fold_kernel<<<static_cast<int>(chunks), kThreads, 0, s>>>(f.acc, f.numel, table);
    return last_error();
  });
}

}  // namespace fused_accum
