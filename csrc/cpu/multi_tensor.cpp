// dtype conversion loops shared by the CPU kernels (staging a block of bf16/fp16 values as fp32).
#include "multi_tensor.h"

#include <cstring>

#include "convert.h"

namespace fused_accum {
namespace cpu {

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
  }
}

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
  }
}

}  // namespace cpu
}  // namespace fused_accum
