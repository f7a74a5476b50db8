// Test data shared by the standalone kernel tests: flat padded fp32 buffers (as the optimizer lays
// out accumulators and state) and lists of gradients/params of mixed dtypes, some of them not
// 16-byte aligned.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../cpu/convert.h"
#include "../kernels.h"

namespace fa_test {

using fused_accum::DType;
constexpr int64_t kPad = 64;  // slices padded as the optimizer pads them; padding must survive
constexpr float kSentinel = -7.0f;

inline bool close(float got, float want) {
  return std::fabs(got - want) <= 1e-6f + 1e-6f * std::fabs(want);
}

// A flat fp32 buffer with one padded slice per size, filled with N(0, 1) (|N(0, 1)| if positive).
struct Flat {
  std::vector<int64_t> sizes, offset;
  std::vector<float> data;
  Flat(const std::vector<int64_t>& sizes_, std::mt19937& rng, bool positive = false) : sizes(sizes_) {
    std::normal_distribution<float> normal;
    for (int64_t n : sizes) {
      offset.push_back(static_cast<int64_t>(data.size()));
      for (int64_t j = 0; j < n; ++j) data.push_back(positive ? std::fabs(normal(rng)) : normal(rng));
      data.resize((data.size() + kPad - 1) / kPad * kPad, kSentinel);
    }
  }
  float* at(size_t i) { return data.data() + offset[i]; }
  float value(size_t i, int64_t j) const { return data[offset[i] + j]; }
  bool padding_intact() const {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t end = i + 1 < sizes.size() ? offset[i + 1] : static_cast<int64_t>(data.size());
      for (int64_t k = offset[i] + sizes[i]; k < end; ++k)
        if (data[k] != kSentinel) return false;
    }
    return true;
  }
};

const std::vector<DType> kAllDtypes = {DType::kF32, DType::kBF16, DType::kF16};

// One tensor per size, of the dtypes of `cycle` in turn; every fourth tensor starts one element
// into its storage, so it is not 16-byte aligned.
struct Mixed {
  std::vector<std::vector<uint16_t>> half;
  std::vector<std::vector<float>> full;
  std::vector<DType> dtypes;
  std::vector<int> shift;
  Mixed(const std::vector<int64_t>& sizes, std::mt19937& rng,
        const std::vector<DType>& cycle = kAllDtypes) {
    std::normal_distribution<float> normal;
    for (size_t i = 0; i < sizes.size(); ++i) {
      dtypes.push_back(cycle[i % cycle.size()]);
      shift.push_back(i % 4 == 3 ? 1 : 0);
      half.emplace_back(sizes[i] + 1);
      full.emplace_back(sizes[i] + 1);
      for (int64_t j = 0; j < sizes[i]; ++j) {
        const float v = normal(rng);
        half[i][j + shift[i]] =
            dtypes[i] == DType::kBF16 ? fused_accum::cpu::float_to_bf16(v) : fused_accum::cpu::float_to_f16(v);
        full[i][j + shift[i]] = v;
      }
    }
  }
  DType dtype(size_t i) const { return dtypes[i]; }
  void* ptr(size_t i) {
    if (dtypes[i] == DType::kF32) return full[i].data() + shift[i];
    return half[i].data() + shift[i];
  }
  float value(size_t i, int64_t j) const {
    const int64_t k = j + shift[i];
    switch (dtypes[i]) {
      case DType::kBF16: return fused_accum::cpu::bf16_to_float(half[i][k]);
      case DType::kF16: return fused_accum::cpu::f16_to_float(half[i][k]);
      default: return full[i][k];
    }
  }
  void set(size_t i, int64_t j, float v) {
    const int64_t k = j + shift[i];
    if (dtypes[i] == DType::kF32) full[i][k] = v;
    else if (dtypes[i] == DType::kBF16) half[i][k] = fused_accum::cpu::float_to_bf16(v);
    else half[i][k] = fused_accum::cpu::float_to_f16(v);
  }
  // Rounded as the kernels round when they write this tensor.
  float rounded(size_t i, float v) const {
    switch (dtypes[i]) {
      case DType::kBF16: return fused_accum::cpu::bf16_to_float(fused_accum::cpu::float_to_bf16(v));
      case DType::kF16: return fused_accum::cpu::f16_to_float(fused_accum::cpu::float_to_f16(v));
      default: return v;
    }
  }
};

}  // namespace fa_test
