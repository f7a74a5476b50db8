// The interface between the binding (csrc/bindings*.cpp, which owns tensors, checks and streams)
// and the kernels (csrc/cpu, csrc/cuda, which see raw pointers only).
//
// It uses no torch type, so the .cu files compile without torch's headers (with them, each .cu
// takes minutes on a 2-core machine) and csrc/ builds standalone under CMake for its unit tests.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "math.h"

namespace fused_accum {

// Element type of a gradient or parameter array. Accumulators and optimizer state are float32.
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kI16 = 3 };  // kI16: remainders

// One operand of a multi-tensor op: a pointer and a dtype per tensor. An empty operand is
// absent (no lp_params, no fused grads, no momentum buffers).
struct Operand {
  std::vector<void*> ptr;
  std::vector<DType> dtype;
  bool present() const { return !ptr.empty(); }
  void add(void* p, DType dt) {
    ptr.push_back(p);
    dtype.push_back(dt);
  }
};

// The tensors of one call, all of length numel[i] for tensor i, contiguous, on one device.
// Tensors with no elements are dropped by the binding before this point.
struct TensorLists {
  std::vector<int64_t> numel;
  std::vector<int64_t> index;  // position of each tensor in the caller's lists (for steps[])
  // the rows of each tensor's matrix, for a step whose scalars take its shape (math.h's
  // kShaped: a split step's epilogue); empty for the others
  std::vector<int64_t> rows;
  Operand acc;      // float32 accumulators: written by accumulate, read by the steps
  Operand grad;     // incoming gradients (accumulate; a step's fused last micro-batch)
  Operand param;    // what a step updates: fp32 master, or the parameter itself
  // fp32 optimizer states, the algorithm's state lists in order (math.h: its kStateLists), for
  // example Adam's exp_avg, exp_avg_sq and amsgrad's max_exp_avg_sq; absent where unused
  Operand state1, state2, state3;
  Operand lp;       // low-precision params receiving the updated param, rounded
  // int16 remainders (exact 2-byte masters): when present, param is bf16 and the master is
  // math::rebuild_master(param, rem), split back into both after the update (lp is absent)
  Operand rem;
  // Sources (issue 37; CPU only): where an out-of-place step reads the old values of the
  // operand it writes (same dtype, overlapping nothing written); it writes every element of the
  // operand. Absent where that operand is, or for an in-place step.
  enum Written { kParam = 0, kLp, kRem, kState1, kState2, kState3, kWritten };
  Operand source[kWritten];
  bool sourced() const { return source[kParam].present(); }
  const Operand& written(int k) const {
    const Operand* const ops[kWritten] = {&param, &lp, &rem, &state1, &state2, &state3};
    return *ops[k];
  }
  int64_t size() const { return static_cast<int64_t>(numel.size()); }
};

// Scalars of accumulate. found_inf/sumsq may be null; they live on the tensors' device.
struct AccumulateArgs {
  float alpha;
  bool overwrite;
  float* found_inf;
  float* sumsq;
};

// fold_pieces (fused_accum.ops.FoldPieces): acc[j] = (((acc[j] + p0[j]) + p1[j]) + ...), one fp32
// add per piece in order, or with overwrite (((p0[j] + p1[j]) + ...) starting from p0[j] itself.
// Every piece is contiguous, numel elements of `dtype`; acc is numel contiguous fp32 on the same
// device, overlapping no piece.
struct FoldArgs {
  float* acc = nullptr;
  int64_t numel = 0;
  std::vector<const void*> pieces;  // at least one
  DType dtype = DType::kF32;
  bool overwrite = false;
};

// Device scalars of every step: read where the kernel runs, so a new lr or coef neither syncs
// the host nor recompiles a captured graph. lr is a double, as torch's fused optimizers take it
// (math.h: the per-tensor scalars start from it); the binding widens a float32 lr tensor.
struct StepArgs {
  const double* lr;
  const float* coef;
  const float* steps;      // indexed by TensorLists::index
  const float* found_inf;  // may be null
  float grad_alpha;
  bool grads_overwrite;
  bool maximize;
};

// ---- CPU (csrc/cpu) ------------------------------------------------------------------------------

// parallel_for(begin, end, grain, f): the binding passes at::parallel_for; the standalone tests
// pass a serial loop. f may run concurrently on disjoint sub-ranges.
using ParallelFor =
    std::function<void(int64_t, int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)>;

void accumulate_cpu(const TensorLists& t, const AccumulateArgs& a, const ParallelFor& pf);
void fold_pieces_cpu(const FoldArgs& f, const ParallelFor& pf);
// The step of algorithm Algo (math.h: instantiated for each of FUSED_ACCUM_ALGORITHMS).
template <class Algo>
void step_cpu(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h, const ParallelFor& pf);

// ---- CUDA (csrc/cuda) ----------------------------------------------------------------------------

// Launch on `stream` (a cudaStream_t) on the current device. Return nullptr, or the CUDA error
// message of a failed launch.
const char* accumulate_cuda(const TensorLists& t, const AccumulateArgs& a, void* stream);
// One launch per kMaxFoldPieces pieces (csrc/cuda/fold.cu): one for any all-to-all up to 256 ranks.
const char* fold_pieces_cuda(const FoldArgs& f, void* stream);
template <class Algo>
const char* step_cuda(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h, void* stream);

}  // namespace fused_accum
