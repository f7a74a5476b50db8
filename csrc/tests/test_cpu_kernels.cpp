// The CPU kernels' plumbing (csrc/cpu) without torch: tensors of awkward sizes and mixed dtypes,
// cut into parallel ranges that end mid-tensor and mid-block, against a plain per-element loop
// over the same math.h rules. Checks every element, the padding between tensors, the statistics,
// the skip on found_inf, the low-precision param copy, and the exact 2-byte masters (bf16 params
// + int16 remainders, rebuilt and split in the update loops: step_case.h's kRemainder).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../kernels.h"
#include "check.h"
#include "data.h"
#include "step_case.h"

using namespace fused_accum;
using namespace fa_test;

namespace {

// Calls f on consecutive ranges of 777 elements (not a multiple of the 1024-element block, and
// crossing tensor boundaries), as parallel_for's threads would get them.
void odd_ranges(int64_t begin, int64_t end, int64_t, const std::function<void(int64_t, int64_t)>& f) {
  for (int64_t b = begin; b < end; b += 777) f(b, std::min(end, b + 777));
}

const std::vector<int64_t> kSizes = {1, 7, 1023, 1024, 1025, 2500, 3, 64, 2049};

void test_accumulate(bool overwrite) {
  std::mt19937 rng(overwrite);
  Flat acc(kSizes, rng);
  Mixed grad(kSizes, rng);
  const Flat before = acc;
  TensorLists t;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    t.numel.push_back(kSizes[i]);
    t.index.push_back(static_cast<int64_t>(i));
    t.acc.add(acc.at(i), DType::kF32);
    t.grad.add(grad.ptr(i), grad.dtype(i));
  }
  float found_inf = 0.0f, sumsq = 1.5f;
  accumulate_cpu(t, {0.37f, overwrite, &found_inf, &sumsq}, odd_ranges);
  double want_sumsq = 1.5;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    for (int64_t j = 0; j < kSizes[i]; ++j) {
      const float want = math::accumulate(before.value(i, j), grad.value(i, j), 0.37f, overwrite);
      want_sumsq += double(want) * want;
      CHECK(close(acc.value(i, j), want), "overwrite=%d tensor %zu [%lld]: %g want %g", overwrite,
            i, (long long)j, acc.value(i, j), want);
    }
  }
  CHECK(acc.padding_intact(), "padding written");
  CHECK(std::fabs(sumsq - want_sumsq) <= 1e-5 * want_sumsq, "sumsq %g want %g", sumsq, want_sumsq);
  CHECK(found_inf == 0.0f, "found_inf set on finite values");

  grad.set(3, 1000, INFINITY);
  accumulate_cpu(t, {1.0f, false, &found_inf, nullptr}, odd_ranges);
  CHECK(found_inf == 1.0f, "inf not flagged");
}

// The CPU step of each algorithm (step_case.h's check_all_steps calls it).
struct CpuStep {
  template <class Algo>
  void operator()(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h) const {
    step_cpu<Algo>(t, a, h, odd_ranges);
  }
};

}  // namespace

TEST_MAIN(test_accumulate(false); test_accumulate(true);
          check_all_steps(kSizes, CpuStep{}, "cpu"))
