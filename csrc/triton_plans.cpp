// What the Triton backend's launch-plan cache keys a call by (fused_accum/backends/triton/plans.py):
// each tensor's address and dtype, as int64 pairs in one bytes object. C++ because one pass here
// takes ~0.05 us per tensor; Python reads each at ~0.14 us per tensor and attribute, more than the
// goal for a whole call.
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace fused_accum {

pybind11::bytes addresses_and_dtypes(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> out;
  out.reserve(2 * tensors.size());
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.defined(), "addresses_and_dtypes: an undefined tensor");
    out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    out.push_back(static_cast<int64_t>(t.scalar_type()));
  }
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

}  // namespace fused_accum
