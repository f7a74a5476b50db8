// fused_accum._C, the Python module: `import fused_accum._C` loads this library, which also
// registers the fused_accum_ext:: operators (bindings.cpp, bindings_cuda.cpp). The module says
// whether the CUDA kernels were compiled in (setup.py defines FA_WITH_CUDA) and holds the C++
// hooks' table (hooks.cpp; its contract is fused_accum/arrivals.py's FastPath) and the Triton
// plan helper (triton_plans.cpp).
#include "hooks.h"

#ifndef FA_WITH_CUDA
#define FA_WITH_CUDA 0
#endif

namespace fused_accum {
py::bytes addresses_and_dtypes(const std::vector<at::Tensor>& tensors);  // triton_plans.cpp
}  // namespace fused_accum

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using fused_accum::Arrivals;
  m.doc() = "fused_accum's C++/CUDA kernels (as torch.ops.fused_accum_ext.*) and C++ autograd hooks";
  m.attr("built_with_cuda") = FA_WITH_CUDA;
  m.def("addresses_and_dtypes", &fused_accum::addresses_and_dtypes, py::arg("tensors"));
  py::class_<Arrivals, std::shared_ptr<Arrivals>>(m, "Arrivals")
      .def(py::init<py::object, py::object, py::object, py::object, py::object>(), py::arg("before_backward"),
           py::arg("queue_end"), py::arg("bucket_complete"), py::arg("fold_hooked"), py::arg("backward_raised"))
      // HookTable
      .def("extend", &Arrivals::extend)
      .def("attach", &Arrivals::attach)
      .def("rehook", &Arrivals::rehook)
      .def("detach_all", &Arrivals::detach_all)
      .def("arrive_in_place", &Arrivals::arrive_in_place)
      .def("take_partial", &Arrivals::take_partial)
      .def("clear", &Arrivals::clear)
      .def("has_arrivals", &Arrivals::has_arrivals)
      .def("expose", &Arrivals::expose)
      .def("changed", &Arrivals::changed)
      .def("clear_grads", &Arrivals::clear_grads)
      .def_property(
          "stands_aside", [](Arrivals& a) { return a.stands_aside_.load(); },
          [](Arrivals& a, bool v) { a.stands_aside_ = v; })
      .def_property(
          "slow", [](Arrivals& a) { return a.slow_.load(); }, [](Arrivals& a, bool v) { a.slow_ = v; })
      .def_property(
          "hide", [](Arrivals& a) { return a.hide_.load(); }, [](Arrivals& a, bool v) { a.hide_ = v; })
      // FastPath
      .def("grant_fast", &Arrivals::grant_fast)
      .def("revoke_fast", &Arrivals::revoke_fast)
      .def("take_overwritten", &Arrivals::take_overwritten)
      .def("arm_quiet", &Arrivals::arm_quiet)
      .def("quiet_backwards", &Arrivals::quiet_backwards)
      .def("python_seen", &Arrivals::python_seen);
}
