// The CUDA implementations of the fused_accum_ext:: operators (schemas in bindings.cpp): the same
// checks as on the CPU (bindings.h), then a launch on the current stream of the tensors' device.
// Nothing here waits for the GPU: lr, coef, steps and found_inf are read by the kernels.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "bindings.h"

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
    launch_on(c, "accumulate_", [&](void* s) { return accumulate_cuda(c.lists, a, s); });
  }
  static void step(const Call& c, const StepArgs& a, const math::SgdHyper& h) {
    launch_on(c, "sgd_step_", [&](void* s) { return sgd_step_cuda(c.lists, a, h, s); });
  }
  static void step(const Call& c, const StepArgs& a, const math::AdamHyper& h) {
    launch_on(c, "adam_step_", [&](void* s) { return adam_step_cuda(c.lists, a, h, s); });
  }
  static void step(const Call& c, const StepArgs& a, const math::LionHyper& h) {
    launch_on(c, "lion_step_", [&](void* s) { return lion_step_cuda(c.lists, a, h, s); });
  }
};

}  // namespace
}  // namespace fused_accum

TORCH_LIBRARY_IMPL(fused_accum_ext, CUDA, m) {
  fused_accum::binding::register_impls<fused_accum::CudaBackend>(m);
}
