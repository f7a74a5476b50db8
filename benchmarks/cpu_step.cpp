// The CPU AdamW step alone, without torch or Python: one tensor of n elements stepped by
// csrc/cpu/kernels.cpp on one thread (a serial parallel_for), fp32 params or fp32 masters with
// bf16 copies. Prints the thread's CPU time per element, min and median over the calls (thread
// CPU time leaves out the time the thread waited for a core, so a shared machine skews it less
// than wall-clock time), or, with one call under valgrind --tool=callgrind, gives the step's
// instruction count (callgrind_annotate --inclusive=yes: the step_cpu line; valgrind runs the
// x86-64-v3 clones, not the AVX-512 ones).
//
// Build against a tree's kernels with setup.py's flags, then run (fp32|bf16, elements, calls,
// and "cold" to write 128 MB between calls, so the step's operands come from memory):
//   g++ -O3 -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off -std=c++17
//     -iquote csrc csrc/cpu/kernels.cpp benchmarks/cpu_step.cpp -o /tmp/cpu_step   (one line)
//   /tmp/cpu_step bf16 16777216 5;  /tmp/cpu_step fp32 1048576 15 cold
// For a tree before the algorithm traits (adam_step_cpu, math::adam_hyper), add -DFA_BEFORE_TRAITS.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <vector>

#include "kernels.h"

using namespace fused_accum;

namespace {

void serial(int64_t begin, int64_t end, int64_t, const std::function<void(int64_t, int64_t)>& f) { f(begin, end); }

double thread_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

uint16_t to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

int main(int argc, char** argv) {
  const bool bf16 = argc > 1 && !std::strcmp(argv[1], "bf16");
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : (1 << 20);
  const int calls = argc > 3 ? std::atoi(argv[3]) : 1;
  const bool cold = argc > 4 && !std::strcmp(argv[4], "cold");
  std::vector<float> p(n), acc(n), m(n), v(n);
  std::vector<uint16_t> lp(n);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = normal(rng);
    acc[j] = normal(rng) * 1e-3f;
    m[j] = normal(rng) * 1e-3f;
    v[j] = std::fabs(normal(rng)) * 1e-6f;
    lp[j] = to_bf16(p[j]);  // the masters' rounding, as the optimizer keeps them
  }
  TensorLists t;
  t.numel.push_back(n);
  t.index.push_back(0);
  t.acc.add(acc.data(), DType::kF32);
  t.param.add(p.data(), DType::kF32);
  t.state1.add(m.data(), DType::kF32);
  t.state2.add(v.data(), DType::kF32);
  if (bf16) t.lp.add(lp.data(), DType::kBF16);
  double lr = 1e-3;
  float coef = 1.0f, step = 1.0f;
  const StepArgs args{&lr, &coef, &step, nullptr, 1.0f, false, false};
#ifdef FA_BEFORE_TRAITS
  const auto hyper = math::adam_hyper(0.9, 0.999, 1e-8, 0.01, true);
#else
  const auto hyper = math::Adam::hyper(0.9, 0.999, 1e-8, 0.01, true);
#endif
  std::vector<float> scratch(cold ? (32 << 20) : 0);
  std::vector<double> ns;
  for (int c = 0; c < calls; ++c) {
    if (cold) std::fill(scratch.begin(), scratch.end(), float(c));
    const double start = thread_ns();
#ifdef FA_BEFORE_TRAITS
    adam_step_cpu(t, args, hyper, serial);
#else
    step_cpu<math::Adam>(t, args, hyper, serial);
#endif
    ns.push_back((thread_ns() - start) / n);
  }
  std::sort(ns.begin(), ns.end());
  std::printf("%s n=%lld calls=%d: min %.3f median %.3f ns per element (thread CPU time)\n",
              bf16 ? "bf16 copy + fp32 master" : "fp32", static_cast<long long>(n), calls, ns[0], ns[ns.size() / 2]);
}
