// CUDA entry points beyond csrc/kernels.h's, for the torch binding (csrc/bindings_cuda.cpp):
// accumulate with a workspace the caller allocates (torch's caching allocator, so it is
// stream-ordered, reused, and taken from a graph's private pool during capture).
#pragma once

#include <cstdint>

#include "../kernels.h"

namespace fused_accum {

// Floats of workspace accumulate_cuda_into needs for `t` and `a` (0 without sumsq): one partial
// sum of squares per block, reduced in a fixed order (deterministic norm).
int64_t accumulate_cuda_workspace(const TensorLists& t, const AccumulateArgs& a);

// accumulate_cuda with `workspace` (accumulate_cuda_workspace floats on the stream's device).
const char* accumulate_cuda_into(const TensorLists& t, const AccumulateArgs& a, float* workspace,
                                 void* stream);

}  // namespace fused_accum
