// fused_accum._C, the Python module: `import fused_accum._C` loads this library, which also
// registers the fused_accum_ext:: operators (bindings.cpp, bindings_cuda.cpp). The module says
// whether the CUDA kernels were compiled in (setup.py defines FA_WITH_CUDA) and holds the C++
// hooks' table (hooks.cpp binds it; its contract is fused_accum/arrivals.py's HookTable) and the Triton
// plan helper (triton_plans.cpp).
#include "hooks.h"

#ifndef FA_WITH_CUDA
#define FA_WITH_CUDA 0
#endif

namespace fused_accum {
py::bytes addresses_and_dtypes(const std::vector<at::Tensor>& tensors);  // triton_plans.cpp
void swap_storages(const at::Tensor& a, const at::Tensor& b);            // bindings.cpp
}  // namespace fused_accum

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "fused_accum's C++/CUDA kernels (as torch.ops.fused_accum_ext.*) and C++ autograd hooks";
  m.attr("built_with_cuda") = FA_WITH_CUDA;
  m.def("addresses_and_dtypes", &fused_accum::addresses_and_dtypes, py::arg("tensors"));
  m.def("swap_storages", &fused_accum::swap_storages, py::arg("a"), py::arg("b"));
  fused_accum::bind_arrivals(m);  // (hooks.cpp)
}
