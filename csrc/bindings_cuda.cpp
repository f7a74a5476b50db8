// The CUDA implementations of the fused_accum_ext:: operators (declared in fused_accum/ops.py): the
// same checks as on the CPU (bindings.h), then a launch on the current stream of the tensors'
// device. Nothing here waits for the GPU: lr, coef, steps and found_inf are read by the kernels,
// and no host memory is copied to the device (the tables are kernel parameters), so every op can be
// captured in a CUDA graph; the allocations (accumulate's norm workspace, the float64 copy of a
// float32 lr, contiguous copies of strided tensors) come from torch's caching allocator (a graph's
// private pool during capture).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "bindings.h"
#include "cuda/launch.h"

namespace fused_accum {
namespace {

using binding::Call;

// launch(stream) with the call's device current, on that device's current stream.
template <class Launch>
void launch_on(const Call& call, const char* op, Launch&& launch) {
  const c10::cuda::CUDAGuard guard(call.device);
  const char* err = launch(c10::cuda::getCurrentCUDAStream(call.device.index()).stream());
  TORCH_CHECK(err == nullptr, "fused_accum_ext::", op, ": CUDA kernel launch failed: ", err);
}

struct CudaBackend {
  static void accumulate(const Call& c, const AccumulateArgs& a) {
    // One fp32 partial per block for the deterministic norm (see accumulate.cu); freed back to
    // the caching allocator on this stream when the launches are queued, reused in order.
    const int64_t n = accumulate_cuda_workspace(c.lists, a);
    const c10::cuda::CUDAGuard guard(c.device);
    const at::Tensor workspace =
        n > 0 ? at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(c.device)) : at::Tensor();
    float* partials = n > 0 ? workspace.data_ptr<float>() : nullptr;
    launch_on(c, "accumulate_", [&](void* s) { return accumulate_cuda_into(c.lists, a, partials, s); });
  }
  static void fold_pieces(const Call& c, const FoldArgs& f) {
    launch_on(c, "fold_pieces_", [&](void* s) { return fold_pieces_cuda(f, s); });
  }
  // A host step's sources (offload's double-buffered state) have no CUDA kernel: the device
  // steps in place.
  static void refuse_sources(const Call& c, const char* op) {
    TORCH_CHECK(!c.lists.sourced(), "fused_accum_ext::", op,
                ": sources are for host (CPU) steps; the cuda backend does not read them");
  }
  template <class Algo>
  static void step(const Call& c, const StepArgs& a, const typename Algo::Hyper& h) {
    refuse_sources(c, Algo::kOp);
    launch_on(c, Algo::kOp, [&](void* s) { return step_cuda<Algo>(c.lists, a, h, s); });
  }
};

}  // namespace
}  // namespace fused_accum

TORCH_LIBRARY_IMPL(fused_accum_ext, CUDA, m) {
  fused_accum::binding::register_impls<fused_accum::CudaBackend>(m);
}
